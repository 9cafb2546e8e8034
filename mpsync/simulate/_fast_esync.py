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
    histogram of local iterations per round; ``totals`` = [t_end, messages, syncs, locals,
    collectives]."""
    time: np.ndarray
    iters: np.ndarray
    rounds: np.ndarray
    local_hist: np.ndarray
    totals: np.ndarray


@jit(inline=True)
def _phase(time_, phase_of, since, w, p, t):
    time_[w, phase_of[w]] += t - since[w]
    phase_of[w] = p
    since[w] = t


@jit(inline=True)
def _start(w, t, speed, last_c, time_, phase_of, since, heap, seq):
    c = _iteration_time(speed, w, t)
    last_c[w] = c
    _phase(time_, phase_of, since, w, 0, t)
    _schedule(heap, seq, t + c, _DONE, w)


@jit
def _loop(run, speed, es, res):
    np.random.seed(run.seed)
    n = speed.base.shape[0]
    half = run.query / 2.0
    members = np.arange(n)
    k = np.zeros(n, np.int64)
    since_round = np.zeros(n, np.int64)
    last_c = np.zeros(n)
    captest = np.ones(n, np.bool_)
    step_k = np.zeros(n, np.int64)
    step_c = np.zeros(n)
    action = np.zeros(n, np.int64)
    phase_of = np.zeros(n, np.int64)
    since = np.zeros(n)
    held = np.empty(n, np.int64)
    n_held = 0
    entered = np.empty(n, np.int64)
    n_entered = 0
    enter_max = 0.0
    messages, syncs, locals_, collectives, total = 0, 0, 0, 0, 0
    heap = [(0.0, np.int64(0))]
    heap.pop()
    seq = np.zeros(1, np.int64)
    for w in range(n):
        _start(w, 0.0, speed, last_c, res.time, phase_of, since, heap, seq)
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
            k[w] += 1
            res.iters[w] += 1
            since_round[w] += 1
            total += 1
            _phase(res.time, phase_of, since, w, 1, t)
            # Alg. 1 line 3: the first iteration is the capability test, reported as k = 0
            step_k[w] = 0 if captest[w] else k[w]
            step_c[w] = last_c[w]
            _schedule(heap, seq, t + half, _SRV_STEP, w)
            if run.total_target > 0 and total >= run.total_target:
                break
            continue
        if ev == _SRV_STEP:
            messages += 1
            if step_k[w] == 0:
                d = rules.esync_capability_test(es, members, w, step_c[w], t)
            else:
                d = rules.esync_step(es, members, w, step_c[w], t, run.eps, False, 0.0)
            if d == rules.HOLD:
                held[n_held] = w
                n_held += 1
            else:
                syncs += d == SYNC
                action[w] = d
                _schedule(heap, seq, t + half, _REPLY, w)
        elif ev == _SRV_RESET:
            messages += 1
            rules.esync_new_round(es, w, t)
        elif ev == _REPLY:
            if captest[w]:
                # the test's reply: the same iteration is reported again as the first local one
                captest[w] = False
                step_k[w] = k[w]
                _schedule(heap, seq, t + half, _SRV_STEP, w)
            elif action[w] != SYNC:
                locals_ += 1
                _start(w, t, speed, last_c, res.time, phase_of, since, heap, seq)
            else:
                _phase(res.time, phase_of, since, w, 2, t)
                entered[n_entered] = w
                n_entered += 1
                enter_max = max(enter_max, t)
                if n_entered == n:
                    collectives += 1
                    for i in range(n):
                        _schedule(heap, seq, enter_max + run.ring_s, _AGG_DONE, entered[i])
                    n_entered = 0
                    enter_max = 0.0
        elif ev == _AGG_DONE:
            res.rounds[w] += 1
            _schedule(heap, seq, t + half, _SRV_RESET, w)
            _start(w, t, speed, last_c, res.time, phase_of, since, heap, seq)
            res.local_hist[min(since_round[w], res.local_hist.shape[0] - 1)] += 1
            since_round[w] = 0
        if n_held > 0 and ev <= _SRV_RESET:
            # after each server message the held capability tests are decided again
            keep = 0
            for i in range(n_held):
                v = held[i]
                d = rules.esync_capability_test(es, members, v, es.capability[v], t)
                if d == rules.HOLD:
                    held[keep] = v
                    keep += 1
                else:
                    action[v] = d
                    _schedule(heap, seq, t + half, _REPLY, v)
            n_held = keep
    for w in range(n):
        _phase(res.time, phase_of, since, w, phase_of[w], t_end)
    res.totals[0] = t_end
    res.totals[1] = messages
    res.totals[2] = syncs
    res.totals[3] = locals_
    res.totals[4] = collectives


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
                   totals=np.zeros(5))
    _loop(run, Speed(speeds.base, sched_t, sched_f, float(speeds.jitter)),
          rules.new_esync_tables(n, 1), res)
    rec.time[:] = res.time
    rec.iters[:] = res.iters
    rec.total_iterations = int(res.iters.sum())
    rec.rounds[:] = res.rounds
    top = int(np.flatnonzero(res.local_hist).max(initial=0))
    rec.local_hist = res.local_hist[:max(top + 1, 2)].copy()
    rec.sim_time, rec.messages = float(res.totals[0]), int(res.totals[1])
    rec.syncs, rec.locals, rec.collectives = (int(x) for x in res.totals[2:5])
    rec.agg_cost_s = cost.ring(n, 1.0) * n * rec.collectives
    rec.phase_since[:] = rec.sim_time
    return rec
