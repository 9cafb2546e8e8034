"""The state server's wire format: message tags and fixed-size numpy buffers.

Every control message is one float64[8] buffer (``MSG_LEN``) sent with ``Send``/``Recv`` on the
buffer (no pickle: on these machines a pickled numpy message costs 35-49 µs one-way against
2-4 µs for a buffer).  Integers (iterations, rounds, counts) travel as float64, exact
up to 2**53.  Variable-size payloads (OSP layer importance, parameter-server weights) follow
their header as a second float64 message with tag ``DATA``; the header carries the count.

Request layout (worker -> server)::

    [SEQ, ITER, COMPUTE, ROUND, AGG, WAIT, COUNT, FLAG]

A LOSS request carries the worker's gradient noise in three slots it has no other use for
(``mpsync.auto.noise``): COMPUTE and WAIT hold ``L_NOISE``, the summed ½|g₁ - g₂|² of pairs
of two batches' gradients at the same weights, and ``L_POWER``, their summed ½(|g₁|² + |g₂|²) (both >= 0,
as those slots must be; the dot product g₁ · g₂ is their difference); ROUND holds
``L_PAIRS``, how many pairs (0: none since the last report).  The step test's sums, signed,
follow a LOSS as a STRIDE header and a DATA payload of ``STRIDE_LEN`` float64: pairs, p, a,
q (``mpsync.auto.curvature``); no reply.  A STRIDE of 0 pairs (p, a and q 0) says, once, that
the worker's optimizer admits no step test (not SGD: an adaptive optimizer's steps).

Reply layout (server -> worker)::

    [ACTION, LOCAL_ITERS, ROUND, SEQ, EXTRA, COUNT, VERSION, PULL_ROUND]

``PULL_ROUND`` (``R_PULL_ROUND``): BSP with the server-side optimizer on shards, a pull's
grant names the round it reads (0: none, read the weights as they are), and COUNT the workers
whose pushes that round leaves out, their indices following as ``REPLY_DATA``
(``StateServer._round_told``, ``ServerUpdates``); 0 in every other reply.
"""

from __future__ import annotations

import numpy as np

MSG_LEN = 8

# Request slots.
SEQ, ITER, COMPUTE, ROUND, AGG, WAIT, COUNT, FLAG = range(8)
# A LOSS request's gradient-noise slots (module doc).
L_NOISE, L_POWER, L_PAIRS = COMPUTE, WAIT, ROUND
# Reply slots.
R_ACTION, R_LOCAL, R_ROUND, R_SEQ, R_EXTRA, R_COUNT, R_VERSION, R_PULL_ROUND = range(8)

# Request tags.
REGISTER = 101
STEP = 102          # report (iteration k finished, compute time) + query, one round trip
RESET = 103         # an aggregation finished: the worker enters round ROUND
IMPORTANCE = 104    # OSP: per-layer importance follows as DATA; reply: bitmap as REPLY_DATA
PS_INIT = 105       # parameter server: initial weights follow as DATA
PUSH = 106          # parameter server: an update follows as DATA
PULL = 107          # parameter server: reply header, then the weights as REPLY_DATA
STATS = 108         # reply: JSON bytes as REPLY_STATS
SHUTDOWN = 109
DATA = 110
LOSS = 111          # the worker's mean training loss (AGG) over COUNT iterations; no reply
ALIVE = 112         # the worker is busy outside its steps (its script's collectives); no reply
BEAT = 113          # the heartbeat thread: one float64, its period; no reply (not a request)
PUSH_PULL = 114     # sharded PS: a push the shards took and the pull after it; reply as PULL's
STRIDE = 115        # auto's step test: COUNT sums follow as DATA (STRIDE_LEN); no reply
REQUEST_TAGS = (REGISTER, STEP, RESET, IMPORTANCE, PS_INIT, PUSH, PULL, STATS, SHUTDOWN, LOSS,
                ALIVE, PUSH_PULL, STRIDE)
TAG_NAMES = {REGISTER: "register", STEP: "step", RESET: "reset", IMPORTANCE: "importance",
             PS_INIT: "ps_init", PUSH: "push", PULL: "pull", STATS: "stats",
             SHUTDOWN: "shutdown", DATA: "data", LOSS: "loss", ALIVE: "alive",
             BEAT: "beat", PUSH_PULL: "push_pull", STRIDE: "stride"}
# STRIDE's payload: the step test's pairs and its summed p, a and q (``mpsync.auto.curvature``).
STRIDE_LEN = 4

# Reply tags.
REPLY = 120
REPLY_DATA = 121
REPLY_STATS = 122

# Decisions.
LOCAL = 0
SYNC = 1

# Largest payload a DATA message may announce (float64 elements): 2**31 elements = 16 GiB.
RING_ONLY = 1        # REGISTER's FLAG: auto must not move this worker to the PS
# LOSS's FLAG, bits: the loss was NaN or inf (AGG is then 0); the worker's learning rate
# changed since its last report (``auto`` re-admits what it ruled out at the old one).
NOT_FINITE, LR_CHANGED = 1, 2
MAX_COUNT = 2 ** 31
# Iteration numbers beyond this are rejected as corrupt (2**53: exact in float64).
MAX_ITER = 2 ** 53


def new_msg() -> np.ndarray:
    return np.zeros(MSG_LEN, dtype=np.float64)
