"""A shard server of the sharded parameter server (:mod:`mpsync.server.shards` describes
the design and the wire): it stores one contiguous range of the flat model, applies each
worker's slice of an update as it arrives, serves pulls, and answers who it has heard from.
It runs on a thread of its host worker rank (:class:`ShardThread`).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from mpsync.server import _fastpath, _shard_loop
from mpsync.server._client import DeadlineExceeded
from mpsync.server.shard_optimizer import ServerUpdates, pack_state
from mpsync.server.weights import BFLOAT16, WeightStore, numpy_cast

__all__ = ["ShardServer", "ShardThread", "WIRE_DTYPES", "wire_code", "LOAD", "PUSH_PULL",
           "ALL_PUSHES_IN"]


# Wire dtype codes (a tag's offset).
WIRE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BFLOAT16)
# Requests (worker -> shard, on the requests communicator).
INIT, PUSH, PULL, BYE, WATCH = 300, 310, 320, 350, 360
# Replies (shard -> worker, on a communicator of their own: see the module doc).
ACK, DATA, HEARD = 330, 340, 370
# The server-side optimizer's settings (float64, ``OptimizerSettings.to_array``), ACKed.
OPT = 380
# The weights to serve from now on, replacing the shard's (``auto`` switching to the PS).
LOAD = 390
# A checkpoint's optimizer state (``shard_optimizer.pack_state``): asked for with SAVE,
# answered as STATE; given with RESTORE + the wire code of its arrays' dtype, ACKed.
SAVE, STATE, RESTORE = 400, 410, 420
# A push answered with the shard's weights after it (+ the wire code): ACKed, then, if the
# push was applied, the slice in that dtype as DATA.  For pulls that need no grant (ASP).
PUSH_PULL = 430
OK, REFUSED = 0, 1
# A pull's barrier field: every worker's pushes are in (the last pull of training, a
# checkpoint's), so a shard stepping once per round steps on every round it merged.
ALL_PUSHES_IN = -1
# What a shard knows of a worker (the second row of a HEARD reply).
UNHEARD, HEARD_FROM, GONE = 0, 1, 2
SLEEP_MIN_S, SLEEP_MAX_S, SLEEP_IDLE_S = 20e-6, 1e-3, 4e-3
IDLE_AFTER_S = 0.05
# Waking up for a push that is due (one push interval after a worker's last): no sleep runs
# past WAKE_MARGIN_S before it, plus how late this thread's sleeps have been waking
# (``_fastpath.late_wake``: ~0.1 ms on an idle core, milliseconds beside a computing
# trainer), and the loop polls, yielding the core, until DUE_SLACK_S after it (as the state
# server's loop does for reports).
# Intervals longer than PACE_MAX_S are not paced pushes (a worker in join, a checkpoint).
WAKE_MARGIN_S, DUE_SLACK_S, PACE_MAX_S = 300e-6, 1e-3, 1.0
# A warm-up this long was a compile, not a load from the cache (a load: well under 1 s).
COMPILE_NOTE_S = 2.0


def wire_code(dtype) -> int:
    try:
        return WIRE_DTYPES.index(np.dtype(dtype))
    except ValueError:
        raise TypeError(f"the parameter server's wire carries float16/32/64 and bfloat16, got "
                        f"{dtype}") from None


class _Reply:
    """A pull's reply in flight: the request, the worker, the buffer it reads, its start."""

    __slots__ = ("request", "worker", "buf", "since")

    def __init__(self, request, worker: int, buf: np.ndarray, since: float):
        self.request, self.worker, self.buf, self.since = request, worker, buf, since


class ShardServer:
    """Serves one shard to ``n_workers`` workers until each has said ``BYE``.

    ``comm`` carries the requests, ``replies`` the answers; ``scale`` is the policy's update
    factor; ``worker_names[w]`` how log lines name worker w.  One loop: probe, receive, apply
    or serve, reply; between messages it sleeps (20 µs doubling to 1 ms, 4 ms after 50 ms of
    silence), so an idle shard costs its host little CPU, but never past a worker's next push
    (one push interval after its last): from shortly before then it polls, yielding the core,
    so a paced push finds the shard awake; it does not sleep while a pull's reply is still in
    flight.

    Where Open MPI is the MPI, pushes and pulls in the store's dtype (and a float32 store's
    on a bfloat16 wire), with the server-side optimizer's step per push too, are served by a
    compiled loop without the interpreter's lock (``_shard_loop``; ``compiled=False``: this
    loop alone); it hands every other message to this loop, which works as described here.

    Nothing a worker sends or fails to take stops the shard: a message it cannot use is
    received, logged and dropped (a push refused that way is answered ``REFUSED``); a pull
    reply a worker does not take within ``deadline`` (it gave up waiting) is cancelled and
    the shard serves on.  ``heard[w]`` is when worker w's last message came, for the
    liveness checks of :meth:`silent_workers`.
    """

    def __init__(self, comm, replies, index: int, n_workers: int, scale: float, *,
                 deadline: float = 20.0, startup: float = 120.0, worker_names=None, log=None,
                 updates: ServerUpdates | None = None, cast=numpy_cast, compiled: bool = True,
                 inbox_expected: bool = False):
        self.comm = comm
        self.replies = replies
        self.index = index
        self.n_workers = int(n_workers)
        self.cast = cast   # between the store's dtype and a wire's (``weights.numpy_cast``)
        self.store = WeightStore(scale, cast)
        # ps_optimizer='server': pushes are gradients for this shard's optimizer
        self.updates = updates
        self.deadline = float(deadline)
        self.startup = max(float(startup), self.deadline)
        self.worker_names = (list(worker_names) if worker_names is not None
                             else [f"worker {w}" for w in range(n_workers)])
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._bytes_received = 0   # by the Python loop (``bytes_received`` adds the compiled's)
        self._bytes_sent = 0
        self.dropped = 0     # messages received and not used (logged)
        self.started = time.monotonic()
        self.heard = np.full(n_workers, self.started)
        self.state = np.full(n_workers, UNHEARD, dtype=np.int64)
        self._recv: dict[int, np.ndarray] = {}   # receive buffer (bytes) per message size
        self._wire_bufs: list[np.ndarray] = []   # pull replies in a wire dtype of their own
        self._sending: list[_Reply] = []         # pull replies in flight
        self._abandoned: list[_Reply] = []       # replies cancelled (their buffers kept)
        self._waiting_pulls: list[tuple[int, int, int]] = []   # pulls before the first INIT
        # The weights of the latest barrier (ElasticBSP): what every pull at it reads.
        self._barrier_epoch, self._barrier_weights = 0, None
        self._ack = np.zeros(2, dtype=np.int64)
        self._spares: list[np.ndarray] = []    # weight buffers to add into (_spare)
        self._widened: np.ndarray | None = None  # a bfloat16 gradient, widened (apply_push)
        # Per worker: its last push (perf_counter, CLOCK_MONOTONIC as the compiled loop's
        # clock) and when its next is due (inf: unknown); ``_times[0]``: the earliest of those,
        # ``_times[1]``: how late a sleep of this thread wakes (``_fastpath.late_wake``).
        self._last_push = np.zeros(n_workers)
        self._push_due = np.full(n_workers, np.inf)
        self._times = np.array([np.inf, 0.0])
        # The compiled loop (``_shard_loop``) where this MPI allows it, and the two buffers
        # besides the weights that it may sum a push into (the three take turns).
        self._loop: _shard_loop.ShardLoop | None = None
        self._others: list[np.ndarray] = []
        # One-sided pushes (``pin``): when each worker last pushed, and the pushes applied,
        # as the workers write them into the window; None while pushes come as messages.
        self._window_heard: np.ndarray | None = None
        self._window_pushes: np.ndarray | None = None
        # The server-side optimizer's inbox in the window (``shard_window.ShardInbox``), or
        # None: the gradient slots the workers write, stepped on by the compiled loop or, for
        # the first step and before a pull's answer, by :meth:`_take_inbox`.
        self._inbox_window = None
        self._inbox_loaded = False
        # The workers will write into an inbox (``start_shards``: the server's optimizer, one
        # node): its loop is loaded before the first push, not at the first take.
        self._inbox_expected = bool(inbox_expected)
        self.warmed = threading.Event()   # the compiled loop is loaded (``warm_up``)
        if compiled and comm is not None:
            reason = _shard_loop.unavailable_reason()
            if reason is None:
                self._loop = _shard_loop.ShardLoop(
                    comm, replies, self.heard, self.state, self._last_push, self._push_due,
                    self._times, tags=(PUSH, PUSH_PULL, PULL, ACK, DATA, OK, REFUSED, UNHEARD,
                                       HEARD_FROM),
                    sleeps=(SLEEP_MIN_S, SLEEP_MAX_S, SLEEP_IDLE_S, IDLE_AFTER_S,
                            WAKE_MARGIN_S, DUE_SLACK_S, PACE_MAX_S),
                    deadline=self.deadline)
            else:
                self.log(f"mpsync PS shard {index}: no compiled loop ({reason}); the Python "
                         f"loop serves")

    def pin(self, weights: np.ndarray, heard: np.ndarray, pushes: np.ndarray,
            inbox=None) -> None:
        """Store the weights in ``weights`` for good, the memory of a window the workers
        add their pushes into and read from themselves (``shard_window``): the initial
        weights are copied there, and every later sum is made there, in place.  ``heard``
        and ``pushes`` are what the workers write beside them (their last push, and the
        count).  ``inbox``: with the server-side optimizer, the ``ShardInbox`` the workers
        write their gradients into instead.  Before the first INIT."""
        self.store.pinned = weights
        self._window_heard, self._window_pushes = heard, pushes
        self._inbox_window = inbox

    def _take_inbox(self) -> bool:
        """One step of the server-side optimizer on the gradients the workers wrote into the
        inbox since the last (``shard_window``'s module doc); False if none came."""
        inbox = self._inbox_window
        if inbox is None or not self.store.ready or not inbox.waiting():
            return False
        grad, pushes, counts = inbox.take()
        problem = self.updates.take(self.store.weights, grad, 0)
        if problem is None:
            self.store.version += pushes
        else:
            self.dropped += pushes
            self.log(f"mpsync PS shard {self.index}: refused the sum of {pushes} pushes in "
                     f"its inbox: {problem}; the shard serves on")
        inbox.done(counts)
        return True

    def _heard(self) -> tuple[np.ndarray, np.ndarray]:
        """When each worker was last heard from and its state (``UNHEARD``, ``HEARD_FROM``,
        ``GONE``), its one-sided pushes included."""
        if self._window_heard is None:
            return self.heard, self.state
        heard = np.maximum(self.heard, self._window_heard)
        state = np.where((self.state == UNHEARD) & (self._window_heard > 0), HEARD_FROM,
                         self.state)
        return heard, state

    @property
    def bytes_received(self) -> int:
        """Data bytes received, counted by both loops (read from any thread at any time)."""
        return self._bytes_received + self._compiled_count(_shard_loop.C_RECEIVED)

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent + self._compiled_count(_shard_loop.C_SENT)

    def _compiled_count(self, cell: int) -> int:
        return 0 if self._loop is None else int(self._loop.cells[cell])

    @property
    def _next_due(self) -> float:
        return float(self._times[0])

    @_next_due.setter
    def _next_due(self, value: float) -> None:
        self._times[0] = value

    @property
    def left(self) -> int:
        """Workers that have not said goodbye."""
        return int(np.count_nonzero(self.state != GONE))

    def warm_up(self) -> float:
        """Load the compiled loop's specializations this job will run from Numba's cache
        (compiling what the cache lacks), then set ``warmed``; the seconds it took.  Where
        that was a compile (``COMPILE_NOTE_S`` or longer: a cache emptied or made stale by
        an install or a change of the sources), one line says so: the workers' pushes wait
        for it, and a job whose clock ran meanwhile loses those seconds without a word
        (measured: a 10 s ASP run with the server's optimizer made 503 samples/s and 0.44
        accuracy, against 4,600 and 0.98, its shards compiling from 1.9 s to 9 s)."""
        start = time.perf_counter()
        if self._loop is not None:
            self._loop.warm_up()   # most models are float32; another dtype loads at its first push
            if self.updates is not None and not self.updates.per_round:
                self._loop.warm_up(stepping=True)   # the loop that takes the optimizer's steps
            if self._inbox_expected:   # (for float32; another dtype loads at its first take)
                self._loop.warm_up(stepping=True, inbox=True)
        took = time.perf_counter() - start
        if took >= COMPILE_NOTE_S:
            self.log(f"mpsync PS shard {self.index}: compiled its loop in {took:.1f} s "
                     f"(Numba's cache had none for these sources; `mpsync doctor --warm` "
                     f"fills it once after an install)")
        self.warmed.set()
        return took

    def serve(self) -> dict:
        if not self.warmed.is_set():
            self.warm_up()
        status = MPI.Status()
        probe = self.comm.Iprobe
        clock, sched_yield = time.perf_counter, os.sched_yield
        sleep, last = SLEEP_MIN_S, clock()
        while self.left > 0 or self._sending:
            if self._take_inbox():
                sleep, last = SLEEP_MIN_S, clock()
                continue
            if self._compiled_serves():
                self._serve_compiled()
                sleep, last = SLEEP_MIN_S, clock()
                continue
            if self._sending:
                self._progress_replies()
            if probe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                self._handle(status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))
                sleep, last = SLEEP_MIN_S, clock()
                continue
            if self._sending:
                time.sleep(0)   # a reply in flight: keep it moving, as a blocking Send would
                continue
            now = clock()
            ahead = self._next_due - now
            if ahead <= -DUE_SLACK_S:   # that push is late: the next one due, if any
                self._next_due = min((d for d in self._push_due if d > now - DUE_SLACK_S),
                                     default=float("inf"))
                ahead = self._next_due - now
            margin = WAKE_MARGIN_S + self._times[_shard_loop.T_LATE_WAKE]
            if -DUE_SLACK_S < ahead < margin:
                sched_yield()   # a push is due about now: poll for it, others run first
                continue
            pause = min(sleep, ahead - margin) if ahead > 0 else sleep
            time.sleep(pause)
            self._times[_shard_loop.T_LATE_WAKE] = _fastpath.late_wake.py_func(
                self._times[_shard_loop.T_LATE_WAKE], clock() - now - pause)
            idle = now - last > IDLE_AFTER_S
            sleep = min(2 * sleep, SLEEP_IDLE_S if idle else SLEEP_MAX_S)
        self._take_inbox()   # the last pushes, added before their workers said goodbye
        return self.stats()

    def stats(self) -> dict:
        one_sided = 0 if self._window_pushes is None else int(self._window_pushes.sum())
        # (Through an inbox the shard counts the pushes it stepped on in ``version`` itself.)
        added = one_sided if self._inbox_window is None else 0
        return {"shard": self.index, "elements": self.store.size,
                "version": self.store.version + added, "one_sided_pushes": one_sided,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent,
                "dropped": self.dropped, "compiled_loop": self._loop is not None,
                "served_compiled": self._compiled_count(_shard_loop.C_SERVED)}

    # -- the compiled loop ----------------------------------------------------------------
    def _compiled_serves(self) -> bool:
        """Can the compiled loop serve now?  It keeps its own replies in flight: so no reply
        of the Python loop's is, no pull waits for the initial weights, the workers run the
        optimizer or the shard's runs per push (not once per round: a pull waits for its
        round's step), the store is float32 or float64, and not in a window."""
        weights = self.store.weights
        # Not with the weights in a window (``pin``): its sums go to a second buffer where a
        # reply reads the first, and the workers add into the window only.  What still comes
        # as a message there (a first pull, the initial weights) is Python's.  Unless the
        # shard steps from an inbox (``shard_window``): then its only writes are those steps,
        # in place, once the Python loop took the first (which makes the optimizer's state).
        inbox = self._inbox_window
        return (self._loop is not None and weights is not None
                and (self.store.pinned is None or inbox is not None and inbox.ready
                     and self.updates is not None and self.updates.compiled_form() is not None
                     and weights is self.store.pinned)
                and (self.updates is None or not self.updates.per_round)
                and not self._sending and not self._waiting_pulls
                and weights.dtype.kind == "f" and weights.itemsize >= 4)

    def _serve_compiled(self) -> None:
        """One call of the compiled loop (``_shard_loop``), then what it handed back."""
        store, loop = self.store, self._loop
        if store.weights is self._barrier_weights:
            store.detach()   # a barrier's pulls read them: the sums go elsewhere from now on
        weights = store.weights
        buffers = [weights]
        for other in self._others:   # two more that nothing reads, for the sums
            if (other.shape == weights.shape and other.dtype == weights.dtype
                    and not any(other is b for b in buffers) and not self._reading(other)):
                buffers.append(other)
        while len(buffers) < _shard_loop.BUFFERS:
            buffers.append(np.empty_like(weights))
        step = None
        if self.updates is not None:   # the optimizer's step per push, or Python's
            form = self.updates.compiled_form()
            step = ((_shard_loop.HAND_BACK, None, None, None, None, 0) if form is None
                    else (*form, self.updates.optimizer.steps))
        inbox = self._inbox_window.compiled_form() if store.pinned is not None else None
        if inbox is not None and not self._inbox_loaded:
            # The loop that steps from an inbox, for the store's dtype (only jobs on one node
            # with the server's optimizer have one; ``serve`` loaded it for float32).
            loop.warm_up(weights.dtype, stepping=True, inbox=True)
            self._inbox_loaded = True
        outcome = loop.serve(tuple(buffers), store.scale, wire_code(weights.dtype),
                             store.version, time.monotonic() + 0.5, step, wire_code(BFLOAT16),
                             inbox)
        cells = loop.cells
        if step is not None and step[0] != _shard_loop.HAND_BACK:
            self.updates.optimizer.steps = int(cells[_shard_loop.C_STEPS])
        store.version = int(cells[_shard_loop.C_VERSION])
        store.weights = buffers[int(cells[_shard_loop.C_CURRENT])]
        self._others = [b for b in buffers if b is not store.weights]
        for request, buffer, worker, since in loop.in_flight():
            buf = (buffers[buffer] if buffer < _shard_loop.BUFFERS
                   else loop.halves[buffer - _shard_loop.BUFFERS])
            self._sending.append(_Reply(request, worker, buf, since))
        src, tag, count = (int(cells[i]) for i in (_shard_loop.C_SOURCE, _shard_loop.C_TAG,
                                                    _shard_loop.C_COUNT))
        if outcome == _shard_loop.PROBED:
            self._handle(src, tag, count)
        elif outcome == _shard_loop.RECEIVED:
            self._handle(src, tag, count, loop.pull_arg.view(np.uint8))
        elif outcome == _shard_loop.REFUSED:
            self._refuse(src, "push", "push with NaN or inf")
        elif outcome == _shard_loop.INBOX_REFUSED:
            self.dropped += 1
            self.log(f"mpsync PS shard {self.index}: refused the sum of the pushes in its "
                     f"inbox: NaN or inf; the shard serves on")
        elif outcome == _shard_loop.MPI_FAILED:
            code = int(cells[_shard_loop.C_ERROR])
            raise RuntimeError(f"PS shard {self.index}: an MPI call of its compiled loop "
                               f"failed ({MPI.Get_error_string(code)}, code {code})")
        # STUCK: the late reply is among those handed over; ``_progress_replies`` cancels it

    def silent_workers(self, now: float | None = None) -> list[tuple[int, float]]:
        """``(worker, seconds)`` for each worker that has not said goodbye and whose last
        message is older than the deadline (one never heard from: this shard started longer
        than the start-up time ago, ``startup``, as for the state server)."""
        now = time.monotonic() if now is None else now
        heard, state = self._heard()
        quiet = now - heard
        limit = np.where(state == UNHEARD, self.startup, self.deadline)
        return [(w, float(quiet[w])) for w in np.flatnonzero(
            (state != GONE) & (quiet > limit))]

    # -- requests -------------------------------------------------------------------------
    def _handle(self, src: int, tag: int, nbytes: int, payload=None) -> None:
        """Receive (unless the compiled loop did: ``payload``) and serve one request."""
        kind, code = tag - tag % 10, tag % 10
        if payload is None:
            payload = self._receive(src, tag, nbytes, self._inbox(src, kind, code, nbytes))
        self.heard[src] = time.monotonic()
        if self.state[src] == UNHEARD:
            self.state[src] = HEARD_FROM
        if kind in (PUSH, PUSH_PULL):
            self._expect_next_push(src)
        if kind in (INIT, PUSH, LOAD) and code < len(WIRE_DTYPES):
            status = self._take(kind, WIRE_DTYPES[code], payload, src)
            self._ack[:] = (self.store.version, status)
            self.replies.Send([self._ack, MPI.INT64_T], dest=src, tag=ACK)
        elif kind == PUSH_PULL and code < len(WIRE_DTYPES):
            status = self._take(PUSH, WIRE_DTYPES[code], payload, src)
            self._ack[:] = (self.store.version, status)
            self.replies.Send([self._ack, MPI.INT64_T], dest=src, tag=ACK)
            if status == OK:
                self._serve_pull(src, code)
        elif kind == PULL and code < len(WIRE_DTYPES):
            pull = (src, code, *self._pull_words(src, payload))
            if not self.store.ready:
                self._waiting_pulls.append(pull)
            else:
                self._serve_pull(*pull)
        elif tag == OPT:
            self._configure(src, payload)
        elif tag == SAVE:
            self._save(src)
        elif kind == RESTORE and code < len(WIRE_DTYPES):
            self._restore(src, payload, WIRE_DTYPES[code])
        elif tag == BYE:
            self.state[src] = GONE
            self._push_due[src] = float("inf")
            self._next_due = min(self._push_due)
        elif tag == WATCH:
            self._answer_watch(src)
        else:
            self._drop(src, f"a message with tag {tag} ({nbytes} bytes), which is no "
                            f"request of the parameter server's")

    def _pull_words(self, src: int, payload: np.ndarray) -> tuple[int, int, tuple]:
        """A PULL's payload, int64 words: ``[barrier]`` or ``[0, round, excluded...]``
        (``ShardClient.pull``), as ``(barrier, round, excluded)``; a malformed one reads
        the current weights, and is named in the log."""
        words = payload.view(np.int64) if payload.nbytes % 8 == 0 else None
        if words is None or words.size == 0 or (words.size > 1 and (
                words[0] != 0 or words[1] < 0 or np.any(words[2:] < 0)
                or np.any(words[2:] >= self.n_workers))):
            if payload.nbytes:
                self._drop(src, f"a pull's {payload.nbytes}-byte argument, which is no "
                                f"barrier and no round (it reads the weights as they are)")
            return 0, 0, ()
        if words.size == 1:
            return int(words[0]), 0, ()
        return 0, int(words[1]), tuple(int(x) for x in words[2:])

    def _expect_next_push(self, src: int) -> None:
        """Worker ``src`` pushed now: its next push is due one push interval later."""
        now = time.perf_counter()
        interval, self._last_push[src] = now - self._last_push[src], now
        self._push_due[src] = now + interval if interval < PACE_MAX_S else float("inf")
        self._next_due = min(self._push_due)

    def _inbox(self, src: int, kind: int, code: int, nbytes: int) -> np.ndarray | None:
        """Where a push of the store's dtype and size that the optimizer keeps for its round
        is received: into the array it keeps (``ServerUpdates.inbox``), not copied there."""
        weights = self.store.weights
        if (self.updates is None or kind not in (PUSH, PUSH_PULL) or weights is None
                or code >= len(WIRE_DTYPES) or WIRE_DTYPES[code] != weights.dtype
                or nbytes != weights.nbytes):
            return None
        inbox = self.updates.inbox(src, weights)
        return None if inbox is None else inbox.view(np.uint8)

    def _receive(self, src: int, tag: int, nbytes: int,
                 into: np.ndarray | None = None) -> np.ndarray:
        """The message as bytes (any size: a malformed one is received, then refused), into
        ``into`` (bytes, of that size) if given."""
        if into is not None:
            self.comm.Recv([into, MPI.BYTE], source=src, tag=tag)
            self._bytes_received += nbytes
            return into
        buf = self._recv.get(nbytes)
        if buf is None:
            if len(self._recv) > 8:   # sizes vary only for malformed messages
                self._recv.clear()
            buf = self._recv[nbytes] = np.empty(nbytes, dtype=np.uint8)
        self.comm.Recv([buf, MPI.BYTE], source=src, tag=tag)
        self._bytes_received += nbytes
        return buf

    def _drop(self, src: int, what: str) -> None:
        self.dropped += 1
        self.log(f"mpsync PS shard {self.index}: dropped {what} from "
                 f"{self.worker_names[src]}; the shard serves on")

    def _take(self, kind: int, dtype: np.dtype, payload: np.ndarray, src: int) -> int:
        """Check an INIT, LOAD or PUSH payload, then store or apply it; ``OK`` or
        ``REFUSED``."""
        what = {INIT: "initial weights", LOAD: "weights to load"}.get(kind, "push")
        if payload.nbytes % dtype.itemsize:
            self._refuse(src, what, f"{payload.nbytes} bytes is not a whole number of "
                                    f"{dtype} elements ({dtype.itemsize} bytes each)")
            return REFUSED
        if dtype == BFLOAT16 and (kind == INIT or (kind == LOAD and not self.store.ready)):
            self._refuse(src, what, "bfloat16 initial weights: the store keeps a bfloat16 "
                                    "model in float32 (send them as float32)")
            return REFUSED
        data = payload.view(dtype)
        if kind == LOAD and self.store.ready:
            return self._load(data, src)
        if kind in (INIT, LOAD):
            if self.store.ready:
                return OK     # the first worker's wins (every worker starts from one model)
            self.store.init(data)
            for waiting in self._waiting_pulls:
                self._serve_pull(*waiting)
            self._waiting_pulls.clear()
            return OK
        problem = self.apply_push(data, src)
        if problem:
            self._refuse(src, what, problem)
            return REFUSED
        return OK

    def _load(self, data: np.ndarray, src: int) -> int:
        """Replace the weights (same length; any float dtype, stored in the store's)."""
        if data.size != self.store.size:
            self._refuse(src, "weights to load", f"{data.size} elements, the shard holds "
                                                 f"{self.store.size}")
            return REFUSED
        if self._reading(self.store.weights):
            self.store.detach()
        self.cast(self.store.weights, data)
        return OK

    def apply_push(self, update: np.ndarray, src: int = 0) -> str | None:
        """Worker ``src``'s slice of an update (in the wire's dtype, whole elements) into this
        shard's range: added (the workers run the optimizer) or stepped on / merged into its
        round by the shard's optimizer; None, or why it was refused (the range is then
        unchanged)."""
        reading = self._reading(self.store.weights)
        if update.dtype == BFLOAT16 and self.updates is not None and self.store.ready \
                and update.size == self.store.size:
            # The optimizer takes float gradients: widened into a scratch (exact).
            if self._widened is None or self._widened.dtype != self.store.weights.dtype:
                self._widened = np.empty_like(self.store.weights)
            self.cast(self._widened, update)
            update = self._widened
        if self.updates is None:
            # A pull's reply or a barrier still reads the current buffer: the sum goes to
            # another one (the add writes it there at the cost of adding in place).
            return self.store.apply(update, into=self._spare() if reading else None)
        if reading and not self.updates.per_round:   # (kept for its round: no write here)
            self.store.detach()
        problem = self.updates.take(self.store.weights, update, src)
        if problem is None:
            self.store.version += 1
        return problem

    def _spare(self) -> np.ndarray:
        """A buffer for the weights that nothing reads (no reply in flight or cancelled, no
        barrier), else a new one; the current weights join the spares (at most 3 kept: one
        still read lives on in its reply)."""
        weights, spares = self.store.weights, self._spares
        free = next((i for i, b in enumerate(spares) if b.size == weights.size
                     and b.dtype == weights.dtype and not self._reading(b)), None)
        buf = np.empty_like(weights) if free is None else spares.pop(free)
        spares.append(weights)
        del spares[:-3]
        return buf

    def _configure(self, src: int, payload: np.ndarray) -> None:
        """The server-side optimizer's settings, ACKed ``OK`` or ``REFUSED``."""
        if payload.nbytes % 8:
            problem = f"{payload.nbytes} bytes is not a whole number of float64 settings"
        elif self.updates is None:
            problem = "optimizer settings, but the workers run the optimizer"
        else:
            problem = self.updates.configure(payload.view(np.float64))
        if problem:
            self._refuse(src, "optimizer settings", problem)
        self._ack[:] = (self.store.version, REFUSED if problem else OK)
        self.replies.Send([self._ack, MPI.INT64_T], dest=src, tag=ACK)

    def _save(self, src: int) -> None:
        """The optimizer's state for a checkpoint (the header alone if it has none)."""
        if self.updates is None or not self.store.ready:
            state = pack_state(None, 0, {}, 0, np.float64)
        else:
            if self._reading(self.store.weights) and self.updates.due(None):
                self.store.detach()
            state = self.updates.save(self.store.weights)
        self._reply(src, state, STATE)

    def _restore(self, src: int, payload: np.ndarray, dtype: np.dtype) -> None:
        """A checkpoint's optimizer state to continue from, ACKed ``OK`` or ``REFUSED``."""
        problem = ("optimizer state, but the workers run the optimizer" if self.updates is None
                   else self.updates.restore(payload, dtype))
        if problem:
            self._refuse(src, "optimizer state", problem)
        self._ack[:] = (self.store.version, REFUSED if problem else OK)
        self.replies.Send([self._ack, MPI.INT64_T], dest=src, tag=ACK)

    def _refuse(self, src: int, what: str, problem: str) -> None:
        self.dropped += 1
        self.log(f"mpsync PS shard {self.index}: refused the {what} of "
                 f"{self.worker_names[src]}: {problem}; the shard serves on")

    # -- replies --------------------------------------------------------------------------
    def _reading(self, buf) -> bool:
        """Is ``buf`` read by a reply in flight (or cancelled, until the cancel is confirmed:
        Open MPI may still be sending it) or kept as a barrier's weights?"""
        return (buf is self._barrier_weights or any(r.buf is buf for r in self._sending)
                or any(r.buf is buf for r in self._abandoned))

    def _at_barrier(self, epoch: int) -> np.ndarray:
        """The weights a pull at barrier ``epoch`` reads: the store as the first such pull
        found it, kept until a later barrier's first pull.

        ElasticBSP (ZipLine §6.2.5: the barrier imposes a weight synchronization on all
        workers): the state server grants the barrier's pulls once every barrier push is in
        on every shard, and a worker pushes again only after its own barrier pull returned
        from every shard, so on each shard the first pull of a barrier comes after all of its
        pushes and before any push of the next superstep.  Later pulls of the same barrier
        (a slower worker's) read those weights too, not a fast worker's next pushes."""
        if epoch > self._barrier_epoch:
            self._barrier_epoch, self._barrier_weights = epoch, self.store.weights
        return self._barrier_weights if epoch == self._barrier_epoch else self.store.weights

    def _serve_pull(self, src: int, code: int, barrier: int = 0, round_: int = 0,
                    excluded: tuple = ()) -> None:
        """Send this shard's weights to ``src`` (at ``barrier`` > 0: that barrier's).  With
        the optimizer once per round: after round ``round_``'s step, without the pushes of
        the ``excluded`` workers, if this is the round's first pull here; after a step on
        every push kept at ``ALL_PUSHES_IN`` (``ServerUpdates.settle``).  With an inbox:
        after a step on what is in it."""
        self._take_inbox()
        if self.updates is not None:
            round_ = None if barrier == ALL_PUSHES_IN else round_
            if self.updates.due(round_, excluded) and self._reading(self.store.weights):
                self.store.detach()
            self.updates.settle(self.store.weights, round_, excluded)
        weights = self._at_barrier(barrier) if barrier > 0 else self.store.weights
        if WIRE_DTYPES[code] != weights.dtype:
            out = next((b for b in self._wire_bufs if b.dtype == WIRE_DTYPES[code]
                        and b.size == weights.size and not self._reading(b)), None)
            if out is None:
                out = np.empty(weights.size, dtype=WIRE_DTYPES[code])
                self._wire_bufs = [b for b in self._wire_bufs if self._reading(b)] + [out]
            self.cast(out, weights)
            weights = out
        self._reply(src, weights, DATA)

    def _reply(self, src: int, buf: np.ndarray, tag: int) -> None:
        """Send ``buf`` without blocking the shard (``_progress_replies`` completes it)."""
        request = self.replies.Isend([buf, MPI.BYTE], dest=src, tag=tag)
        if request.Test():
            self._bytes_sent += buf.nbytes
        else:
            self._sending.append(_Reply(request, src, buf, time.monotonic()))

    def _progress_replies(self) -> None:
        """Complete the pull replies in flight; cancel one its worker has not taken within
        the deadline (it gave up waiting and cancelled its receive: a large reply would
        otherwise never complete)."""
        now, still = time.monotonic(), []
        for reply in self._sending:
            if reply.request.Test():
                self._bytes_sent += reply.buf.nbytes
            elif now - reply.since > self.deadline:
                reply.request.Cancel()
                self._abandoned.append(reply)   # its buffer lives until the cancel takes effect
                self.dropped += 1
                self.log(f"mpsync PS shard {self.index}: {self.worker_names[reply.worker]} "
                         f"did not take its pull reply ({reply.buf.nbytes} bytes) within the "
                         f"{self.deadline:g}s deadline (it gave up waiting); reply cancelled, "
                         f"the shard serves on")
            else:
                still.append(reply)
        self._sending = still
        self._abandoned = [r for r in self._abandoned if not r.request.Test()]

    def _answer_watch(self, src: int) -> None:
        """How long since each worker's last message, and whether it said goodbye."""
        now = time.monotonic()
        last, state = self._heard()
        heard = np.empty((2, self.heard.size))
        heard[0] = now - last
        heard[1] = state
        self.replies.Send([heard, MPI.DOUBLE], dest=src, tag=HEARD)


class ShardThread:
    """A :class:`ShardServer` on a thread of its host rank; ``join()`` returns its stats.
    An exception in it goes to the rank's abort hook (``threading.excepthook``)."""

    def __init__(self, server: ShardServer):
        self.server = server
        self.result: dict | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"mpsync-ps-shard-{server.index}")
        self.thread.start()

    def _run(self) -> None:
        self.result = self.server.serve()

    def join(self, timeout: float | None = None) -> dict | None:
        self.thread.join(timeout)
        return self.result

    def finish(self, poll_s: float = 0.1) -> dict | None:
        """Wait until every worker said goodbye to this shard; a worker that has not and
        that no message came from for longer than the deadline (it stopped, or exited
        without ``mps.shutdown()``) raises :class:`DeadlineExceeded` naming it."""
        server = self.server
        while self.thread.is_alive():
            self.thread.join(poll_s)
            silent = server.silent_workers()
            if silent and self.thread.is_alive():
                names = [server.worker_names[w] for w, _ in silent]
                quiet = ", ".join(f"{server.worker_names[w]} for {s:.1f}s" for w, s in silent)
                raise DeadlineExceeded(
                    f"PS shard {server.index} could not shut down: no goodbye and no word from "
                    f"{quiet} (the deadline is {server.deadline:g}s; a worker that stopped or "
                    f"exited without mps.shutdown())", names, "shutdown of a PS shard")
        return self.result
