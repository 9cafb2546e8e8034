"""The state server's compiled hot path, and the client's compiled step: the per-iteration
messages received, checked, recorded, decided and answered in machine code.

Why: every worker sends a STEP (and, on the ring, a RESET) per iteration, and in Python the
serve loop spent 5-11 µs on each beyond the MPI calls themselves (probe, receive, check,
record, decide, reply: each a few dozen bytecodes, each MPI call a trip through mpi4py).  A
raw ping-pong of the same buffer costs 2-3 µs per round trip on these machines, so a decision
took 4-6x the network it rides on (bench/server/README.md).  Here, once the loop's probe has
found a message, one call of a Numba function that calls the MPI C library directly, without
the GIL, serves it and the hot window that follows (``_loop`` module doc).

What it covers, and what it leaves to the Python loop (the reference for every case):

* STEP under every policy whose step needs only its tables: bsp, asp, ssp, dssp and osp
  answer SYNC (their decisions live in push/pull and importance messages, which stay in
  Python); esync runs Alg. 2 through the same kernels (``sched.esync_query_state``), both
  query modes, while every worker is active; ebsp answers from the barrier already planned
  for the worker (its monitoring phase and held reports stay in Python).
* RESET under all of them but ebsp, whose reset may make the next plan (ZipLine).
* A message of another type, from a rank that is no worker, or of the wrong size is left in
  the queue: the Python loop probes it again.  A message received here that it does not
  complete (malformed, from a worker taken out, a case excluded above) is handed to the
  Python loop with its receipt time, which goes on from its validation step.  The compiled
  code makes no change to any table before it knows it will complete a message.
* The call returns when no message came for ``hot_s``, when housekeeping is due (also under
  a steady stream of messages), or when ESync's log of READY decisions is full; the Python
  loop then sleeps, wakes ahead, or keeps house exactly as without it.

Both paths write the same tables, counters and events:
``tests/test_server.py::test_the_compiled_path_changes_exactly_what_the_python_loop_changes``
gives every message a server with the compiled path takes to a second server without it,
with the same receipt time, and compares the two after each one.

On the worker's side, :class:`ClientPath` does ``SyncClient.step``'s round trip (header,
receive posted, send, 50 µs of polling) in one call.

The MPI bindings are Open MPI's (handles are pointers; the status layout is read at start);
on any other MPI, or with ``server_fast_path=False``, server and client run Python alone.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from mpsync.server import _wire as W
from mpsync.server._stats import EVENT_KINDS

__all__ = ["FastPath", "ClientPath", "query", "unavailable_reason", "policy_kind"]

# Policy families (``policy_kind``).
_BASE, _EBSP, _ESYNC = 0, 1, 2
# Return codes of ``_serve``.
QUIET = 0      # no message for hot_s, or housekeeping is due
PROBED = 1     # a message the Python loop must receive itself is waiting
RECEIVED = 2   # a message was received here and is handed over (``FastPath.handover``)
DRAIN = 3      # ESync's READY log is full
MPI_FAILED = 4  # an MPI call returned an error code (``FastPath.error``)

_K_REPORT = EVENT_KINDS.index("report")
_K_SYNC = EVENT_KINDS.index("sync")
_K_RESET = EVENT_KINDS.index("reset")
_MAX = float(W.MAX_ITER)
_READY_LOG = 1024

_symbols_loaded = None   # None: not tried; "" loaded; else why not


def unavailable_reason() -> str | None:
    """None if the compiled path can run in this process, else why it cannot."""
    global _symbols_loaded
    if _symbols_loaded is None:
        _symbols_loaded = _load_mpi_symbols()
    return _symbols_loaded or None


def _load_mpi_symbols() -> str:
    if MPI.get_vendor()[0] != "Open MPI":
        return f"the compiled path binds Open MPI; this is {MPI.get_vendor()[0]}"
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.split()[-1]
                if "/libmpi.so" in name:
                    path = name
                    break
    except OSError as e:
        return f"cannot read /proc/self/maps: {e}"
    if path is None:
        return "libmpi.so is not mapped in this process"
    import llvmlite.binding as ll

    ll.load_library_permanently(path)   # the compiled code links against these symbols
    return ""


def _status_layout() -> tuple[int, int, int]:
    """(int32 cells of an MPI_Status, index of MPI_SOURCE, index of MPI_TAG), read from a
    status mpi4py filled in: the layout differs between MPI libraries and versions."""
    status = MPI.Status()
    status.source, status.tag = 1234567, 7654321
    size = MPI._sizeof(status)
    cells = np.frombuffer(MPI.buffer.fromaddress(MPI._addressof(status), size), np.int32)
    return size // 4, int(np.flatnonzero(cells == 1234567)[0]), int(
        np.flatnonzero(cells == 7654321)[0])


def policy_kind(policy) -> int | None:
    from mpsync.server._policies import ESync, ElasticBSP, Policy

    if type(policy) is ESync:
        return _ESYNC
    if type(policy) is ElasticBSP:
        return _EBSP
    cls = type(policy)
    if cls.on_step is Policy.on_step and cls.on_reset is Policy.on_reset:
        return _BASE
    return None   # a policy this code does not know: the Python loop serves it


class FastPath:
    """The compiled hot path bound to one :class:`~mpsync.server.StateServer`'s tables."""

    def __init__(self, server):
        from mpsync.server._policies import ESync, ElasticBSP

        kind = policy_kind(server.policy)
        if kind is None:
            raise ValueError(f"no compiled path for policy {type(server.policy).__name__}")
        self.server = server
        self.kind = kind
        comm = server.comm
        n_cells, src_at, tag_at = _status_layout()
        self.mpi = np.array([MPI._handleof(comm), MPI._handleof(MPI.DOUBLE),
                             MPI._handleof(MPI.BYTE), MPI.ANY_SOURCE, MPI.ANY_TAG, src_at,
                             tag_at], dtype=np.int64)
        self.status = np.zeros(n_cells, dtype=np.int32)
        self.scratch = np.zeros(2, dtype=np.int32)          # Iprobe's flag, Get_count's count
        self.reply = np.zeros(W.MSG_LEN, dtype=np.float64)
        # (handled, last message time, source, tag, worker, receipt time, MPI error code)
        self.out = np.zeros(7, dtype=np.float64)
        self.worker_of = np.full(comm.Get_size(), -1, dtype=np.int64)
        for r, w in server.index.items():
            self.worker_of[r] = w
        t, c, ev = server.table, server.counters, server.events
        view = np.frombuffer
        self.tables = (t.iteration, t.last_event, t.interval, t.compute, t.round, t.removed,
                       server.last_heard, server.waiting_on_us, server.in_sync,
                       view(c.steps, np.int64), view(c.syncs, np.int64),
                       view(c.locals, np.int64), view(c.rounds, np.int64),
                       view(c.compute_s, np.float64), view(c.wait_server_s, np.float64),
                       view(c.aggregation_s, np.float64), ev.rows, ev.count_cell)
        p = server.policy
        none_i, none_f, none_b = (np.zeros(0, np.int64), np.zeros(0, np.float64),
                                  np.zeros(0, np.bool_))
        self.ready_log = np.zeros((_READY_LOG, 2), dtype=np.int64)
        self.ready_count = np.zeros(1, dtype=np.int64)
        if isinstance(p, ESync):
            self.esync = (p.k, p.capability, p.last_finish, p.ready, p.rounds, p.rtt)
        else:
            self.esync = (none_i, none_f, none_f, none_b, none_i, none_f)
        if isinstance(p, ElasticBSP):
            self.ebsp = (p.target, p.reports, p.held)
        else:
            self.ebsp = (none_i, none_i, none_b)
        self.eps = float(server.config.esync_slack)

    def serve(self, last_msg: float, hot_s: float, until: float,
              max_messages: int = 2 ** 62) -> int:
        """Serve what it can until quiet for ``hot_s`` since ``last_msg``, or ``until``, or
        ``max_messages`` were served; returns a code (module constants); ``out`` holds what
        the Python loop needs, the last message stays in the server's ``_msg``."""
        s = self.server
        everyone = s.policy._members()[2] if self.kind == _ESYNC else False
        epoch = s.policy.epoch if self.kind == _EBSP else -1
        code = _serve(self.mpi, self.status, self.scratch, s._msg, self.reply, self.worker_of,
                      self.out, last_msg, hot_s, until, max_messages, s.t0, self.kind, self.eps,
                      everyone,
                      epoch, *self.tables, *self.esync, self.ready_log, self.ready_count,
                      *self.ebsp)
        if self.ready_count[0]:
            self._drain()
        return code

    def warm_up(self) -> None:
        """Compile ``_serve`` (or load it from Numba's cache) before the first message: one
        call that probes an empty communicator of this process alone and returns."""
        s = self.server
        mpi = self.mpi.copy()
        mpi[0] = MPI._handleof(MPI.COMM_SELF)
        _serve(mpi, self.status, self.scratch, s._msg, self.reply, self.worker_of, self.out,
               0.0, 0.0, 0.0, 2 ** 62, s.t0, self.kind, self.eps, False, -1, *self.tables, *self.esync,
               self.ready_log, self.ready_count, *self.ebsp)

    def _drain(self) -> None:
        """ESync's READY decisions into the policy's per-worker lists (its ``describe``)."""
        per_round = self.server.policy.local_per_round
        for w, k in self.ready_log[:self.ready_count[0]].tolist():
            per_round[w].append(k)
        self.ready_count[0] = 0

    @property
    def handled(self) -> int:
        return int(self.out[0])

    @property
    def last_msg(self) -> float:
        return float(self.out[1])

    @property
    def handover(self) -> tuple[int, int, int, float]:
        """(source, tag, worker, receipt time) of a RECEIVED message."""
        o = self.out
        return int(o[2]), int(o[3]), int(o[4]), float(o[5])

    @property
    def error(self) -> int:
        return int(self.out[6])


# -- the compiled part ------------------------------------------------------------------------
# Everything below this line is Numba code; the MPI functions are bound by name after
# ``_load_mpi_symbols`` loaded libmpi (Numba's cache then keeps working: no address is baked
# into the compiled code).

import numba  # noqa: E402
from numba import types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from mpsync.sched.esync import esync_query_state, esync_reset  # noqa: E402

_i32, _ptr = types.int32, types.intp
_iprobe = types.ExternalFunction("MPI_Iprobe", _i32(_i32, _i32, _ptr, _ptr, _ptr))
_recv = types.ExternalFunction("MPI_Recv", _i32(_ptr, _i32, _ptr, _i32, _i32, _ptr, _ptr))
_send = types.ExternalFunction("MPI_Send", _i32(_ptr, _i32, _ptr, _i32, _i32, _ptr))
_get_count = types.ExternalFunction("MPI_Get_count", _i32(_ptr, _ptr, _ptr))
_wtime = types.ExternalFunction("MPI_Wtime", types.float64())

_jit = numba.njit(cache=True, nogil=True)


@_jit
def _request_ok(m):
    """``_loop._request_ok`` in Numba: every slot finite; SEQ, ITER, ROUND, COUNT, FLAG
    integers in [0, 2**53); COMPUTE, AGG, WAIT >= 0."""
    for i in (W.COMPUTE, W.AGG, W.WAIT):
        if not (0.0 <= m[i] < math.inf):
            return False
    for i in (W.SEQ, W.ITER, W.ROUND, W.COUNT, W.FLAG):
        v = m[i]
        if not (0.0 <= v < _MAX) or v != math.floor(v):
            return False
    return True


@_jit
def _event(rows, count, t, w, kind, value):
    i = count[0] % rows.shape[0]
    rows[i, 0] = t
    rows[i, 1] = w
    rows[i, 2] = kind
    rows[i, 3] = value
    count[0] += 1


@_jit
def _serve(mpi, status, scratch, msg, reply, worker_of, out, last_msg, hot_s, until,
           max_messages, t0, kind, eps, everyone, epoch,
           iteration, last_event, interval, compute, round_, removed,
           last_heard, waiting, in_sync,
           steps, syncs, locals_, rounds, compute_s, wait_server_s, aggregation_s,
           ev_rows, ev_count,
           e_k, e_cap, e_finish, e_ready, e_rounds, e_rtt, ready_log, ready_count,
           b_target, b_reports, b_held):
    comm, h_double, h_byte = mpi[0], mpi[1], mpi[2]
    any_source, any_tag = np.int32(mpi[3]), np.int32(mpi[4])
    src_at, tag_at = mpi[5], mpi[6]
    status_p = status.ctypes.data
    flag_p = scratch.ctypes.data
    count_p = flag_p + 4
    handled = 0
    out[0] = 0.0
    out[1] = last_msg
    out[6] = 0.0
    # Also back to Python once housekeeping is due, even while messages keep coming: a
    # silent worker must be found under load too.
    while handled < max_messages and last_msg < until:
        err = _iprobe(any_source, any_tag, comm, flag_p, status_p)
        if err != 0:
            out[6] = err
            return MPI_FAILED
        if scratch[0] == 0:
            now = _wtime()
            if now - last_msg >= hot_s or now >= until:
                return QUIET
            continue
        src, tag = status[src_at], status[tag_at]
        if (tag != W.STEP and tag != W.RESET) or src < 0 or src >= worker_of.shape[0]:
            return PROBED
        w = worker_of[src]
        if w < 0:
            return PROBED
        _get_count(status_p, h_byte, count_p)
        if scratch[1] != 8 * W.MSG_LEN:
            return PROBED
        err = _recv(msg.ctypes.data, W.MSG_LEN, h_double, src, tag, comm, status_p)
        if err != 0:
            out[6] = err
            return MPI_FAILED
        now = _wtime()
        last_msg = now
        out[1] = now
        out[2] = src
        out[3] = tag
        out[4] = w
        out[5] = now
        if not _request_ok(msg) or removed[w]:
            return RECEIVED
        delayed = kind == _ESYNC and msg[W.FLAG] == 1.0
        if tag == W.STEP:
            # Can it be completed here?  (Checked before anything is written.)
            if kind == _EBSP and (epoch < 0 or b_target[w] < 0):
                return RECEIVED
            if kind == _ESYNC and not everyone and not (delayed and e_ready[w]):
                return RECEIVED
        elif kind == _EBSP:
            return RECEIVED
        # _loop.StateServer._receive
        last_heard[w] = now
        waiting[w] = False
        t = now - t0
        if tag == W.RESET:
            # _loop.StateServer._on_reset, Policy.on_reset, ESync.on_reset
            rnd = np.int64(msg[W.ROUND])
            in_sync[w] = False
            rounds[w] += 1
            aggregation_s[w] += msg[W.AGG]
            round_[w] = rnd
            last_event[w] = now
            if kind == _ESYNC:
                esync_reset(e_k, e_finish, e_ready, e_rounds, w, e_rounds[w] + 1, now)
            _event(ev_rows, ev_count, t, w, _K_RESET, rnd)
            handled += 1
            out[0] = handled
            continue
        # _loop.StateServer._on_step, WorkerTable.record_report
        k = np.int64(msg[W.ITER])
        c = msg[W.COMPUTE]
        last = last_event[w]
        if last == last:
            interval[w] = now - last
        last_event[w] = now
        iteration[w] = k
        compute[w] = c
        steps[w] += 1
        compute_s[w] += c
        wait_server_s[w] = msg[W.WAIT]
        action, local_iters = W.SYNC, 0
        if kind == _ESYNC:
            # ESync.on_step
            if delayed:
                e_rtt[w] = msg[W.AGG]
            if delayed and e_ready[w]:
                action = W.LOCAL
            else:
                k_w = e_k[w] + 1
                cap = c + e_rtt[w] if delayed else c
                if esync_query_state(e_k, e_cap, e_finish, e_ready, e_rounds, w, k_w, cap,
                                     now, now, eps):
                    ready_log[ready_count[0], 0] = w
                    ready_log[ready_count[0], 1] = k_w
                    ready_count[0] += 1
                else:
                    action = W.LOCAL
        elif kind == _EBSP:
            # ElasticBSP.on_step / decide_held with the barrier planned
            b_reports[w] += 1
            b_held[w] = False
            if k < b_target[w]:
                action, local_iters = W.LOCAL, b_target[w] - k
        _event(ev_rows, ev_count, t, w, _K_REPORT, k)
        handled += 1
        out[0] = handled
        # _loop.StateServer._answer_step, _send_reply
        if action == W.SYNC:
            in_sync[w] = True
            syncs[w] += 1
            _event(ev_rows, ev_count, t, w, _K_SYNC, iteration[w])
        else:
            locals_[w] += 1
            if delayed:
                continue   # ESync §4.2: NOT-READY is implicit in delayed-ACK mode
        reply[0] = action
        reply[1] = local_iters
        reply[2] = round_[w]
        reply[3] = msg[W.SEQ]
        err = _send(reply.ctypes.data, W.MSG_LEN, h_double, src, W.REPLY, comm)
        if err != 0:
            out[6] = err
            return MPI_FAILED
        if ready_count[0] == ready_log.shape[0]:
            return DRAIN
    return QUIET


# -- the worker's side ------------------------------------------------------------------------
_irecv = types.ExternalFunction("MPI_Irecv", _i32(_ptr, _i32, _ptr, _i32, _i32, _ptr, _ptr))
_test = types.ExternalFunction("MPI_Test", _i32(_ptr, _ptr, _ptr))


def _pointer_from(dtype):
    """An intrinsic: an integer address as a pointer to ``dtype`` (for ``numba.carray``)."""
    @intrinsic
    def pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return types.CPointer(dtype)(address), codegen
    return pointer


_f64_at = _pointer_from(types.float64)
_i64_at = _pointer_from(types.int64)


@_jit
def _query(comm, h_double, msgs_at, handles_at, server, tag, seq, iteration, compute, wait,
           busy_s):
    """``SyncClient.step``'s round trip in one call: the header into the 8 float64 at
    ``msgs_at``, the reply's receive into the 8 after them posted first (``_client`` module
    doc), the send, then polling for ``busy_s``.  At ``handles_at`` (int64 cells): the
    request (cell 0), Test's flag (cell 1), a status (from cell 2).  Every argument is a
    number, no array: Numba's dispatch then costs ~0.3 µs less.  Returns the seconds it took
    if the reply is in, -1.0 if it is still pending (its request handle in cell 0), or
    -2.0 - an MPI error code."""
    start = _wtime()
    msgs = numba.carray(_f64_at(msgs_at), 2 * W.MSG_LEN)
    msgs[W.SEQ] = seq
    msgs[W.ITER] = iteration
    msgs[W.COMPUTE] = compute
    msgs[W.ROUND] = 0.0
    msgs[W.AGG] = 0.0
    msgs[W.WAIT] = wait
    msgs[W.COUNT] = 0.0
    msgs[W.FLAG] = 0.0
    flag = numba.carray(_i64_at(handles_at + 8), 1)   # an int written into a zeroed cell
    request_p, flag_p, status_p = handles_at, handles_at + 8, handles_at + 16
    flag[0] = 0
    err = _irecv(msgs_at + 8 * W.MSG_LEN, W.MSG_LEN, h_double, server, W.REPLY, comm,
                 request_p)
    if err != 0:
        return -2.0 - err
    err = _send(msgs_at, W.MSG_LEN, h_double, server, tag, comm)
    if err != 0:
        return -2.0 - err
    while True:
        err = _test(request_p, flag_p, status_p)
        if err != 0:
            return -2.0 - err
        if flag[0] != 0:
            return _wtime() - start
        if _wtime() - start > busy_s:
            return -1.0


class ClientPath:
    """The compiled step of one :class:`~mpsync.server.SyncClient` (``_query``); ``msgs``:
    its request and reply buffers, one float64 block of 16, kept alive by the client."""

    def __init__(self, comm, server_rank: int, msgs: np.ndarray):
        status_cells = -(-_status_layout()[0] // 2)
        self.handles = np.zeros(2 + status_cells, np.int64)
        self.msgs = msgs
        self.args = (MPI._handleof(comm), MPI._handleof(MPI.DOUBLE), msgs.ctypes.data,
                     self.handles.ctypes.data, int(server_rank), W.STEP)
        # Compile or load from the cache now, not in the first step: a self-send on
        # COMM_SELF, answered by its own receive.
        if _query(MPI._handleof(MPI.COMM_SELF), *self.args[1:4], 0, W.REPLY, 0, 0, 0.0, 0.0,
                  1.0) < 0:
            raise RuntimeError("the compiled client path failed its self-test")

    def pending(self) -> MPI.Request:
        """The reply's request when ``_query`` returned -1.0, as an mpi4py request."""
        return MPI.Request.fromhandle(int(self.handles[0]))


query = _query
