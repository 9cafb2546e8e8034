"""A shard server's compiled request loop: pushes and pulls served in machine code, without
the interpreter's lock (:class:`~mpsync.server.shard_server.ShardServer` keeps everything else).

Why: a shard is a thread of a worker rank.  In Python its loop took ~30 interpreter-level
calls per push (probe, receive, a finiteness check with a temporary, the add, the ACK, the
reply, the backoff) and every one of them needed the rank's interpreter lock, which the
trainer on the same rank holds while it runs Python.  Here one Numba function, compiled
``nogil``, calls Open MPI directly (the bindings of ``_fastpath``) and serves, until it has
to hand a message back:

* ``PUSH`` and ``PUSH_PULL`` in the store's own dtype, of the shard's exact size: the slice is
  received and added (scaled as the policy says, in the store's dtype, as
  ``WeightStore.apply`` computes it) only if every value of it is finite, so a refused push
  leaves the weights untouched.  Where no reply in flight reads the weights, in place: a
  checking pass, then the add.  Where one does, one pass reads the weights and the delta and
  writes their sum into a buffer nothing reads, checking on the way, and that buffer becomes
  the weights only if all were finite.  ACK, then for ``PUSH_PULL`` the new weights as
  ``DATA``.
* ``PULL`` in the store's dtype without a barrier: the weights as ``DATA``.

Replies go out with ``MPI_Isend`` and stay in flight while the loop serves on (a slow link to
one worker does not hold another's push): the weights take turns in three buffers, a push
that comes while replies read the weights sums into one that none reads, and the shard waits
for a reply only when no buffer is free.  On every return to Python the replies still in
flight are handed over (``ShardLoop.in_flight``), and the Python loop completes them, or
cancels one its worker has not taken within the deadline, as before.  Every other message (``INIT``, ``LOAD``, a barrier's pull, another dtype,
a malformed one, ``BYE``, ``WATCH``, the optimizer's) is left to the Python loop: probed and not
received, or, for a pull whose barrier is only known from its payload, received and handed
over with it.  A refused push is ACKed here and handed back for its log line.

The server-side optimizer (``ps_optimizer='server'``) applied per push (ASP, SSP, DSSP): a
push is a gradient, checked for finiteness in one pass and then stepped on in one more
(``shard_optimizer.step_pass``, the function ``ShardOptimizer`` steps with, so both loops
step to the same bits), into the weights or, where a reply reads them, into a buffer none
reads; the optimizer's state (momentum, Adam's moments) is stepped in place, nothing else
reads it while the loop runs, and the steps taken are counted in the cells.  A step that
would make state (the first) is the Python loop's, as is the optimizer applied once per
round (BSP), whose pulls wait for the round's step: the shard serves those in Python.

Where the shard's weights are in a window with an inbox (the server-side optimizer under ASP
on one node, ``shard_window``), no push comes as a message: at every pass the loop sums the
gradient slots the workers wrote since its last look and steps on them once, in place
(:func:`_take_inbox`), outside the interpreter's lock, where a Python loop took them late.

A float32 store (a bfloat16 model's, ``weights.BFLOAT16``) also serves pushes and pulls on a
bfloat16 wire: a push's bits are widened into float32 (exact) and taken as above; a pull's
reply is the weights rounded to bfloat16 into one of ``HALVES`` buffers of its own, which
take turns as the weights' buffers do.

Idle, the loop sleeps as the Python one did (20 µs doubling to 1 ms, 4 ms after 50 ms of
silence) but never past a worker's next push: it keeps ``ShardServer``'s per-worker push
clocks, in the same arrays, so a paced push finds the shard polling.  It starts polling
``WAKE_MARGIN_S`` plus how late its own sleeps have woken of late (``_fastpath.late_wake``)
before the push is due: beside a trainer computing on the same core a sleep ends late by up
to a few milliseconds, and the push would wait for it (20 ms of compute between pushes, 64 KB, 2
workers: push+pull 1.3-1.4 ms with the fixed margin, 0.3 ms with this one).  And for
``DUE_SLACK_S`` after a push alone (not ``PUSH_PULL``) it polls for the pull that follows
once the state server grants it.  It writes each worker's last-heard time
(``CLOCK_MONOTONIC``, what ``time.monotonic`` reads) into the shard's own ``heard`` table,
which the liveness checks read while it runs.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpsync.server import _fastpath
from mpsync.server._fastpath import (_get_count, _i32, _iprobe, _jit, _ptr, _recv,
                                     _sched_yield, _send, _status_layout, _test, late_wake)
from mpsync.server.shard_optimizer import step_pass
from mpsync.server.shard_window import sum_slots
from mpsync.server.weights import _finite, round_to_bfloat16, widen_bfloat16

__all__ = ["ShardLoop", "unavailable_reason", "QUIET", "PROBED", "RECEIVED", "REFUSED",
           "STUCK", "MPI_FAILED", "ADD", "HAND_BACK"]

# Outcomes of a call (``ShardLoop.serve``).
QUIET = 0       # ``until`` passed
PROBED = 1      # a message for the Python loop is waiting: source, tag and size in the cells
RECEIVED = 2    # a pull was received here and is handed over: its barrier in ``pull_arg``
REFUSED = 3     # a push was refused (a value not finite) and ACKed REFUSED: log it
STUCK = 4       # a reply was not taken within the deadline (handed over with the others)
MPI_FAILED = 5  # an MPI call returned an error code (in the cells)
INBOX_REFUSED = 6   # the sum of the pushes in the inbox was not finite (none applied): log it

# The int64 cells shared with Python (``ShardLoop.cells``).
C_VERSION, C_RECEIVED, C_SENT, C_CURRENT, C_SOURCE, C_TAG, C_COUNT, C_ERROR, C_SERVED, \
    C_ACK, C_ACK_STATUS, C_STEPS, C_CLOCK = range(13)
N_CELLS = C_CLOCK + 2   # the last two: a struct timespec
# A reply in flight (a row of ``ShardLoop.flight``): its MPI request, the buffer it reads
# (-1: a free row; BUFFERS + k: bfloat16 buffer k), its worker, its bytes; ``flight_since``:
# when it was posted.
F_REQUEST, F_BUFFER, F_WORKER, F_BYTES = range(4)
BUFFERS = 3
HALVES = 3   # a float32 store's replies on a bfloat16 wire
# The float64 times shared with Python: when the next push is due; how late a sleep here
# wakes (``late_wake``).
T_NEXT_DUE, T_LATE_WAKE = 0, 1
# What a push is (``ShardLoop.serve``'s ``step``): a delta to add; a gradient for the Python
# loop's optimizer (handed back, not received); or one for ``step_pass`` (STEP_SGD,
# STEP_ADAM).
ADD, HAND_BACK = 0, -1

unavailable_reason = _fastpath.unavailable_reason


class ShardLoop:
    """The compiled loop of one shard: its MPI handles, buffers and the shard's tables.

    ``requests`` and ``replies`` are the shard's communicators; ``heard``, ``state``,
    ``last_push`` and ``push_due`` the server's per-worker tables (shared, written here),
    ``times`` its ``[next_due]``; ``tags`` and ``sleeps`` ``shard_server``'s constants (``_serve``).
    """

    def __init__(self, requests, replies, heard, state, last_push, push_due, times, *,
                 tags, sleeps, deadline: float):
        n_cells, self.src_at, self.tag_at = _status_layout()
        self.status = np.zeros(n_cells, np.int32)
        self.scratch = np.zeros(2, np.int32)
        self.cells = np.zeros(N_CELLS, np.int64)
        self.pull_arg = np.zeros(1, np.int64)
        slots = heard.size + 2     # a pull in flight per worker, as the workers wait for them
        self.flight = np.zeros((slots, 4), np.int64)
        self.flight[:, F_BUFFER] = -1
        self.flight_since = np.zeros(slots)
        self.comms = (MPI._handleof(requests), MPI._handleof(replies))
        self.h_byte = MPI._handleof(MPI.BYTE)
        self.tables = (heard, state, last_push, push_due, times)
        self.tags = np.asarray(tags, np.int64)
        self.sleeps = np.asarray(sleeps, np.float64)
        self.deadline = float(deadline)
        self._delta: np.ndarray | None = None
        self._no_settings = np.zeros(8)
        # A float32 store's bfloat16 wire: a push's bits, the replies' buffers.
        self._bits = np.empty(0, np.uint16)
        self.halves = np.empty((HALVES, 0), np.uint16)

    def serve(self, buffers: tuple, scale: float, code: int, version: int,
              until: float, step: tuple | None = None, half_code: int = -1,
              inbox: tuple | None = None) -> int:
        """Serve until ``until`` (``time.monotonic``) or a message for Python.  ``buffers``:
        the weights, then two buffers of their size and dtype that nothing reads; after the
        call, ``cells[C_CURRENT]`` says which of the three the weights are, and
        :meth:`in_flight` the replies still being sent.  ``step``: None, pushes are deltas
        added times ``scale``; else ``(kind, settings, m, v, vmax, steps)`` with ``kind``
        ``HAND_BACK`` or ``step_pass``'s (``ShardOptimizer.compiled_form``, then the steps
        taken so far, which ``cells[C_STEPS]`` counts on).  ``half_code``: the bfloat16
        wire's code, served where the store is float32 (module doc; its replies read
        :attr:`halves`).  Returns an outcome (module constants); ``cells`` hold the version
        and the byte counts."""
        weights = buffers[0]
        if self._delta is None or self._delta.dtype != weights.dtype or \
                self._delta.size != weights.size:
            self._delta = np.empty_like(weights)
        if weights.dtype != np.float32:
            half_code = -1
        elif half_code >= 0 and self._bits.size != weights.size:
            self._bits = np.empty(weights.size, np.uint16)
            self.halves = np.empty((HALVES, weights.size), np.uint16)
        cells = self.cells
        cells[C_VERSION], cells[C_CURRENT] = version, 0
        kind, optimizer = ADD, None
        if step is not None:
            kind, settings, m, v, vmax, cells[C_STEPS] = step
            if kind != HAND_BACK:
                optimizer = (settings, m, v, vmax)
        heard, state, last_push, push_due, times = self.tables
        return int(_serve(self.comms[0], self.comms[1], self.h_byte, MPI.ANY_SOURCE,
                          MPI.ANY_TAG, self.src_at, self.tag_at, self.status, self.scratch,
                          cells, self.flight, self.flight_since, self.pull_arg, buffers[0],
                          buffers[1], buffers[2], self._delta,
                          np.asarray([scale], weights.dtype), code, heard, state, last_push,
                          push_due, times, self.tags, self.sleeps, self.deadline,
                          float(until), kind, optimizer, half_code, self._bits, self.halves,
                          inbox))

    def in_flight(self) -> list[tuple[MPI.Request, int, int, float]]:
        """The replies the last call left in flight, handed over (their rows freed):
        ``(request, buffer index, worker, posted at)``."""
        out = []
        for row in np.flatnonzero(self.flight[:, F_BUFFER] >= 0):
            request, buffer, worker, _ = (int(x) for x in self.flight[row])
            out.append((MPI.Request.fromhandle(request), buffer, worker,
                        float(self.flight_since[row])))
            self.flight[row, F_BUFFER] = -1
        return out

    def warm_up(self, dtype=np.float32, stepping: bool = False, inbox: bool = False) -> None:
        """Load the loop for a ``dtype`` store from Numba's cache (compile it the first time)
        before the first push: one call on this process's own communicator that finds no
        message and returns.  ``stepping``: the loop that takes the server-side optimizer's
        steps, a specialization of its own (``_serve``'s ``optimizer``)."""
        heard = np.zeros(1)
        weights = np.zeros(1, dtype)
        optimizer = (self._no_settings, weights[:0], weights[:0], weights[:0]) if stepping \
            else None
        flight = np.zeros((1, 4), np.int64)
        flight[:, F_BUFFER] = -1
        _serve(MPI._handleof(MPI.COMM_SELF), MPI._handleof(MPI.COMM_SELF), self.h_byte,
               MPI.ANY_SOURCE, MPI.ANY_TAG, self.src_at, self.tag_at, self.status, self.scratch,
               np.zeros(N_CELLS, np.int64), flight, np.zeros(1), self.pull_arg, weights,
               weights.copy(), weights.copy(), weights.copy(), weights.copy(), 0, heard,
               np.zeros(1, np.int64), heard.copy(), heard.copy(), np.zeros(1), self.tags,
               self.sleeps, self.deadline, 0.0, ADD, optimizer, -1, np.empty(0, np.uint16),
               np.empty((HALVES, 0), np.uint16),
               (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0), dtype),
                np.zeros(0, dtype)) if inbox and stepping else None)


# -- the compiled part ------------------------------------------------------------------------
from numba import types  # noqa: E402

_isend = types.ExternalFunction("MPI_Isend", _i32(_ptr, _i32, _ptr, _i32, _i32, _ptr, _ptr))
_clock_gettime = types.ExternalFunction("clock_gettime", _i32(_i32, _ptr))
_usleep = types.ExternalFunction("usleep", _i32(types.uint32))
_CLOCK_MONOTONIC = 1


@_jit
def _monotonic(cells):
    """``time.monotonic()``, from the timespec kept in the last two cells."""
    _clock_gettime(_CLOCK_MONOTONIC, cells.ctypes.data + 8 * C_CLOCK)
    return cells[C_CLOCK] + 1e-9 * cells[C_CLOCK + 1]


@_jit
def add_checked(weights, delta, scale, out):
    """``out = weights + scale * delta`` in the weights' dtype, in one pass; False (and
    ``out`` not to be used) if a value of ``delta`` is not finite.  ``scale``: a one-element
    array of the weights' dtype (the product rounds as numpy's ``delta * scale`` does)."""
    bad = False
    s = scale[0]
    if s == 1:
        for i in range(weights.size):
            x = delta[i]
            bad |= (x - x) != 0      # inf - inf and NaN - NaN are NaN; finite: 0
            out[i] = weights[i] + x
    else:
        for i in range(weights.size):
            x = delta[i]
            bad |= (x - x) != 0
            out[i] = weights[i] + x * s
    return not bad


@_jit
def add_checked_in_place(weights, delta, scale):
    """``weights += scale * delta`` (rounded as :func:`add_checked`) if every value of
    ``delta`` is finite, else False and the weights untouched: a checking pass, then the
    add, for weights no reply reads (their cache lines stay warm: no third array to write).

    The check reads all of ``delta`` without stopping at the first bad value: a loop that
    returns early is not vectorized, and on a 4.35 MB shard it took 0.45 ms of the call's
    0.73 ms where the whole pass (``weights._finite``) takes 0.04 ms; a bad push is rare."""
    if not _finite(delta):
        return False
    s = scale[0]
    if s == 1:
        for i in range(weights.size):
            weights[i] += delta[i]
    else:
        for i in range(weights.size):
            weights[i] += delta[i] * s
    return True


@_jit
def step_checked(kind, weights, delta, out, settings, m, v, vmax, cells):
    """The optimizer's step (``step_pass``) with the gradient ``delta`` into ``out`` (may be
    ``weights``), counted in ``cells[C_STEPS]``, if every value of ``delta`` is finite (the
    check as :func:`add_checked_in_place`'s); else False, and the weights and the state
    untouched."""
    if not _finite(delta):
        return False
    cells[C_STEPS] += 1
    step_pass(kind, weights, out, delta, m, v, vmax, settings, cells[C_STEPS], False)
    return True


@_jit
def _take_inbox(posted, taken, rows, total, kind, weights, settings, m, v, vmax, cells):
    """The server-side optimizer's step, in place, on the gradients the workers wrote into
    their slots since the last take (``shard_window``'s module doc; ``sum_slots``): 0 if none
    came, 1 if stepped, -1 if a value was not finite (nothing applied, the pushes dropped).
    The counts are read before the slots, with an external call between that the compiler
    cannot move a load across; the taken counts are written after the step, as another."""
    fresh = False
    for w in range(posted.size):
        fresh |= posted[w] != taken[w]
    if not fresh:
        return 0
    counts = posted.copy()
    _monotonic(cells)
    pushes, row = sum_slots(counts, taken, rows, total)
    gradient = total if row < 0 else rows[row, :total.size]
    applied = step_checked(kind, weights, gradient, weights, settings, m, v, vmax, cells)
    if applied:
        cells[C_VERSION] += pushes
    _monotonic(cells)
    for w in range(posted.size):
        taken[w] = counts[w]
    return 1 if applied else -1


@_jit
def _expect_next_push(src, now, last_push, push_due, times, pace_max):
    """``ShardServer._expect_next_push``: worker ``src`` pushed at ``now``; its next push is
    due one interval later (none if the interval was longer than ``pace_max``)."""
    interval = now - last_push[src]
    last_push[src] = now
    push_due[src] = now + interval if interval < pace_max else np.inf
    times[T_NEXT_DUE] = push_due.min()


@_jit
def _progress(flight, flight_since, cells, status_p, flag_p, scratch, now, deadline):
    """Test every reply in flight, freeing the rows of those sent; -1, or an MPI error
    code as -2 - code, or 1 if one is older than the deadline; else 0."""
    for row in range(flight.shape[0]):
        if flight[row, F_BUFFER] < 0:
            continue
        err = _test(flight.ctypes.data + 8 * (row * 4 + F_REQUEST), flag_p, status_p)
        if err != 0:
            return -2 - err
        if scratch[0] != 0:
            cells[C_SENT] += flight[row, F_BYTES]
            flight[row, F_BUFFER] = -1
        elif now - flight_since[row] > deadline:
            return 1
    return 0


@_jit
def _await_a_reply(flight, flight_since, cells, status_p, flag_p, scratch, deadline):
    """No buffer or row is free: yield the core, then progress the replies in flight.  -1
    to go on, else the outcome to return (MPI_FAILED, its error in the cells, or STUCK)."""
    _sched_yield()
    done = _progress(flight, flight_since, cells, status_p, flag_p, scratch,
                     _monotonic(cells), deadline)
    if done < -1:
        cells[C_ERROR] = -2 - done
        return MPI_FAILED
    return STUCK if done == 1 else -1


@_jit
def _readers(flight, buffer):
    n = 0
    for row in range(flight.shape[0]):
        n += flight[row, F_BUFFER] == buffer
    return n


@_jit
def _free_row(flight):
    for row in range(flight.shape[0]):
        if flight[row, F_BUFFER] < 0:
            return row
    return -1


@_jit
def _serve(requests, replies, h_byte, any_source, any_tag, src_at, tag_at, status, scratch,
           cells, flight, flight_since, pull_arg, w0, w1, w2, delta, scale, code, heard, state,
           last_push, push_due, times, tags, sleeps, deadline, until, step_kind, optimizer,
           half_code, bits, halves, inbox):
    """The loop (module doc).  ``tags``: PUSH, PUSH_PULL, PULL, ACK, DATA, OK, REFUSED,
    UNHEARD, HEARD_FROM; ``sleeps``: SLEEP_MIN_S, SLEEP_MAX_S, SLEEP_IDLE_S, IDLE_AFTER_S,
    WAKE_MARGIN_S, DUE_SLACK_S, PACE_MAX_S (``shard_server``'s constants); ``step_kind``:
    what a push is (``ShardLoop.serve``'s ``step``), ``optimizer`` the step's ``(settings,
    m, v, vmax)``, or None: then Numba prunes the step at compile time, and the loop most
    jobs run compiles in 8 s, where one loop with the step in it took 22 s (cold cache, the
    2-core VM at load 5; 7 s before the step and the bfloat16 wire came);
    ``half_code``: the bfloat16 wire's code where the store is float32 (else -1), ``bits``
    and ``halves`` its buffers; ``inbox``: None, or the server-side optimizer's inbox in the
    shard's window (``shard_window``): ``(posted, taken, slots, total)``, stepped on in
    place (:func:`_take_inbox`)."""
    push_t, push_pull_t, pull_t, ack_t, data_t = tags[0], tags[1], tags[2], tags[3], tags[4]
    ok, refused, unheard, heard_from = tags[5], tags[6], tags[7], tags[8]
    sleep_min, sleep_max, sleep_idle, idle_after = sleeps[0], sleeps[1], sleeps[2], sleeps[3]
    wake_margin, due_slack, pace_max = sleeps[4], sleeps[5], sleeps[6]
    status_p, flag_p = status.ctypes.data, scratch.ctypes.data
    count_p = flag_p + 4
    ack_p = cells.ctypes.data + 8 * C_ACK
    nbytes = w0.size * w0.itemsize
    n_workers = heard.size
    sleep = sleep_min
    last = _monotonic(cells)
    sending = False
    pull_by = 0.0   # a worker's pull is expected until then (after its push alone)
    while True:
        now = _monotonic(cells)
        if inbox is not None and optimizer is not None:
            current = cells[C_CURRENT]
            taken = _take_inbox(inbox[0], inbox[1], inbox[2], inbox[3], step_kind,
                                w0 if current == 0 else (w1 if current == 1 else w2),
                                optimizer[0], optimizer[1], optimizer[2], optimizer[3], cells)
            if taken < 0:
                return INBOX_REFUSED
            if taken > 0:
                sleep, last = sleep_min, now
        if sending:
            done = _progress(flight, flight_since, cells, status_p, flag_p, scratch, now,
                             deadline)
            if done < -1:
                cells[C_ERROR] = -2 - done
                return MPI_FAILED
            if done == 1:
                return STUCK
            sending = _readers(flight, -1) < flight.shape[0]
        err = _iprobe(any_source, any_tag, requests, flag_p, status_p)
        if err != 0:
            cells[C_ERROR] = err
            return MPI_FAILED
        if scratch[0] == 0:
            if now >= until:
                return QUIET
            if sending:
                _sched_yield()   # replies in flight: keep them moving, as a blocking send
                continue
            ahead = times[T_NEXT_DUE] - now
            if ahead <= -due_slack:   # that push is late: the next one due, if any
                nxt = np.inf
                for d in push_due:
                    if d > now - due_slack and d < nxt:
                        nxt = d
                times[T_NEXT_DUE] = nxt
                ahead = nxt - now
            margin = wake_margin + times[T_LATE_WAKE]
            if -due_slack < ahead < margin or now < pull_by:
                _sched_yield()   # a push or pull is due about now: poll, others run first
                continue
            pause = min(sleep, ahead - margin) if ahead > 0 else sleep
            _usleep(np.uint32(max(pause, 0.0) * 1e6))
            times[T_LATE_WAKE] = late_wake(times[T_LATE_WAKE],
                                           _monotonic(cells) - now - pause)
            sleep = min(2 * sleep, sleep_idle if now - last > idle_after else sleep_max)
            continue
        src, tag = status[src_at], status[tag_at]
        _get_count(status_p, h_byte, count_p)
        count = scratch[1]
        kind, wire = tag - tag % 10, tag % 10
        cells[C_SOURCE], cells[C_TAG], cells[C_COUNT] = src, tag, count
        halved = wire == half_code
        is_push = (kind == push_t or kind == push_pull_t) and step_kind != HAND_BACK \
            and count == (nbytes // 2 if halved else nbytes)
        if src < 0 or src >= n_workers or (wire != code and not halved) or \
                not (is_push or kind == pull_t and count == 8):
            return PROBED
        current = cells[C_CURRENT]
        target = -1
        if is_push and _readers(flight, current) == 0:
            target = current    # nothing reads the weights: the push is added in place
        elif is_push:
            # The sum goes to a buffer no reply reads (a reply's worker may take it late).
            while True:
                for b in range(BUFFERS):
                    if b != current and _readers(flight, b) == 0:
                        target = b
                        break
                if target >= 0:
                    break
                outcome = _await_a_reply(flight, flight_since, cells, status_p, flag_p,
                                         scratch, deadline)
                if outcome >= 0:
                    return outcome
        payload = pull_arg.ctypes.data
        if is_push:
            payload = bits.ctypes.data if halved else delta.ctypes.data
        err = _recv(payload, count, h_byte, src, tag, requests, status_p)
        if err != 0:
            cells[C_ERROR] = err
            return MPI_FAILED
        cells[C_RECEIVED] += count
        sleep, last = sleep_min, now
        if not is_push and pull_arg[0] > 0:
            return RECEIVED     # a barrier's pull: which weights it reads is Python's
        heard[src] = now
        if state[src] == unheard:
            state[src] = heard_from
        if is_push:
            if halved:
                widen_bfloat16(delta.view(np.uint32), bits)
            _expect_next_push(src, now, last_push, push_due, times, pace_max)
            source = w0 if current == 0 else (w1 if current == 1 else w2)
            out = w0 if target == 0 else (w1 if target == 1 else w2)
            if optimizer is not None:
                applied = step_checked(step_kind, source, delta, out, optimizer[0],
                                       optimizer[1], optimizer[2], optimizer[3], cells)
            elif target == current:
                applied = add_checked_in_place(source, delta, scale)
            else:
                applied = add_checked(source, delta, scale, out)
            if applied:
                cells[C_CURRENT] = target
                cells[C_VERSION] += 1
            cells[C_ACK], cells[C_ACK_STATUS] = cells[C_VERSION], ok if applied else refused
            err = _send(ack_p, 16, h_byte, src, ack_t, replies)
            if err != 0:
                cells[C_ERROR] = err
                return MPI_FAILED
            if not applied:
                return REFUSED
        cells[C_SERVED] += 1
        if kind == push_t:
            # A push alone is followed by its worker's pull once the state server grants it
            # (SyncClient.push_then_pull; the grant takes ~0.2 ms here): poll for it
            # rather than sleep through it in the backoff's steps.
            pull_by = now + due_slack
            continue
        # The weights as DATA, left in flight.
        row = _free_row(flight)
        while row < 0:
            outcome = _await_a_reply(flight, flight_since, cells, status_p, flag_p, scratch,
                                     deadline)
            if outcome >= 0:
                return outcome
            row = _free_row(flight)
        current = cells[C_CURRENT]
        weights = w0 if current == 0 else (w1 if current == 1 else w2)
        reads, address, size = current, weights.ctypes.data, nbytes
        if halved:   # the weights rounded into a bfloat16 buffer no reply reads
            half = -1
            while half < 0:
                for k in range(HALVES):
                    if _readers(flight, BUFFERS + k) == 0:
                        half = k
                        break
                if half < 0:
                    outcome = _await_a_reply(flight, flight_since, cells, status_p, flag_p,
                                             scratch, deadline)
                    if outcome >= 0:
                        return outcome
            round_to_bfloat16(halves[half], weights)
            reads, address, size = BUFFERS + half, halves[half].ctypes.data, nbytes // 2
        err = _isend(address, size, h_byte, src, data_t, replies,
                     flight.ctypes.data + 8 * (row * 4 + F_REQUEST))
        if err != 0:
            cells[C_ERROR] = err
            return MPI_FAILED
        flight[row, F_BUFFER], flight[row, F_WORKER], flight[row, F_BYTES] = reads, src, size
        flight_since[row] = now
        sending = True
