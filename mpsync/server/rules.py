"""The state server's per-message rules, once: what a request must look like, what a report or
a reset writes into the tables, each policy's fast decision, the event log and the reply.

Both serve loops call these functions: the Python loop (``_loop``) from its handlers and the
policy objects, the compiled loop (``_fastpath``) from inside its Numba code, where they are
inlined around the transport (probe, receive, send).  Nothing here knows MPI: the tables are
plain numpy arrays grouped in named tuples (:class:`Tables`, :class:`Counters`,
:class:`Events`, :class:`ESyncTables`, :class:`EBSPTables`), so a rule can also be driven by a
single-process test or a simulator with any clock.

Every jitted rule has a plain-Python reference beside it (``*_reference``), written for
reading, not speed; ``tests/test_server_rules.py`` runs both on seeded random tables and
messages and compares every array afterwards (the way ``mpsync.sched`` tests its kernels).

Message layouts are ``wire``'s: the request slots ``SEQ, ITER, COMPUTE, ROUND, AGG, WAIT,
COUNT, FLAG`` and the reply slots ``R_*``; nothing outside ``wire`` and this module indexes a
message by number.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from mpsync.sched._numba import jit
from mpsync.server import wire as W
from mpsync.server.family_rules import (  # noqa: F401  (re-exported: one place to import rules)
    EBSP_MONITOR_REPORTS, HOLD, ebsp_decide, ebsp_decide_reference, ebsp_new_superstep,
    ebsp_new_superstep_reference, ebsp_step, ebsp_step_reference, esync_capability_test,
    esync_capability_test_reference, esync_new_round, esync_new_round_reference, esync_step,
    esync_step_reference)

__all__ = [
    "Tables", "Counters", "Events", "ESyncTables", "EBSPTables", "EVENT_KINDS",
    "new_tables", "new_counters", "new_events", "new_esync_tables", "new_ebsp_tables",
    "request_problem", "request_problem_reference", "describe_problem",
    "record_report", "record_report_reference", "count_step", "count_step_reference",
    "record_reset", "record_reset_reference", "count_reset", "count_reset_reference",
    "record_heard", "record_heard_reference", "record_answer", "record_answer_reference",
    "log_event", "log_event_reference", "fill_reply", "fill_reply_reference",
    "esync_step", "esync_step_reference", "esync_new_round", "esync_new_round_reference",
    "ebsp_decide", "ebsp_decide_reference", "ebsp_step", "ebsp_step_reference",
    "ebsp_new_superstep", "ebsp_new_superstep_reference", "esync_capability_test",
    "esync_capability_test_reference", "fast_hands_over", "fast_hands_over_reference",
    "fast_decision", "fast_decision_reference", "next_report_due", "round_pulled",
    "HOLD", "EBSP_MONITOR_REPORTS", "FAST_BASE", "FAST_EBSP", "FAST_ESYNC", "FAST_KINDS",
]

# The policy families the compiled loop serves (a registry entry names one): ``FAST_BASE``
# answers every step SYNC (decisions made at push/pull or importance time), ``FAST_EBSP``
# answers from the barrier already planned, ``FAST_ESYNC`` runs ESync's QUERY-STATE.
FAST_BASE, FAST_EBSP, FAST_ESYNC = 0, 1, 2
# The registry's names for them (``mpsync.policies.FAST_PATH_KINDS``).
FAST_KINDS = {"tables": FAST_BASE, "planned": FAST_EBSP, "query_state": FAST_ESYNC}

# "pull": a PS pull answered (value: the worker's pushes so far); "held": a PS pull held back
# by the staleness rule (same value).  Together they show which iterations ran without waiting.
EVENT_KINDS = ("register", "report", "sync", "reset", "push", "shutdown", "removed", "pull",
               "held", "resume")
K_REPORT = EVENT_KINDS.index("report")
K_SYNC = EVENT_KINDS.index("sync")
K_RESET = EVENT_KINDS.index("reset")
K_PUSH = EVENT_KINDS.index("push")
K_PULL = EVENT_KINDS.index("pull")

_MAX = float(W.MAX_ITER)
_TIME_SLOTS = (W.COMPUTE, W.AGG, W.WAIT)
_INTEGER_SLOTS = (W.SEQ, W.ITER, W.ROUND, W.COUNT, W.FLAG)
_SLOT_NAMES = {W.SEQ: "sequence number", W.ITER: "iteration", W.ROUND: "round",
               W.COUNT: "count", W.FLAG: "flag"}


class Tables(NamedTuple):
    """What the server knows of each worker (one cell per worker), on its own clock."""
    iteration: np.ndarray    # int64: last reported local iteration
    last_event: np.ndarray   # float64: last report, reset or release (NaN before the first)
    interval: np.ndarray     # float64: event-to-report interval (NaN until known)
    compute: np.ndarray      # float64: last compute time, as the worker measured it
    round: np.ndarray        # int64: aggregation round the worker is in
    removed: np.ndarray      # bool: taken out for silence
    last_heard: np.ndarray   # float64: receipt time of its last message
    waiting: np.ndarray      # bool: its reply is held by the server
    in_sync: np.ndarray      # bool: told SYNC, no reset yet


class Counters(NamedTuple):
    """Per-worker totals for the stats."""
    steps: np.ndarray          # int64
    syncs: np.ndarray          # int64
    locals: np.ndarray         # int64
    rounds: np.ndarray         # int64
    compute_s: np.ndarray      # float64
    wait_server_s: np.ndarray  # float64: as reported by the worker (its latest figure)
    aggregation_s: np.ndarray  # float64


class Events(NamedTuple):
    """(time since server start, worker, kind, value) rows in a ring; ``count``: one cell,
    events written so far (the newest ``rows.shape[0]`` are kept)."""
    rows: np.ndarray    # float64 (capacity, 4)
    count: np.ndarray   # int64 (1,)


class ESyncTables(NamedTuple):
    """ESync Alg. 2's record table (``sched.esync`` module doc) plus the query round trip of
    §4.2 and a log of READY decisions ``(worker, local iterations)`` the policy drains."""
    k: np.ndarray            # int64
    capability: np.ndarray   # float64
    last_finish: np.ndarray  # float64
    ready: np.ndarray        # bool
    rounds: np.ndarray       # int64
    rtt: np.ndarray          # float64
    ready_log: np.ndarray    # int64 (capacity, 2)
    ready_count: np.ndarray  # int64 (1,)


class EBSPTables(NamedTuple):
    """ElasticBSP's per-worker superstep state."""
    target: np.ndarray          # int64: iteration of the worker's next barrier (-1: none yet)
    reports: np.ndarray         # int64: reports since its last barrier (the monitoring phase)
    barrier_pushed: np.ndarray  # bool: PS: its push at the barrier is in


def new_tables(n: int) -> Tables:
    return Tables(np.zeros(n, np.int64), np.full(n, np.nan), np.full(n, np.nan), np.zeros(n),
                  np.zeros(n, np.int64), np.zeros(n, np.bool_), np.zeros(n),
                  np.zeros(n, np.bool_), np.zeros(n, np.bool_))


def new_counters(n: int) -> Counters:
    return Counters(*(np.zeros(n, np.int64) for _ in range(4)),
                    *(np.zeros(n) for _ in range(3)))


def new_events(capacity: int) -> Events:
    # Filled now (not left to lazy zero pages) so the log's memory is paid at start.
    return Events(np.full((capacity, 4), -1.0), np.zeros(1, np.int64))


def new_esync_tables(n: int, log_capacity: int = 1024) -> ESyncTables:
    return ESyncTables(np.zeros(n, np.int64), np.zeros(n), np.zeros(n), np.zeros(n, np.bool_),
                       np.zeros(n, np.int64), np.zeros(n), np.zeros((log_capacity, 2), np.int64),
                       np.zeros(1, np.int64))


def new_ebsp_tables(n: int) -> EBSPTables:
    return EBSPTables(np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n, np.bool_))


# -- the request check ---------------------------------------------------------------------------
# A request is well-formed when every slot is finite, SEQ, ITER, ROUND, COUNT and FLAG are
# integers in [0, 2**53) (exact in float64), and COMPUTE, AGG and WAIT are >= 0.  The answer
# is a number so the compiled loop can use it: 0 well-formed, 1 + the first bad slot otherwise
# (NaN/inf anywhere counts as the first non-finite slot).

@jit
def request_problem(msg):
    for i in range(W.MSG_LEN):
        if not math.isfinite(msg[i]):
            return 1 + i
    for i in _INTEGER_SLOTS:
        v = msg[i]
        if not (0.0 <= v < _MAX) or v != math.floor(v):
            return 1 + i
    for i in _TIME_SLOTS:
        if msg[i] < 0.0:
            return 1 + i
    return 0


def request_problem_reference(msg) -> int:
    values = [float(v) for v in msg]
    for i, v in enumerate(values):
        if math.isnan(v) or math.isinf(v):
            return 1 + i
    for i in _INTEGER_SLOTS:
        if not 0 <= values[i] < W.MAX_ITER or values[i] != int(values[i]):
            return 1 + i
    for i in _TIME_SLOTS:
        if values[i] < 0:
            return 1 + i
    return 0


def describe_problem(msg) -> str | None:
    """Why a request is refused, in words, or None if it is well-formed."""
    code = request_problem_reference(msg)
    if code == 0:
        return None
    slot, v = code - 1, float(msg[code - 1])
    if not math.isfinite(v):
        return "NaN or inf in the message"
    if slot in _SLOT_NAMES:
        return f"{_SLOT_NAMES[slot]} {v!r} is not an integer in [0, 2**53)"
    return "negative time"


# -- recording -------------------------------------------------------------------------------

@jit
def record_report(tables, w, k, compute, now):
    """Worker ``w`` reports local iteration ``k`` (``compute`` seconds, its own measure) at
    ``now``: the time since its previous event is one iteration interval, and never less than
    the compute the worker measured within it.  A shorter one is a report that came early: an
    idle step's (a worker waiting in a collective of the script's own steps every 1-50 ms and
    reports its usual compute), or one whose previous receipt the server's sleep delayed.
    ZipLine predicts each worker's next pushes from this interval (``ElasticBSP``): a 4x
    straggler's idle steps 55 ms apart read as the fastest worker, and the barrier planned 13
    more of its 0.4 s iterations, a 5 s wait for the others (``bench/auto/README.md``)."""
    last = tables.last_event[w]
    if last == last:   # not NaN: an earlier event opened this interval
        tables.interval[w] = max(now - last, compute)
    tables.last_event[w] = now
    tables.iteration[w] = k
    tables.compute[w] = compute


def record_report_reference(tables, w, k, compute, now):
    if not math.isnan(tables.last_event[w]):
        tables.interval[w] = max(now - tables.last_event[w], compute)
    tables.last_event[w] = now
    tables.iteration[w] = k
    tables.compute[w] = compute


@jit
def count_step(counters, w, compute, wait):
    counters.steps[w] += 1
    counters.compute_s[w] += compute
    counters.wait_server_s[w] = wait


def count_step_reference(counters, w, compute, wait):
    counters.steps[w] = counters.steps[w] + 1
    counters.compute_s[w] = counters.compute_s[w] + compute
    counters.wait_server_s[w] = wait


@jit
def record_reset(tables, w, round_, now):
    """``w`` finished an aggregation and is in round ``round_``; its next iteration starts
    now."""
    tables.in_sync[w] = False
    tables.round[w] = round_
    tables.last_event[w] = now


def record_reset_reference(tables, w, round_, now):
    tables.in_sync[w] = False
    tables.round[w] = round_
    tables.last_event[w] = now


@jit
def count_reset(counters, w, aggregation):
    counters.rounds[w] += 1
    counters.aggregation_s[w] += aggregation


def count_reset_reference(counters, w, aggregation):
    counters.rounds[w] = counters.rounds[w] + 1
    counters.aggregation_s[w] = counters.aggregation_s[w] + aggregation


@jit
def record_heard(tables, w, now):
    """A well-formed message from ``w`` arrived at ``now``: it is alive and, whatever it
    waited for, it is not waiting for the server any more."""
    tables.last_heard[w] = now
    tables.waiting[w] = False


def record_heard_reference(tables, w, now):
    tables.last_heard[w] = now
    tables.waiting[w] = False


@jit
def log_event(events, t, w, kind, value):
    i = events.count[0] % events.rows.shape[0]
    events.rows[i, 0] = t
    events.rows[i, 1] = w
    events.rows[i, 2] = kind
    events.rows[i, 3] = value
    events.count[0] += 1


def log_event_reference(events, t, w, kind, value):
    events.rows[events.count[0] % len(events.rows)] = (t, w, kind, value)
    events.count[0] = events.count[0] + 1


@jit
def record_answer(tables, counters, events, w, action, t):
    """A step of ``w`` is answered ``action`` at ``t`` (seconds since the server started):
    a SYNC puts it in the aggregation until its reset."""
    if action == W.SYNC:
        tables.in_sync[w] = True
        counters.syncs[w] += 1
        log_event(events, t, w, K_SYNC, tables.iteration[w])
    else:
        counters.locals[w] += 1


def record_answer_reference(tables, counters, events, w, action, t):
    if action == W.SYNC:
        tables.in_sync[w] = True
        counters.syncs[w] = counters.syncs[w] + 1
        log_event_reference(events, t, w, K_SYNC, tables.iteration[w])
    else:
        counters.locals[w] = counters.locals[w] + 1


@jit
def fill_reply(reply, action, local_iters, round_, seq, extra, count, version):
    reply[W.R_ACTION] = action
    reply[W.R_LOCAL] = local_iters
    reply[W.R_ROUND] = round_
    reply[W.R_SEQ] = seq
    reply[W.R_EXTRA] = extra
    reply[W.R_COUNT] = count
    reply[W.R_VERSION] = version


def fill_reply_reference(reply, action, local_iters, round_, seq, extra, count, version):
    for slot, value in ((W.R_ACTION, action), (W.R_LOCAL, local_iters), (W.R_ROUND, round_),
                        (W.R_SEQ, seq), (W.R_EXTRA, extra), (W.R_COUNT, count),
                        (W.R_VERSION, version)):
        reply[slot] = value


# -- BSP on the parameter server -----------------------------------------------------------------

@jit
def round_pulled(lowest_round, round_w):
    """BSP on the PS: may a step of a worker in round ``round_w`` be answered SYNC?  Only once
    every worker still pushing has pulled the round before (its reset, sent after the pull, is
    in): the lowest round among them, ``lowest_round``, has reached ``round_w``.  The policy
    (``BSP.decide_held``) and the simulator's PS engine both ask this."""
    return lowest_round >= round_w


# -- handing over to the Python loop ------------------------------------------------------------

@jit
def fast_hands_over(kind, tag, k, epoch, eb, w):
    """True: the compiled loop hands this STEP or RESET to the Python loop.  ElasticBSP's
    resets and the monitoring reports that may complete the monitoring phase (either may
    plan, ZipLine; a worker's further reports while the others are still monitored cannot,
    and are answered here); ESync's capability test (k = 0, whose reply may be held)."""
    if kind == FAST_EBSP:
        return tag == W.RESET or epoch < 0 or (eb.target[w] < 0 and
                                               eb.reports[w] < EBSP_MONITOR_REPORTS)
    if kind == FAST_ESYNC:
        return tag == W.STEP and k == 0
    return False


def fast_hands_over_reference(kind, tag, k, epoch, eb, w):
    if kind == FAST_EBSP:
        return tag == W.RESET or epoch < 0 or (int(eb.target[w]) < 0 and
                                               int(eb.reports[w]) < EBSP_MONITOR_REPORTS)
    return kind == FAST_ESYNC and tag == W.STEP and k == 0


# -- the compiled loop's decision, by family -----------------------------------------------------

@jit
def fast_decision(kind, es, eb, members, w, k, compute, now, eps, delayed, rtt):
    """``(action, local_iters)`` for a step of ``w`` under policy family ``kind``
    (``FAST_*``): what the policy objects answer through the same rules (``ESync.on_step``,
    ``ElasticBSP.on_step`` with plans under way, ``Policy.on_step``)."""
    if kind == FAST_ESYNC:
        return esync_step(es, members, w, compute, now, eps, delayed, rtt), 0
    if kind == FAST_EBSP:
        return ebsp_step(eb, w, k)
    return W.SYNC, 0


def fast_decision_reference(kind, es, eb, members, w, k, compute, now, eps, delayed, rtt):
    if kind == FAST_ESYNC:
        return esync_step_reference(es, members, w, compute, now, eps, delayed, rtt), 0
    if kind == FAST_EBSP:
        return ebsp_step_reference(eb, w, k)
    return W.SYNC, 0


# -- when the next report is due (the dedicated server's wake-up) --------------------------------

def next_report_due(tables: Tables, gone: np.ndarray) -> float | None:
    """When the next report is expected, on the server clock, or None: the earliest, over the
    workers that are computing (not told SYNC, not waiting for the server, not ``gone``), of
    their last event (report, reset or release) plus their last compute time as they measured
    it, or, if they report none, their last interval.  Iteration times repeat closely in
    data-parallel training (the premise of the ZipLine paper's lookahead, §4).  The worker's
    own compute time, not the interval between two receipts, because a receipt is late by
    however long the server slept: an interval would carry that delay into the next
    prediction, and the next, and the server would wake up later each time."""
    computing = ~(gone | tables.in_sync | tables.waiting)
    if not computing.any():
        return None
    compute = tables.compute[computing]
    due = tables.last_event[computing] + np.where(compute > 0, compute,
                                                  tables.interval[computing])
    due = due[~np.isnan(due)]
    return float(due.min()) if due.size else None
