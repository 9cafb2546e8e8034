"""ESync on the ring at scale: the exact engine's events, compiled, deciding with the server's
own rules.

A Numba event loop with the event kinds, order and tie-breaking of the exact engine
(``_events``: server messages before worker events at equal times, then scheduling order), in
which every decision is the state server's rule itself, called compiled:
``rules.esync_capability_test`` for the report of iteration 0 (ESync Alg. 1 lines 3-8: held
until every capability is known), ``rules.esync_step`` for every other report (Alg. 2
QUERY-STATE) and ``rules.esync_new_round`` at each reset (RESET-STATE-SERVER), on the tables
``rules.new_esync_tables`` makes, as ``server.step_policies.ESync`` calls them.  Nothing of
ESync is restated here: a change to those rules changes this engine with it.  With constant
speeds it reproduces the exact engine event for event; with jitter the draws come from Numba's
generator (the same distribution, another order).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from mpsync.sched._numba import jit
from mpsync.server import rules
from mpsync.server.wire import SYNC
from mpsync.simulate._fast_ps import Speed, _iteration_time, _schedule

__all__ = ["run_esync"]

# the exact engine's event kinds (``_events``), in its order
_SRV_STEP, _SRV_RESET, _DONE, _REPLY, _AGG_DONE = 0, 1, 4, 5, 6


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


@jit(inline=True)
def _phase(st, res, w, p, t):
    res.time[w, st.phase_of[w]] += t - st.since[w]
    st.phase_of[w] = p
    st.since[w] = t


@jit(inline=True)
def _start(st, res, w, t, speed, heap, seq):
    c = _iteration_time(speed, w, t)
    st.last_c[w] = c
    _phase(st, res, w, 0, t)
    _schedule(heap, seq, t + c, _DONE, w)


@jit(inline=True)
def _on_done(st, res, w, t, half, heap, seq):
    """An iteration ended: the report goes out (Alg. 1 line 3: the first is the capability
    test, k = 0)."""
    st.k[w] += 1
    res.iters[w] += 1
    st.since_round[w] += 1
    st.count[_TOTAL] += 1
    _phase(st, res, w, 1, t)
    st.step_k[w] = 0 if st.captest[w] else st.k[w]
    st.step_c[w] = st.last_c[w]
    _schedule(heap, seq, t + half, _SRV_STEP, w)


@jit(inline=True)
def _on_step(st, es, members, w, t, run, heap, seq):
    """The server's answer to a report, by the server's rules (held: HOLD)."""
    st.count[_MESSAGES] += 1
    if st.step_k[w] == 0:
        d = rules.esync_capability_test(es, members, w, st.step_c[w], t)
    else:
        d = rules.esync_step(es, members, w, st.step_c[w], t, run.eps, False, 0.0)
    if d == rules.HOLD:
        st.held[st.count[_HELD]] = w
        st.count[_HELD] += 1
    else:
        st.count[_SYNCS] += d == SYNC
        st.action[w] = d
        _schedule(heap, seq, t + run.query / 2.0, _REPLY, w)


@jit(inline=True)
def _on_reply(st, res, w, t, run, speed, heap, seq):
    """A reply reached the worker: the test's (report the same iteration as k = 1), LOCAL (the
    next iteration) or SYNC (into the collective, which runs once everyone is in)."""
    n = st.k.shape[0]
    if st.captest[w]:
        st.captest[w] = False
        st.step_k[w] = st.k[w]
        _schedule(heap, seq, t + run.query / 2.0, _SRV_STEP, w)
    elif st.action[w] != SYNC:
        st.count[_LOCALS] += 1
        _start(st, res, w, t, speed, heap, seq)
    else:
        _phase(st, res, w, 2, t)
        st.entered[st.count[_ENTERED]] = w
        st.count[_ENTERED] += 1
        st.enter_max[0] = max(st.enter_max[0], t)
        if st.count[_ENTERED] == n:
            st.count[_COLLECTIVES] += 1
            for i in range(n):
                _schedule(heap, seq, st.enter_max[0] + run.ring_s, _AGG_DONE, st.entered[i])
            st.count[_ENTERED] = 0
            st.enter_max[0] = 0.0


@jit(inline=True)
def _on_aggregated(st, res, w, t, half, speed, heap, seq):
    """The collective ended: the reset goes out and the next iteration starts."""
    res.rounds[w] += 1
    _schedule(heap, seq, t + half, _SRV_RESET, w)
    _start(st, res, w, t, speed, heap, seq)
    res.local_hist[min(st.since_round[w], res.local_hist.shape[0] - 1)] += 1
    st.since_round[w] = 0


@jit(inline=True)
def _retry_held(st, es, members, t, half, heap, seq):
    """After each server message the held capability tests are decided again."""
    keep = 0
    for i in range(st.count[_HELD]):
        v = st.held[i]
        d = rules.esync_capability_test(es, members, v, es.capability[v], t)
        if d == rules.HOLD:
            st.held[keep] = v
            keep += 1
        else:
            st.action[v] = d
            _schedule(heap, seq, t + half, _REPLY, v)
    st.count[_HELD] = keep


@jit
def _loop(run, speed, es, st, res):
    np.random.seed(run.seed)
    n = speed.base.shape[0]
    half = run.query / 2.0
    members = np.arange(n)
    heap = [(0.0, np.int64(0))]
    heap.pop()
    seq = np.zeros(1, np.int64)
    for w in range(n):
        _start(st, res, w, 0.0, speed, heap, seq)
    t_end = 0.0
    while len(heap) > 0:
        t, key = heapq.heappop(heap)
        ev = key >> 58
        w = key & 0xFFFFF
        if run.duration > 0.0 and t > run.duration:
            t_end = run.duration
            break
        t_end = t
        if ev == _DONE:
            _on_done(st, res, w, t, half, heap, seq)
            if run.total_target > 0 and st.count[_TOTAL] >= run.total_target:
                break
            continue
        if ev == _SRV_STEP:
            _on_step(st, es, members, w, t, run, heap, seq)
        elif ev == _SRV_RESET:
            st.count[_MESSAGES] += 1
            rules.esync_new_round(es, w, t)
        elif ev == _REPLY:
            _on_reply(st, res, w, t, run, speed, heap, seq)
        elif ev == _AGG_DONE:
            _on_aggregated(st, res, w, t, half, speed, heap, seq)
        if st.count[_HELD] > 0 and ev <= _SRV_RESET:
            _retry_held(st, es, members, t, half, heap, seq)
    for w in range(n):
        _phase(st, res, w, st.phase_of[w], t_end)
    res.totals[0] = t_end


def run_esync(config, speeds, cost, rec, *, iterations=None, duration=None):
    """Fill the recorder ``rec`` with a simulated run of ESync on the ring."""
    n = speeds.n
    if n > 1 << 20:
        raise ValueError(f"the ESync engine handles up to {1 << 20} workers, got {n}")
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
    _loop(run, Speed(speeds.base, sched_t, sched_f, float(speeds.jitter)),
          rules.new_esync_tables(n, 1), st, res)
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
