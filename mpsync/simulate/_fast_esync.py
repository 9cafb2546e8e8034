"""ESync on the ring at scale: the exact engine's events, compiled, deciding with the server's
own rules.

A Numba event loop with the event kinds, order and tie-breaking of the exact engine
(``_events``: server messages before worker events at equal times, then scheduling order;
the events in ``_queue``'s FIFOs and heap), in which every decision is the state server's:
the capability test of Alg. 1 lines 3-8 (``rules.esync_capability_test``: held until every
capability is known), Alg. 2 QUERY-STATE for every other report (``rules.esync_step``) and
RESET-STATE-SERVER at each reset (``rules.esync_new_round``), on the tables
``rules.new_esync_tables`` makes.

The server's step rule scans every worker twice per report (is anyone a round behind? which
device is slowest?): 4,096 workers x 10,000 iterations were 270 s of such scans.  Here the
lowest round is kept as a histogram and the slowest device in a tournament tree (``_index``),
and ``_step`` asks the rule's own decision, ``sched.esync_ready_given_slowest``, with them;
what ``rules.esync_step`` writes around it (the record of Alg. 2 line 3, READY's mark and log)
is written here the same way.  ``tests/test_simulate_index.py`` drives ``_step``,
``_capability_test`` and ``_new_round`` and the server's rules with the same seeded random and
adversarial reports (ties of capability, workers a round behind) and requires the same answers
and tables after every one.  With constant speeds the engine reproduces the exact engine event
for event; with jitter the draws come from Numba's generator (the same distribution, another
order).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpsync import sched
from mpsync.sched._numba import jit
from mpsync.server import rules
from mpsync.server.wire import LOCAL, SYNC
from mpsync.simulate._fast_ps import Speed, _iteration_time
from mpsync.simulate._index import count_up, new_argmax_tree, new_counts, tree_set, tree_top
from mpsync.simulate._queue import HEAP_KIND, new_queue, pop, push

__all__ = ["run_esync", "ESyncIndex", "new_index"]

# the exact engine's event kinds (``_events``), in its order
_SRV_STEP, _SRV_RESET, _DONE, _REPLY, _AGG_DONE = 0, 1, HEAP_KIND, 5, 6


class ESyncRun(NamedTuple):
    """ε (``esync_slack``), the query round trip, one collective's cost, when to stop
    (``total_target`` iterations or the virtual time ``duration``; 0: not given), the seed."""
    eps: float
    query: float
    ring_s: float
    total_target: int
    duration: float
    seed: int


class ESyncOut(NamedTuple):
    """Per worker: seconds per phase (compute, wait, aggregate), iterations, rounds; the
    histogram of local iterations per round; ``totals`` = [t_end]."""
    time: np.ndarray
    iters: np.ndarray
    rounds: np.ndarray
    local_hist: np.ndarray
    totals: np.ndarray


class ESyncIndex(NamedTuple):
    """Over ``rules.ESyncTables`` of all workers: the tournament tree of the capabilities
    (the slowest device), the histogram of rounds with ``bounds`` = [lowest, highest round,
    capabilities known (> 0)]."""
    tree: np.ndarray
    round_count: np.ndarray
    bounds: np.ndarray


def new_index(es) -> ESyncIndex:
    """The index of the tables ``es`` (every worker a member, all in round 0)."""
    n = es.k.shape[0]
    if np.any(es.rounds != 0):
        raise ValueError("the index starts from tables in round 0")
    return ESyncIndex(new_argmax_tree(es.capability), new_counts(n),
                      np.array([0, 0, int(np.sum(es.capability > 0.0))], np.int64))


@jit(refcount=False)
def _record(es, ix, w, k, c, now):
    """Alg. 2 line 3 (and Alg. 1's capability test): w's record is (k, c, t_e = now)."""
    if (es.capability[w] > 0.0) != (c > 0.0):
        ix.bounds[2] += 1 if c > 0.0 else -1
    es.k[w] = k
    es.last_finish[w] = now
    if es.capability[w] != c:   # with steady speeds mostly the same: the tree stands
        es.capability[w] = c
        tree_set(ix.tree, es.capability, w)


@jit(refcount=False)
def _step(es, ix, w, compute, now, eps):
    """``rules.esync_step`` over every worker (not in delayed-ACK mode), with the lowest round
    and the slowest device from the index."""
    _record(es, ix, w, es.k[w] + 1, compute, now)
    if ix.bounds[0] < es.rounds[w]:
        return LOCAL        # a device has not pulled the last round yet (Alg. 2 line 5)
    if not sched.esync_ready_given_slowest(es.k, es.capability, es.last_finish, es.ready,
                                           es.rounds, w, tree_top(ix.tree), now, eps):
        return LOCAL
    es.ready[w] = True
    i = es.ready_count[0]
    if i < es.ready_log.shape[0]:
        es.ready_log[i, 0] = w
        es.ready_log[i, 1] = es.k[w]
        es.ready_count[0] = i + 1
    return SYNC


@jit(refcount=False)
def _capability_test(es, ix, w, c, now):
    """``rules.esync_capability_test`` over every worker: HOLD until every capability is
    known."""
    _record(es, ix, w, 0, c, now)
    return LOCAL if ix.bounds[2] == es.k.shape[0] else rules.HOLD


@jit(refcount=False)
def _new_round(es, ix, w, now):
    """``rules.esync_new_round`` (itself), with w's round moved in the index."""
    old = es.rounds[w]
    rules.esync_new_round(es, w, now)
    _, lo, hi, _ = count_up(ix.round_count, old, ix.bounds[0], ix.bounds[1])
    ix.bounds[0] = lo
    ix.bounds[1] = hi


class _State(NamedTuple):
    """The workers' side and the counters, per worker unless said: iterations done, since the
    last round, last compute; capability test still to run; the pending step's k and compute;
    the last reply; the open phase and its start; the held steps, the workers in the
    collective; ``count`` = [held, entered, messages, syncs, locals, collectives, iterations],
    ``enter_max`` = [the last entry into the collective]."""
    k: np.ndarray
    since_round: np.ndarray
    last_c: np.ndarray
    captest: np.ndarray
    step_k: np.ndarray
    step_c: np.ndarray
    action: np.ndarray
    phase_of: np.ndarray
    since: np.ndarray
    held: np.ndarray
    entered: np.ndarray
    count: np.ndarray
    enter_max: np.ndarray


_HELD, _ENTERED, _MESSAGES, _SYNCS, _LOCALS, _COLLECTIVES, _TOTAL = range(7)


def _new_state(n):
    return _State(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n),
                  np.ones(n, np.bool_), np.zeros(n, np.int64), np.zeros(n),
                  np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n),
                  np.empty(n, np.int64), np.empty(n, np.int64), np.zeros(7, np.int64),
                  np.zeros(1))


@jit(refcount=False)
def _phase(st, res, w, p, t):
    res.time[w, st.phase_of[w]] += t - st.since[w]
    st.phase_of[w] = p
    st.since[w] = t


@jit(refcount=False)
def _start(st, res, w, t, speed, q):
    c = _iteration_time(speed, w, t)
    st.last_c[w] = c
    _phase(st, res, w, 0, t)
    push(q, _DONE, t + c, w)


@jit(refcount=False)
def _on_done(st, res, w, t, half, q):
    """An iteration ended: the report goes out (Alg. 1 line 3: the first is the capability
    test, k = 0)."""
    st.k[w] += 1
    res.iters[w] += 1
    st.since_round[w] += 1
    st.count[_TOTAL] += 1
    _phase(st, res, w, 1, t)
    st.step_k[w] = 0 if st.captest[w] else st.k[w]
    st.step_c[w] = st.last_c[w]
    push(q, _SRV_STEP, t + half, w)


@jit(refcount=False)
def _on_step(st, es, ix, w, t, run, q):
    """The server's answer to a report, by the server's rules (held: HOLD)."""
    st.count[_MESSAGES] += 1
    if st.step_k[w] == 0:
        d = _capability_test(es, ix, w, st.step_c[w], t)
    else:
        d = _step(es, ix, w, st.step_c[w], t, run.eps)
    if d == rules.HOLD:
        st.held[st.count[_HELD]] = w
        st.count[_HELD] += 1
    else:
        st.count[_SYNCS] += d == SYNC
        st.action[w] = d
        push(q, _REPLY, t + run.query / 2.0, w)


@jit(refcount=False)
def _on_reply(st, res, w, t, run, speed, q):
    """A reply reached the worker: the test's (report the same iteration as k = 1), LOCAL (the
    next iteration) or SYNC (into the collective, which runs once everyone is in)."""
    n = st.k.shape[0]
    if st.captest[w]:
        st.captest[w] = False
        st.step_k[w] = st.k[w]
        push(q, _SRV_STEP, t + run.query / 2.0, w)
    elif st.action[w] != SYNC:
        st.count[_LOCALS] += 1
        _start(st, res, w, t, speed, q)
    else:
        _phase(st, res, w, 2, t)
        st.entered[st.count[_ENTERED]] = w
        st.count[_ENTERED] += 1
        st.enter_max[0] = max(st.enter_max[0], t)
        if st.count[_ENTERED] == n:
            st.count[_COLLECTIVES] += 1
            for i in range(n):
                push(q, _AGG_DONE, st.enter_max[0] + run.ring_s, st.entered[i])
            st.count[_ENTERED] = 0
            st.enter_max[0] = 0.0


@jit(refcount=False)
def _on_aggregated(st, res, w, t, half, speed, q):
    """The collective ended: the reset goes out and the next iteration starts."""
    res.rounds[w] += 1
    push(q, _SRV_RESET, t + half, w)
    _start(st, res, w, t, speed, q)
    res.local_hist[min(st.since_round[w], res.local_hist.shape[0] - 1)] += 1
    st.since_round[w] = 0


@jit(refcount=False)
def _retry_held(st, es, ix, t, half, q):
    """After each server message the held capability tests are decided again (each retry
    records the test again at ``t``, as the server's ``decide_held`` does)."""
    keep = 0
    for i in range(st.count[_HELD]):
        v = st.held[i]
        d = _capability_test(es, ix, v, es.capability[v], t)
        if d == rules.HOLD:
            st.held[keep] = v
            keep += 1
        else:
            st.action[v] = d
            push(q, _REPLY, t + half, v)
    st.count[_HELD] = keep


@jit(refcount=False)
def _loop(run, speed, es, ix, st, res, q):
    np.random.seed(run.seed)
    n = speed.base.shape[0]
    half = run.query / 2.0
    for w in range(n):
        _start(st, res, w, 0.0, speed, q)
    t_end = 0.0
    while True:
        t, ev, w = pop(q)
        if ev < 0:
            break
        if run.duration > 0.0 and t > run.duration:
            t_end = run.duration
            break
        t_end = t
        if ev == _DONE:
            _on_done(st, res, w, t, half, q)
            if run.total_target > 0 and st.count[_TOTAL] >= run.total_target:
                break
            continue
        if ev == _SRV_STEP:
            _on_step(st, es, ix, w, t, run, q)
        elif ev == _SRV_RESET:
            st.count[_MESSAGES] += 1
            _new_round(es, ix, w, t)
        elif ev == _REPLY:
            _on_reply(st, res, w, t, run, speed, q)
        elif ev == _AGG_DONE:
            _on_aggregated(st, res, w, t, half, speed, q)
        # The server decides every held capability test again after each message; until the
        # last capability is known each answer is HOLD again, and the record it rewrites
        # (t_e = now) is written once more at the release, before anyone reads it.
        if st.count[_HELD] > 0 and ev <= _SRV_RESET and ix.bounds[2] == n:
            _retry_held(st, es, ix, t, half, q)
    for w in range(n):
        _phase(st, res, w, st.phase_of[w], t_end)
    res.totals[0] = t_end


def run_esync(config, speeds, cost, rec, *, iterations=None, duration=None):
    """Fill the recorder ``rec`` with a simulated run of ESync on the ring."""
    n = speeds.n
    if speeds.schedule:
        sched_t = np.array([t for t, _ in speeds.schedule])
        sched_f = np.array([f for _, f in speeds.schedule])
    else:
        sched_t, sched_f = np.zeros(0), np.zeros((0, n))
    run = ESyncRun(eps=float(config.esync_slack), query=float(cost.query),
                   ring_s=float(cost.ring(n, 1.0)),
                   total_target=0 if iterations is None else n * iterations,
                   duration=0.0 if duration is None else float(duration), seed=int(speeds.seed))
    res = ESyncOut(time=np.zeros((n, 4)), iters=np.zeros(n, np.int64),
                   rounds=np.zeros(n, np.int64), local_hist=np.zeros(1 << 12, np.int64),
                   totals=np.zeros(1))
    st = _new_state(n)
    es = rules.new_esync_tables(n, 1)
    _loop(run, Speed(speeds.base, sched_t, sched_f, float(speeds.jitter)), es, new_index(es),
          st, res, new_queue(n))
    rec.time[:] = res.time
    rec.iters[:] = res.iters
    rec.total_iterations = int(res.iters.sum())
    rec.rounds[:] = res.rounds
    top = int(np.flatnonzero(res.local_hist).max(initial=0))
    rec.local_hist = res.local_hist[:max(top + 1, 2)].copy()
    rec.sim_time, rec.messages = float(res.totals[0]), int(st.count[_MESSAGES])
    rec.syncs, rec.locals, rec.collectives = (int(st.count[i])
                                              for i in (_SYNCS, _LOCALS, _COLLECTIVES))
    rec.agg_cost_s = cost.ring(n, 1.0) * n * rec.collectives
    rec.phase_since[:] = rec.sim_time
    return rec
