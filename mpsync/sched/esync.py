"""ESync State Server: QUERY-STATE (ESync paper Alg. 2) and the delayed-ACK mode (§4.2).

The record table of Alg. 2, "(rank, local_iterations, capability, last_finish_time, ready,
round)", is kept by the server as five arrays indexed by rank (the index is the rank):

=================  ========  ==================================================================
``local_iters``    int64     k: local iterations the device has done this round
``capability``     float64   c: seconds per local iteration (Alg. 1 line 14: its last one)
``last_finish``    float64   t_e: when its last local iteration finished (server clock, see
                             below)
``ready``          bool      told READY this round
``round_``         int64     communication rounds it has completed (RESET-STATE-SERVER)
=================  ========  ==================================================================

Clock: Alg. 1 sends the device's own GET-CURRENT-TIME() as t_e and Alg. 2 compares it with the
server's clock, which assumes synchronized clocks. In mpsync the server stamps t_e itself on
receipt, so no agreement of clocks across machines is assumed; the kernels only need t_e and
``now`` on one clock.
"""

from __future__ import annotations

import numpy as np

from mpsync.sched._numba import jit

__all__ = [
    "esync_slowest",
    "esync_ready",
    "esync_ready_given_slowest",
    "esync_ready_reference",
    "esync_query_state",
    "esync_reset",
    "esync_ready_delayed_ack",
    "esync_delta",
    "esync_slowest_reference",
    "esync_query_state_reference",
    "esync_reset_reference",
    "esync_ready_delayed_ack_reference",
    "esync_delta_reference",
]


@jit
def _check_table(local_iters, capability, last_finish, ready, round_, p):
    n = capability.shape[0]
    if n < 1:
        raise ValueError("the record table is empty")
    if (
        local_iters.shape[0] != n
        or last_finish.shape[0] != n
        or ready.shape[0] != n
        or round_.shape[0] != n
    ):
        raise ValueError("record table arrays differ in length")
    if p < 0 or p >= n:
        raise ValueError("rank p is out of range")


@jit
def esync_slowest(capability):
    """FIND-SLOWEST-DEVICE (Alg. 2 line 4): the largest capability c, i.e. the most seconds per
    iteration (§4.1 orders c_1 >= ... >= c_p, c_1 the slowest); lowest rank among ties."""
    s = 0
    for i in range(1, capability.shape[0]):
        if capability[i] > capability[s]:
            s = i
    return s


@jit
def esync_ready(local_iters, capability, last_finish, ready, round_, p, now, eps):
    """Alg. 2 QUERY-STATE decision: True = READY (aggregate now), False = NOT-READY (train on).

    Pure: the record of the querying rank ``p`` must already hold this query's (k, c, t_e)
    (Alg. 2 line 3) and nothing is written; :func:`esync_query_state` does both. Lines 4-12:

    * slowest = the rank with the largest capability;
    * NOT-READY if ``local_iters[p] == 0`` (every device does at least one local iteration) or
      the slowest has not completed the PULL of the previous aggregation yet, read as
      ``round_[slowest] < round_[p]`` (it has not been reset into p's round);
    * rest_time = c_slowest - now + t_e,slowest: time until the slowest device finishes the
      local iteration it is running;
    * READY if p is the slowest, or the slowest is already READY, or
      ``capability[p] + eps > rest_time`` (p cannot finish another iteration in time);
      otherwise NOT-READY.

    ``eps`` is ESync's ε, "a small constant to avoid boundary error" (0.5 s in the authors'
    reference code). For the delayed-ACK mode of §4.2 see :func:`esync_ready_delayed_ack`.
    """
    _check_table(local_iters, capability, last_finish, ready, round_, p)
    return esync_ready_given_slowest(local_iters, capability, last_finish, ready, round_, p,
                                     esync_slowest(capability), now, eps)


@jit
def esync_ready_given_slowest(local_iters, capability, last_finish, ready, round_, p, s, now,
                              eps):
    """Lines 5-12 of :func:`esync_ready` once line 4 has found the slowest device ``s``
    (:func:`esync_slowest` of the capabilities): the decision itself, in O(1).  The simulator,
    which keeps the slowest in a tree instead of scanning, asks this same function."""
    if local_iters[p] == 0 or round_[s] < round_[p]:
        return False
    rest_time = capability[s] - now + last_finish[s]
    return p == s or ready[s] or capability[p] + eps > rest_time


def esync_ready_reference(records, p: int, now: float, eps: float) -> bool:
    """Plain-Python reference of :func:`esync_ready` over Alg. 2's record tuples
    ``(rank, local_iterations, capability, last_finish_time, ready, round)``."""
    slowest = max(records, key=lambda r: (r[2], -r[0]))
    current = records[p]
    if current[1] == 0 or slowest[5] < current[5]:
        return False
    rest_time = slowest[2] - now + slowest[3]
    return current[0] == slowest[0] or bool(slowest[4]) or current[2] + eps > rest_time


@jit
def esync_query_state(local_iters, capability, last_finish, ready, round_, p, k, c, t_e, now, eps):
    """Alg. 2 in full, updating the table in place: record (k, c, t_e) for rank p (line 3),
    decide (lines 4-9, :func:`esync_ready`), mark p ready when READY (line 10). Returns the
    decision. ``t_e`` is when p's last local iteration finished, ``now`` the server's clock."""
    _check_table(local_iters, capability, last_finish, ready, round_, p)
    local_iters[p] = k
    capability[p] = c
    last_finish[p] = t_e
    ok = esync_ready(local_iters, capability, last_finish, ready, round_, p, now, eps)
    if ok:
        ready[p] = True
    return ok


@jit
def esync_reset(local_iters, last_finish, ready, round_, p, t, t_e):
    """RESET-STATE-SERVER(r, t, t_e) (Alg. 1 line 25, after p pulled the aggregate of round
    t - 1): k = 0, not ready, round = t, last finish = t_e. Capability is kept: it is still the
    best estimate of p's next iteration. (The paper gives no body; this is our reading of it.)
    """
    n = ready.shape[0]
    if p < 0 or p >= n:
        raise ValueError("rank p is out of range")
    local_iters[p] = 0
    ready[p] = False
    round_[p] = t
    last_finish[p] = t_e


@jit
def esync_ready_delayed_ack(local_iters, compute_time, rtt, last_finish, ready, round_, p, now, eps):
    """§4.2 non-blocking mode with delayed ACK: Alg. 2 with c_i redefined as the time to
    process b samples *plus* the RTT of a state query on device i, so both slow devices and
    slow links count as slow. Devices keep training on an implicit NOT-READY; only READY is
    sent (this function returning True). The worker then aborts iteration k + δ and aggregates
    iterations 1..k + δ - 1 (``mpsync.torch.strategies.LocalStepsThenAggregate``, which sees
    the READY between the iteration's backward and its optimizer step), δ as in
    :func:`esync_delta`.
    """
    capability = compute_time + rtt
    return esync_ready(local_iters, capability, last_finish, ready, round_, p, now, eps)


@jit
def esync_delta(compute_time, rtt):
    """δ of §4.2: δ - 1 is the number of local iterations that fit in one RTT, so
    δ = floor(rtt / compute_time) + 1 (δ = 1 on a zero-latency link)."""
    if not compute_time > 0.0:
        raise ValueError("compute_time must be > 0")
    if rtt < 0.0:
        raise ValueError("rtt must be >= 0")
    return np.int64(np.floor(rtt / compute_time)) + 1


# --- Plain-Python references over Alg. 2's record tuples -------------------------------------
# A record is (rank, local_iterations, capability, last_finish_time, ready, round), as in Alg. 2;
# the references return new record lists instead of writing arrays in place.


def esync_slowest_reference(capability) -> int:
    """Reference of :func:`esync_slowest` (Alg. 2 line 4, FIND-SLOWEST-DEVICE): the rank with
    the largest c (§4.1: c_1 >= ... >= c_p, c_1 the slowest), lowest rank among ties."""
    c = [float(x) for x in capability]
    return c.index(max(c))


def esync_query_state_reference(records, p: int, k: int, c: float, t_e: float, now: float, eps: float):
    """Reference of :func:`esync_query_state`, Alg. 2 QUERY-STATE(r, k, c, t_e) in full:
    line 3 records (k, c, t_e) for rank p, lines 4-9 decide, line 10 marks p ready on READY.
    Returns ``(new_records, ready)``."""
    records = [tuple(r) for r in records]
    rank, _, _, _, was_ready, rnd = records[p]
    records[p] = (rank, k, c, t_e, was_ready, rnd)
    ok = esync_ready_reference(records, p, now, eps)
    if ok:
        records[p] = (rank, k, c, t_e, True, rnd)
    return records, ok


def esync_reset_reference(records, p: int, t: int, t_e: float):
    """Reference of :func:`esync_reset`, RESET-STATE-SERVER(r, t, t_e) of Alg. 1 line 25 in
    mpsync's reading: k = 0, not ready, round t, last finish t_e; capability kept."""
    records = [tuple(r) for r in records]
    rank, _, c, _, _, _ = records[p]
    records[p] = (rank, 0, c, t_e, False, t)
    return records


def esync_ready_delayed_ack_reference(records, compute_time, rtt, p: int, now: float, eps: float) -> bool:
    """Reference of :func:`esync_ready_delayed_ack` (§4.2): Alg. 2 with each record's
    capability replaced by its compute time plus its query RTT."""
    records = [
        (r[0], r[1], float(compute_time[i]) + float(rtt[i]), r[3], r[4], r[5]) for i, r in enumerate(records)
    ]
    return esync_ready_reference(records, p, now, eps)


def esync_delta_reference(compute_time: float, rtt: float) -> int:
    """Reference of :func:`esync_delta` (§4.2): δ - 1 local iterations of ``compute_time``
    complete within one RTT, counted one by one; δ = that count + 1."""
    done = 0
    while (done + 1) * compute_time <= rtt:
        done += 1
    return done + 1
