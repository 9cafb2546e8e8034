"""The state server's compiled loop, and the client's compiled step: transport in machine code
around the per-message rules of ``rules``.

Why: every worker sends a STEP (and, on the ring, a RESET) per iteration, and in Python each
MPI call is a trip through mpi4py and each rule a few dozen bytecodes.  A raw ping-pong of the
same buffer costs 2-3 µs per round trip on these machines, so a decision made in Python took
several times the network it rides on (bench/server/README.md).  Here, once the serve loop's
probe has found a message, one call of a Numba function that calls the MPI C library directly,
without the GIL, serves it and the hot window that follows (``_loop`` module doc): probe,
receive, then the same ``rules`` functions the Python loop calls (check, record, decide, log,
fill the reply), then send.

What it serves, and what it leaves to the Python loop:

* STEP and RESET of every policy whose family the rules cover (the registry's
  ``fast_path``, ``mpsync.policies``):
  ``FAST_BASE`` (bsp, asp, ssp, dssp, osp: steps answered SYNC; their decisions live in
  push/pull and importance messages, which stay in Python), ``FAST_ESYNC`` (Alg. 2, both
  query modes; the capability test stays in Python), ``FAST_EBSP`` (steps whose barrier is
  planned; resets and monitoring-phase steps may plan the next barrier, ZipLine, so they
  stay in Python: ``rules.fast_hands_over``).
* The sharded parameter server's ``PUSH_PULL`` (count the push the shards applied, grant the
  pull) where the policy's pull rule is compiled (``pull_rules``: ASP, SSP) and the pull is
  granted at once; a pull the rule holds, and a worker's last push, are handed over.
* A message of another type, from a rank that is no worker, or of the wrong size is left in
  the queue: the Python loop probes it again.  A message received here that it does not
  complete (malformed, from a worker taken out, an ElasticBSP case above) is handed to the
  Python loop with its receipt time, which goes on from its validation step.  Nothing is
  written before it is known that the message will be completed here.
* The call returns when no message came for ``hot_s``, when housekeeping is due (also under
  a steady stream of messages), or when ESync's log of READY decisions is full; the Python
  loop then sleeps, wakes ahead, or keeps house exactly as without it.

What it works on is named: the loop's bindings and the rules' tables travel in one
:class:`ServeState` (a Numba structref, passed as one pointer), each call's outcome comes back
as a :class:`ServeResult`, and a client's round trip is bound to a :class:`QueryBinding`.
The rules are compiled into the loop (LLVM inlines them: the same flags, one module), and a
change to them reaches the cached loop because ``mpsync.sched._numba`` stamps cached code
with every file of the jitted packages.

On the worker's side, :class:`ClientPath` does ``SyncClient.step``'s round trip (header,
receive posted, send, 50 µs of polling) in one call.

The MPI bindings are Open MPI's (handles are pointers; the status layout is read at start);
on any other MPI, or with ``server_fast_path=False``, server and client run Python alone.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from mpsync.server import pull_rules, rules, wire as W

__all__ = ["FastPath", "ServeResult", "ServeState", "ClientPath", "QueryBinding", "query",
           "unavailable_reason", "REPLY_OUT_OF_ORDER"]

# Return codes of ``_serve``.
QUIET = 0      # no message for hot_s, or housekeeping is due
PROBED = 1     # a message the Python loop must receive itself is waiting
RECEIVED = 2   # a message was received here and is handed over (``FastPath.handover``)
# ``_query``'s return when the reply that came is not to its request (between -1.0, pending,
# and -2.0 - an MPI error code, which is at most -3.0).
REPLY_OUT_OF_ORDER = -1.5
DRAIN = 3      # ESync's READY log is full
MPI_FAILED = 4  # an MPI call returned an error code (``FastPath.error``)

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


class ServeResult(NamedTuple):
    """What one call of the compiled loop did (:meth:`FastPath.serve`)."""
    code: int            # QUIET, PROBED, RECEIVED, DRAIN or MPI_FAILED (module constants)
    handled: int         # messages served to the end in compiled code
    last_msg: float      # receipt time (MPI_Wtime) of the last message it received
    source: int          # RECEIVED: the handed-over message's rank, tag, worker, receipt time
    tag: int
    worker: int
    received_at: float
    error: int           # MPI_FAILED: the MPI error code

    @property
    def handover(self) -> tuple[int, int, int, float]:
        """(source, tag, worker, receipt time) of a RECEIVED message."""
        return self.source, self.tag, self.worker, self.received_at


class FastPath:
    """The compiled loop bound to one server's buffers and tables.

    ``kind`` is the rule family (``rules.FAST_*``); ``policy`` gives, for ESync and ElasticBSP, its rule
    tables (``cells``), its active ``members()`` and its plan ``epoch``; ``tables``,
    ``counters`` and ``events`` are the server's ``rules`` named tuples; ``request`` the
    buffer the last message is received into (the Python loop reads a handed-over message
    there); ``index``: communicator rank -> worker.
    """

    def __init__(self, comm, index: dict, kind: int, policy, tables, counters, events, request,
                 t0, eps, ps=None):
        self.kind = kind
        self.policy = policy
        n_cells, src_at, tag_at = _status_layout()
        worker_of = np.full(comm.Get_size(), -1, dtype=np.int64)
        for r, w in index.items():
            worker_of[r] = w
        es = policy.cells if kind == rules.FAST_ESYNC else rules.new_esync_tables(0, 0)
        eb = policy.cells if kind == rules.FAST_EBSP else rules.new_ebsp_tables(0)
        self.esync = es
        self._no_members = np.zeros(0, np.int64)
        if ps is None:   # no parameter server's requests served here
            n = len(tables.iteration)
            ps = pull_rules.new_ps_tables(np.zeros(n, np.int64), np.zeros((n, 2)),
                                          np.zeros(n, np.bool_), np.zeros(n, np.bool_),
                                          np.zeros(n, np.int64), np.zeros(n, np.int64))
        self.ps = ps

        def bind(c):
            return _new_state(
                MPI._handleof(c), MPI._handleof(MPI.DOUBLE), MPI._handleof(MPI.BYTE),
                MPI.ANY_SOURCE, MPI.ANY_TAG, src_at, tag_at, np.zeros(n_cells, np.int32),
                np.zeros(2, np.int32), request, W.new_msg(), worker_of, tables, counters,
                events, es, eb, ps, float(t0), float(eps), kind)

        self.state = bind(comm)
        self._bind = bind
        self._call = _serve   # until warm_up binds the compiled code

    def serve(self, last_msg: float, hot_s: float, until: float,
              max_messages: int = 2 ** 62, first_by: float = 0.0) -> ServeResult:
        """Serve what it can until quiet for ``hot_s`` since ``last_msg``, or ``until``, or
        ``max_messages`` were served; returns what it did.  With ``first_by`` (an
        ``MPI.Wtime``) it waits for a first message until then, yielding the core between
        probes: a report that is due (``_loop`` module doc) then finds the server already in
        compiled code, instead of its Python loop and this call's entry."""
        p = self.policy
        esync = self.kind == rules.FAST_ESYNC
        members = p.members() if esync else self._no_members
        epoch = p.epoch if self.kind == rules.FAST_EBSP else -1
        result = _new_result(self._call(self.state, members, last_msg, hot_s, until,
                                        max_messages, epoch, first_by))
        if esync and self.esync.ready_count[0] == len(self.esync.ready_log):
            p.drain_ready_log()
        return result

    def warm_up(self) -> None:
        """Compile ``_serve`` (or load it from Numba's cache) before the first message: one
        call that probes an empty communicator of this process alone and returns.  Then
        binds the compiled function itself: Numba's dispatch, which types every argument on
        every call, costs about as much as the rest of an entry together (~1.7 µs)."""
        args = (self.state, self._no_members, 0.0, 0.0, 0.0, 2 ** 62, -1, 0.0)
        _serve(self._bind(MPI.COMM_SELF), *args[1:])
        self._call = _compiled(_serve, args)


def _compiled(dispatcher, args):
    """The machine code ``dispatcher`` runs for arguments like ``args``, callable without
    Numba's per-call typing (its ``entry_point``); the dispatcher itself if it has none."""
    try:
        sig = tuple(dispatcher.typeof_pyval(a) for a in args)
        return dispatcher.overloads[sig].entry_point
    except (AttributeError, KeyError):
        return dispatcher


_new_result = ServeResult._make


# -- the compiled part ------------------------------------------------------------------------
# Everything below this line is Numba code; the MPI functions are bound by name after
# ``_load_mpi_symbols`` loaded libmpi (Numba's cache then keeps working: no address is baked
# into the compiled code).

import numba  # noqa: E402
from numba import types  # noqa: E402
from numba.experimental import structref  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

_i32, _ptr = types.int32, types.intp
_iprobe = types.ExternalFunction("MPI_Iprobe", _i32(_i32, _i32, _ptr, _ptr, _ptr))
_recv = types.ExternalFunction("MPI_Recv", _i32(_ptr, _i32, _ptr, _i32, _i32, _ptr, _ptr))
_send = types.ExternalFunction("MPI_Send", _i32(_ptr, _i32, _ptr, _i32, _i32, _ptr))
_get_count = types.ExternalFunction("MPI_Get_count", _i32(_ptr, _ptr, _ptr))
_wtime = types.ExternalFunction("MPI_Wtime", types.float64())
_sched_yield = types.ExternalFunction("sched_yield", _i32())

_jit = numba.njit(cache=True, nogil=True)

LATE_DECAY = 0.98   # per sleep (``late_wake``): a busy spell is forgotten in ~100 sleeps


@_jit
def late_wake(estimate, overshoot):
    """How late a sleep of this thread wakes, given the last estimate and one sleep's
    ``overshoot`` (woken minus asked for): the largest recent overshoot, each older one
    decaying by ``LATE_DECAY`` per sleep.  A loop that wakes for a message due at ``t``
    (the state server's for a report, a shard's for a push) polls from ``t - margin -
    estimate`` on instead of sleeping through it: beside a computing thread on its core a
    1 ms sleep wakes 0.9 ms late at the median and 3.4 ms at the 90th percentile (the kernel
    lets the computing thread finish its slice), on an idle core 0.08 ms."""
    return max(overshoot, estimate * LATE_DECAY)


@structref.register
class _ServeStateType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class ServeState(structref.StructRefProxy):
    """What the compiled loop is bound to, by name (fields: ``_STATE_FIELDS``): the MPI
    handles (``comm``, ``h_double``, ``h_byte``, ``any_source``, ``any_tag``) and where an
    MPI_Status keeps its source and tag (``src_at``, ``tag_at``); its buffers (``status``
    cells, ``scratch`` for Iprobe's flag and Get_count's count, the ``request`` received into,
    the ``reply``) and ``worker_of`` (rank -> worker, -1: none); the rules' tables
    (``tables``, ``counters``, ``events``, ``esync_tables``, ``ebsp_tables``); the server's clock origin
    ``t0``, ESync's ``eps`` and the rule family ``kind``.

    One object on purpose: Numba passes it as one pointer, where the 36 arrays inside it,
    passed as arguments, were each unboxed at every entry into the loop (the entry cost of a
    query that finds the server between hot windows)."""


_STATE_FIELDS = ("comm", "h_double", "h_byte", "any_source", "any_tag", "src_at", "tag_at",
                 "status", "scratch", "request", "reply", "worker_of", "tables", "counters",
                 "events", "esync_tables", "ebsp_tables", "ps_tables", "t0", "eps", "kind")
structref.define_constructor(ServeState, _ServeStateType, _STATE_FIELDS)
structref.define_boxing(_ServeStateType, ServeState)


@_jit
def _new_state(comm, h_double, h_byte, any_source, any_tag, src_at, tag_at, status, scratch,
               request, reply, worker_of, tables, counters, events, esync_tables, ebsp_tables,
               ps_tables, t0, eps, kind):
    """A :class:`ServeState` (compiled once into Numba's cache, unlike a proxy's own
    constructor, which is compiled in every process)."""
    return ServeState(comm, h_double, h_byte, any_source, any_tag, src_at, tag_at, status,
                      scratch, request, reply, worker_of, tables, counters, events,
                      esync_tables, ebsp_tables, ps_tables, t0, eps, kind)


@_jit
def _result(code, handled, last_msg, src, tag, w, now, err):
    """``ServeResult``'s fields, with the types every exit of ``_serve`` shares."""
    return (np.int64(code), np.int64(handled), np.float64(last_msg), np.int64(src),
            np.int64(tag), np.int64(w), np.float64(now), np.int64(err))


@_jit
def _serve(st, members, last_msg, hot_s, until, max_messages, epoch, first_by):
    """The transport: probe, receive, hand to the rules, send (module doc).  ``st``: a
    :class:`ServeState`; returns the fields of a :class:`ServeResult`.  Until a first
    message or ``first_by``, an empty probe yields the core (``FastPath.serve``).
    One function because it is one polling loop whose every exit hands a message back to
    Python at a different point; what a message does is in the ``rules`` it calls."""
    tables, counters, events, es, eb = st.tables, st.counters, st.events, st.esync_tables, st.ebsp_tables
    msg, reply, status, scratch, worker_of = st.request, st.reply, st.status, st.scratch, \
        st.worker_of
    comm, h_double, h_byte, kind = st.comm, st.h_double, st.h_byte, st.kind
    any_source, any_tag = np.int32(st.any_source), np.int32(st.any_tag)
    src_at, tag_at, t0, eps = st.src_at, st.tag_at, st.t0, st.eps
    ps = st.ps_tables
    # The sharded PS's PUSH_PULL, where the policy's pull rule is compiled (pull_rules).
    push_pulls = (kind == rules.FAST_BASE and ps.cells[pull_rules.PS_READY] == 1
                  and ps.cells[pull_rules.PS_BOUND] != pull_rules.NOT_SERVED)
    status_p = status.ctypes.data
    flag_p = scratch.ctypes.data
    count_p = flag_p + 4
    handled = 0
    # Also back to Python once housekeeping is due, even while messages keep coming: a
    # silent worker must be found under load too.
    while handled < max_messages and last_msg < until:
        err = _iprobe(any_source, any_tag, comm, flag_p, status_p)
        if err != 0:
            return _result(MPI_FAILED, handled, last_msg, -1, -1, -1, 0.0, err)
        if scratch[0] == 0:
            now = _wtime()
            if handled == 0 and now < first_by and now < until:
                _sched_yield()   # the worker being waited for may need this core
                continue
            if now - last_msg >= hot_s or now >= until:
                return _result(QUIET, handled, last_msg, -1, -1, -1, 0.0, 0)
            continue
        src, tag = status[src_at], status[tag_at]
        if (tag != W.STEP and tag != W.RESET and not (tag == W.PUSH_PULL and push_pulls)) \
                or src < 0 or src >= worker_of.shape[0]:
            return _result(PROBED, handled, last_msg, src, tag, -1, 0.0, 0)
        w = worker_of[src]
        if w < 0:
            return _result(PROBED, handled, last_msg, src, tag, -1, 0.0, 0)
        _get_count(status_p, h_byte, count_p)
        if scratch[1] != 8 * W.MSG_LEN:
            return _result(PROBED, handled, last_msg, src, tag, w, 0.0, 0)
        err = _recv(msg.ctypes.data, W.MSG_LEN, h_double, src, tag, comm, status_p)
        if err != 0:
            return _result(MPI_FAILED, handled, last_msg, src, tag, w, 0.0, err)
        now = _wtime()
        last_msg = now
        # Can it be completed here?  (Decided before anything is written.)
        if rules.request_problem(msg) != 0 or tables.removed[w] or \
                rules.fast_hands_over(kind, tag, np.int64(msg[W.ITER]), epoch, eb, w):
            return _result(RECEIVED, handled, last_msg, src, tag, w, now, 0)
        if tag == W.PUSH_PULL:
            # Served here only when the pull is granted at once (else the Python loop holds
            # it) and the push is not a worker's last (its bookkeeping is the Python loop's).
            if msg[W.COUNT] != 0 or msg[W.FLAG] != 0 or ps.done[w] or \
                    not pull_rules.ps_pull_granted(tables, ps, w):
                return _result(RECEIVED, handled, last_msg, src, tag, w, now, 0)
            rules.record_heard(tables, w, now)
            extra = pull_rules.ps_push_pull(tables, ps, w, now)
            rules.log_event(events, now - t0, w, rules.K_PUSH, msg[W.ITER])
            rules.fill_reply(reply, W.SYNC, 0, tables.round[w], msg[W.SEQ], extra, 0,
                             ps.cells[pull_rules.PS_VERSION])
            err = _send(reply.ctypes.data, W.MSG_LEN, h_double, src, W.REPLY, comm)
            if err != 0:
                return _result(MPI_FAILED, handled, last_msg, src, tag, w, now, err)
            rules.log_event(events, _wtime() - t0, w, rules.K_PULL, ps.pushes[w])
            ps.cells[pull_rules.PS_SERVED] += 1
            handled += 1
            # No hot window after it (the Python loop's rule, ``_loop``): this worker's next
            # message comes after its exchange with the shards at the soonest.
            last_msg = now - hot_s
            continue
        rules.record_heard(tables, w, now)
        t = now - t0
        if tag == W.RESET:
            rnd = np.int64(msg[W.ROUND])
            rules.count_reset(counters, w, msg[W.AGG])
            rules.record_reset(tables, w, rnd, now)
            if kind == rules.FAST_ESYNC:
                rules.esync_new_round(es, w, now)
            rules.log_event(events, t, w, rules.K_RESET, rnd)
            handled += 1
            continue
        k = np.int64(msg[W.ITER])
        compute = msg[W.COMPUTE]
        delayed = kind == rules.FAST_ESYNC and msg[W.FLAG] == 1.0
        rules.record_report(tables, w, k, compute, now)
        rules.count_step(counters, w, compute, msg[W.WAIT])
        action, local_iters = rules.fast_decision(kind, es, eb, members, w, k, compute, now,
                                                  eps, delayed, msg[W.AGG])
        rules.log_event(events, t, w, rules.K_REPORT, k)
        handled += 1
        rules.record_answer(tables, counters, events, w, action, t)
        if action == W.LOCAL and delayed:
            continue   # ESync §4.2: NOT-READY is implicit in delayed-ACK mode
        rules.fill_reply(reply, action, local_iters, tables.round[w], msg[W.SEQ], 0, 0, 0)
        err = _send(reply.ctypes.data, W.MSG_LEN, h_double, src, W.REPLY, comm)
        if err != 0:
            return _result(MPI_FAILED, handled, last_msg, src, tag, w, now, err)
        if kind == rules.FAST_ESYNC and es.ready_count[0] == es.ready_log.shape[0]:
            return _result(DRAIN, handled, last_msg, -1, -1, -1, 0.0, 0)
    return _result(QUIET, handled, last_msg, -1, -1, -1, 0.0, 0)


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
# ``_query``'s int64 cells (``ClientPath.handles``): 0 the request, 1 Test's flag, 2-5 the
# decision, then an MPI_Status.
_DECISION_CELL = 2
_STATUS_CELL = 6
_i64_at = _pointer_from(types.int64)


@_jit
def _query(comm, h_double, msgs_at, handles_at, server, tag, seq, iteration, compute, wait,
           busy_s):
    """``SyncClient.step``'s round trip in one call: the header into the 8 float64 at
    ``msgs_at``, the reply's receive into the 8 after them posted first (``_client`` module
    doc), the send, then polling for ``busy_s``.  At ``handles_at`` (int64 cells): the
    request (cell 0), Test's flag (cell 1), the decision (cells 2-5), a status (from cell 6).  Every argument is a
    number, no array: Numba's dispatch then costs ~0.3 µs less.  A completed reply's
    action, local iterations, round and extra go, as int64, into cells 2-5 (``ClientPath``).  Returns the seconds it took
    if the reply to ``seq`` is in, -1.0 if it is still pending (its request handle in cell
    0), ``REPLY_OUT_OF_ORDER`` if the reply in is to another request, or -2.0 - an MPI
    error code."""
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
    request_p, flag_p, status_p = handles_at, handles_at + 8, handles_at + 8 * _STATUS_CELL
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
            reply = msgs[W.MSG_LEN:]
            if reply[W.R_SEQ] != seq:
                return REPLY_OUT_OF_ORDER
            # The decision as integers, which Python reads without a float in between.
            decision = numba.carray(_i64_at(handles_at + 8 * _DECISION_CELL), 4)
            decision[0] = np.int64(reply[W.R_ACTION])
            decision[1] = np.int64(reply[W.R_LOCAL])
            decision[2] = np.int64(reply[W.R_ROUND])
            decision[3] = np.int64(reply[W.R_EXTRA])
            return _wtime() - start
        if _wtime() - start > busy_s:
            return -1.0


class QueryBinding(NamedTuple):
    """``_query``'s first arguments, by name: what one client's round trip is bound to."""
    comm: int         # MPI handle of the control communicator
    h_double: int     # MPI handle of MPI_DOUBLE
    msgs_at: int      # address of the request (8 float64) followed by the reply (8)
    handles_at: int   # address of the int64 cells: request, Test's flag, decision, status
    server: int       # the server's rank
    tag: int          # W.STEP


class ClientPath:
    """The compiled step of one :class:`~mpsync.server.SyncClient` (``_query``); ``msgs``:
    its request and reply buffers, one float64 block of 16, kept alive by the client."""

    def __init__(self, comm, server_rank: int, msgs: np.ndarray):
        status_cells = -(-_status_layout()[0] // 2)
        self.handles = np.zeros(_STATUS_CELL + status_cells, np.int64)
        # The last compiled reply's (action, local_iters, round, extra), as Python ints.
        self.decision = memoryview(self.handles)[_DECISION_CELL:_DECISION_CELL + 4]
        self.msgs = msgs
        self.args = QueryBinding(MPI._handleof(comm), MPI._handleof(MPI.DOUBLE),
                                 msgs.ctypes.data, self.handles.ctypes.data, int(server_rank),
                                 W.STEP)
        # Compile or load from the cache now, not in the first step: a self-send on
        # COMM_SELF, answered by its own receive (a REPLY whose SEQ cell is the 0 sent).
        self_test = (MPI._handleof(MPI.COMM_SELF), *self.args[1:4], 0, W.REPLY, 0, 0, 0.0,
                     0.0, 1.0)
        if _query(*self_test) < 0:
            raise RuntimeError("the compiled client path failed its self-test")
        # The machine code itself: Numba's dispatcher types all 11 arguments at every call
        # (0.1-0.2 µs of a 2 µs round trip).  The step passes exactly these types.
        self.call = _compiled(_query, self_test)

    def pending(self) -> MPI.Request:
        """The reply's request when ``_query`` returned -1.0, as an mpi4py request."""
        return MPI.Request.fromhandle(int(self.handles[0]))


query = _query
