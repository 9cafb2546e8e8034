"""The parameter-server policies (asp, ssp, dssp, bsp on PS) at scale: one compiled event loop.

Same worker cycle as the event engine (compute; the step report, one round trip, answered SYNC
at once or, BSP, once every worker has pulled the round before; a push queued at the shard
servers, which receive and apply it; a pull, held by the staleness rule, queued at them too;
the next iteration starts when the weights are back, and the reset goes to the server), in
Numba, with the events in ``_queue``'s FIFOs and heap, so one event costs well under a
microsecond.  Every shard sees the same requests in the same order (a push or pull goes to all
of them at once), so one queue of a shard's service times stands for all of them
(``CostModel``).

Decisions are the server's own comparisons on minima kept incrementally (a histogram of
counts) instead of its O(n) scans: the staleness bound of SSP / BSP-on-PS is
``sched.within_staleness`` (what ``ssp_may_continue`` asks after its scan for the slowest);
BSP's step rule is ``rules.round_pulled`` (what ``BSP.decide_held`` asks) on the lowest round
the resets told the server.  DSSP: lines 3-9 of Alg. 1 (an extra iteration left, or within
s_L) are that same bound, line 11 (is p a fastest worker?) compares with the maximum, also kept
incrementally; a push of a fastest worker beyond s_L asks ``sched.dssp_on_push_given`` (what
``sched.dssp_on_push`` asks after its scans: the controller, Alg. 2, on the full table) with
line 7's slowest worker kept by ``_index.lowest_at_min`` and the allowance
``sched.dssp_allowance`` that ``server.policies.DSSP.on_push`` passes.  No decision scans the
workers, so a run costs O(log n) per event at any n (a scan per controller call made DSSP
quadratic in the workers: 371 CPU s at 65,536 x 1,000).  Tests drive these
helpers and the policy objects with the same random and adversarial pushes and require the
same decisions, and run both engines on the same seeded cases and require identical iteration
counts and times.

``_loop`` is the dispatch over the six event kinds; each step it takes is a small helper, and
the loop and its helpers are compiled without reference counting (``jit(refcount=False)``).
What it is told and what it fills are named tuples (:class:`PSRun`, :class:`Speed`,
:class:`PSOut`), which Numba passes as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpsync import policies, sched
from mpsync.server import rules
from mpsync.sched._numba import jit
from mpsync.simulate._index import (HistogramFull, count_up, lowest_at_min, new_counts,
                                    new_lowest_at_min)
from mpsync.simulate._queue import HEAP_KIND, new_queue, pop, push

__all__ = ["run_ps", "PSRun", "PSOut", "Speed"]

# ordered as the event engine orders simultaneous events (server messages first), ties
# then in scheduling order (a sequence number), so both engines agree event for event
_STEP, _RESET, _PUSHED, _PULL, _DONE, _REPLIED = 0, 1, 2, 3, HEAP_KIND, 5
ASP, SSP, DSSP, BSP = 0, 1, 2, 3
# the registry's simulation models on the PS -> the rules the loop applies
_KINDS = {"no_wait": ASP, "staleness": SSP, "in_step": BSP, "dynamic_staleness": DSSP}


class PSRun(NamedTuple):
    """What the compiled loop is told: the rule (``kind``: ASP, SSP or DSSP, with SSP's bound
    ``s`` and DSSP's [s_L, s_U]), the costs (query round trip; a shard's service of a push and
    of a pull; the worker's own link; ``shared``: transfers queue at the shards) and when to
    stop (``total_target`` iterations, or the virtual time ``duration``; 0: not given)."""
    kind: int
    s: int
    s_low: int
    s_high: int
    query: float
    push_s: float
    pull_s: float
    worker_link: float
    shared: bool
    total_target: int
    duration: float
    seed: int


class Speed(NamedTuple):
    """Iteration times as ``SpeedModel.time_of`` draws them: base per worker, the slowdown
    schedule (times, factors per worker) and the lognormal jitter."""
    base: np.ndarray
    sched_t: np.ndarray
    sched_f: np.ndarray
    jitter: float


class PSOut(NamedTuple):
    """What the loop fills: per worker seconds in compute / wait / aggregate, iterations and
    rounds; the staleness histogram; ``totals`` = [t_end, messages, pushes]."""
    time: np.ndarray
    iters: np.ndarray
    rounds: np.ndarray
    stale_hist: np.ndarray
    totals: np.ndarray


class _Work(NamedTuple):
    """The loop's own arrays, allocated before it runs (it is compiled without reference
    counting, so it allocates nothing): per worker push count, last two push times, DSSP's
    extra iterations and hold, the open phase and its start, when the last report and reset
    reach the server (no event stands for them), the round each reset told the server (BSP);
    the held pulls and steps; the histograms of push counts and of rounds; DSSP's slowest
    worker (``_index.new_lowest_at_min``)."""
    pushes: np.ndarray
    table: np.ndarray
    r_extra: np.ndarray
    dssp_held: np.ndarray
    start: np.ndarray
    phase: np.ndarray
    arrives: np.ndarray
    srv_round: np.ndarray
    held: np.ndarray
    steps: np.ndarray
    count: np.ndarray
    round_count: np.ndarray
    slowest: np.ndarray


def _new_work(n: int, capacity: int) -> _Work:
    return _Work(np.zeros(n, np.int64), np.zeros((n, 2)), np.zeros(n, np.int64),
                 np.zeros(n, np.bool_), np.zeros(n), np.zeros(n, np.int64),
                 np.full((n, 2), -np.inf), np.zeros(n, np.int64), np.empty(n, np.int64),
                 np.empty(n, np.int64), new_counts(n, capacity), new_counts(n, capacity),
                 new_lowest_at_min())


@jit(refcount=False)
def _iteration_time(speed, w, t):
    """One iteration of ``w`` starting at ``t`` (a :class:`Speed`)."""
    c = speed.base[w]
    for i in range(speed.sched_t.shape[0]):
        if t >= speed.sched_t[i]:
            c = speed.base[w] * speed.sched_f[i, w]
    if speed.jitter > 0.0:
        c *= np.exp(np.random.normal(-0.5 * speed.jitter * speed.jitter, speed.jitter))
    return c


@jit(refcount=False)
def _transfer(t, server_free, service, run):
    """A push or pull started at ``t`` that costs each shard ``service``: when it is done,
    and when the shards are free again (transfers queue at them when ``run.shared``, else each
    takes ``service`` on its own); never sooner than the worker's own link allows."""
    if run.shared:
        server_free = max(t, server_free) + service
        return max(server_free, t + run.worker_link), server_free
    return t + service, server_free


@jit(refcount=False)
def _book(book, w, t, next_phase):
    """``w``'s open phase (0 compute, 1 waiting for the server, 2 aggregating) ends at ``t``
    and ``next_phase`` begins."""
    start, phase, time_, _, _ = book
    time_[w, phase[w]] += t - start[w]
    start[w] = t
    phase[w] = next_phase


@jit(refcount=False)
def _record_push(w, t, pushes, table):
    """Count ``w``'s push at ``t`` and keep its last two push times (the table the DSSP
    controller reads); returns its push count before this one."""
    old = pushes[w]
    pushes[w] = old + 1
    table[w, 0] = table[w, 1] if old > 0 else t
    table[w, 1] = t
    return old


@jit(refcount=False)
def _dssp_push(w, pushes, lo, hi, r_extra, dssp_held, table, s_low, s_high, slowest):
    """DSSP at ``w``'s push (Alg. 1): will its next pull be held?  Lines 3-9 (an extra
    iteration left, or within s_L) in O(1); a fastest worker beyond s_L asks the controller
    (Alg. 2, through ``sched.dssp_on_push_given``) with r_max as
    ``server.policies.DSSP.on_push`` computes it and line 7's slowest worker from
    ``slowest`` (the state of ``_index.lowest_at_min``), amortized O(1)."""
    gap = pushes[w] - lo
    if r_extra[w] > 0:
        r_extra[w] -= 1
        dssp_held[w] = False
    elif sched.within_staleness(pushes[w], lo, s_low):
        dssp_held[w] = False
    elif pushes[w] < hi:
        dssp_held[w] = True     # not the fastest: line 11 fails, line 17 holds
    else:
        r_max = sched.dssp_allowance(gap, s_low, s_high)
        q = lowest_at_min(slowest, pushes, lo)
        ok, r_new = sched.dssp_on_push_given(pushes[w], lo, hi, r_extra[w], table, w, q,
                                             s_low, r_max)
        r_extra[w] = r_new
        dssp_held[w] = not ok


@jit(refcount=False)
def _may_pull(kind, pushes_w, lo, s, s_low, held_by_dssp):
    """The staleness rule at a pull request of a worker with ``pushes_w`` pushes, ``lo`` the
    slowest's."""
    if kind == ASP:
        return True
    if kind == SSP or kind == BSP:
        return sched.within_staleness(pushes_w, lo, s)
    return (not held_by_dssp) or sched.within_staleness(pushes_w, lo, s_low)


@jit(refcount=False)
def _resume(w, t, gap, server_free, run, book, stale_hist, q, speed):
    """The pull of ``w`` answered at ``t`` with staleness ``gap``: the weights come back from
    the shards, the reset goes to the server and the next iteration starts (its end is the
    next event); returns when the shards are free again.  ``book``: (start, phase, time_,
    rounds)."""
    start, phase, time_, rounds, arrives = book
    stale_hist[min(gap, stale_hist.shape[0] - 1)] += 1
    end, server_free = _transfer(t, server_free, run.pull_s, run)
    back = end + run.query / 2.0
    rounds[w] += 1
    time_[w, 2] += back - start[w]
    start[w] = back
    phase[w] = 0
    if run.kind == BSP:
        push(q, _RESET, back + run.query / 2.0, w)
    else:
        arrives[w, 1] = back + run.query / 2.0   # counted now: no rule reads it
    push(q, _DONE, back + _iteration_time(speed, w, back), w)
    return server_free


@jit(refcount=False)
def _release_held(held, n_held, bound, pushes, lo, dssp_held, t, server_free, run, book,
                  stale_hist, q, speed):
    """The minimum push count rose: answer every held pull now within ``bound`` of it (SSP's
    s, DSSP's s_L: a held DSSP pull waits for the slowest), in the order they were held;
    returns (how many are still held, when the shards are free again)."""
    keep = 0
    for i in range(n_held):
        v = held[i]
        gap = pushes[v] - lo
        if sched.within_staleness(pushes[v], lo, bound):
            dssp_held[v] = False
            server_free = _resume(v, t, gap, server_free, run, book, stale_hist, q,
                                  speed)
        else:
            held[keep] = v
            keep += 1
    return keep, server_free


@jit(refcount=False)
def _release_steps(steps, n_steps, srv_round, lo, t, half, q):
    """BSP on the PS: the last reset of a round is in, so every held step whose round every
    worker has now pulled is answered SYNC, in the order they were held; returns how many
    are still held."""
    keep = 0
    for i in range(n_steps):
        v = steps[i]
        if rules.round_pulled(lo, srv_round[v]):
            push(q, _REPLIED, t + half, v)
        else:
            steps[keep] = v
            keep += 1
    return keep


@jit(refcount=False)
def _close_phases(t_end, book):
    """Book each worker's open phase up to ``t_end``; weights still on the way back at
    ``t_end`` do not count as a round."""
    start, phase, time_, rounds, arrives = book
    for w in range(start.shape[0]):
        if start[w] > t_end:
            time_[w, 2] -= start[w] - t_end
            rounds[w] -= 1
        else:
            time_[w, phase[w]] += t_end - start[w]


@jit(refcount=False)
def _loop(run, speed, res, q, wk):
    """Fill ``res`` (a :class:`PSOut`) with the run ``run`` (a :class:`PSRun`) of workers
    ``speed`` (a :class:`Speed`), events in ``q`` (an ``EventQueue``), working in ``wk`` (a
    :class:`_Work` as ``_new_work`` makes it).  Per event: an
    iteration done (the step report goes out), the report at the server (answered SYNC, or
    held: BSP), the reply in (the push goes to the shards), the push at the server, the pull
    request (answered or held), the reset at the server."""
    np.random.seed(run.seed)
    n = speed.base.shape[0]
    half = run.query / 2.0
    pushes, table, r_extra, dssp_held = wk.pushes, wk.table, wk.r_extra, wk.dssp_held
    arrives, srv_round = wk.arrives, wk.srv_round
    book = (wk.start, wk.phase, res.time, res.rounds, arrives)
    count, round_count = wk.count, wk.round_count
    lo, hi = 0, 0                             # min(pushes), max(pushes)
    held, n_held = wk.held, 0                 # pulls held by the staleness rule
    round_lo, round_hi = 0, 0
    steps, n_steps = wk.steps, 0              # BSP: steps held until the round is pulled
    server_free = 0.0
    messages = 0
    total = 0
    for w in range(n):
        push(q, _DONE, _iteration_time(speed, w, 0.0), w)
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
            res.iters[w] += 1
            total += 1
            _book(book, w, t, 1)
            if run.kind == BSP:
                push(q, _STEP, t + half, w)
            else:
                # answered SYNC at once: the reply is in a round trip later (the sum the
                # event engine computes), the report counted now
                messages += 1
                arrives[w, 0] = t + half
                push(q, _REPLIED, (t + half) + half, w)
            if run.total_target > 0 and total >= run.total_target:
                break
        elif ev == _STEP:
            messages += 1
            if run.kind == BSP and not rules.round_pulled(round_lo, srv_round[w]):
                steps[n_steps] = w
                n_steps += 1
            else:
                push(q, _REPLIED, t + half, w)
        elif ev == _REPLIED:
            _book(book, w, t, 2)
            end, server_free = _transfer(t, server_free, run.push_s, run)
            push(q, _PUSHED, end, w)
        elif ev == _PUSHED:
            messages += 1
            old = _record_push(w, t, pushes, table)
            count, lo, hi, raised = count_up(count, old, lo, hi)
            if run.kind == DSSP:
                _dssp_push(w, pushes, lo, hi, r_extra, dssp_held, table, run.s_low, run.s_high,
                           wk.slowest)
            push(q, _PULL, t + run.query, w)
            if raised and n_held > 0:
                # the slowest moved on: held pulls may go now (the loop retries after a message)
                bound = run.s_low if run.kind == DSSP else run.s
                n_held, server_free = _release_held(held, n_held, bound, pushes, lo, dssp_held,
                                                    t, server_free, run, book, res.stale_hist,
                                                    q, speed)
        elif ev == _PULL:
            messages += 1
            gap = pushes[w] - lo
            if _may_pull(run.kind, pushes[w], lo, run.s, run.s_low, dssp_held[w]):
                dssp_held[w] = False
                server_free = _resume(w, t, gap, server_free, run, book, res.stale_hist, q,
                                      speed)
            else:
                held[n_held] = w
                n_held += 1
        else:   # _RESET
            messages += 1
            if run.kind == BSP:
                old = srv_round[w]
                srv_round[w] = old + 1
                round_count, round_lo, round_hi, raised = count_up(round_count, old,
                                                                      round_lo, round_hi)
                if raised and n_steps > 0:
                    n_steps = _release_steps(steps, n_steps, srv_round, round_lo, t, half, q)
    if run.kind != BSP:
        messages += res.rounds.sum()    # a reset per pull answered
    _close_phases(t_end, book)
    if run.kind != BSP:
        # reports and resets counted when sent that reach the server after the end; the
        # report of the iteration that reached the target is never handled
        for v in range(n):
            messages -= (arrives[v, 0] > t_end) + (arrives[v, 1] > t_end)
        if run.total_target > 0 and total >= run.total_target and arrives[w, 0] <= t_end:
            messages -= 1
    res.totals[0] = t_end
    res.totals[1] = messages
    res.totals[2] = pushes.sum()


def run_ps(config, speeds, cost, rec, *, iterations=None, duration=None):
    """Fill the recorder ``rec`` with a simulated run of asp / ssp / dssp / bsp on PS."""
    model = policies.get(config.policy).simulation_model("ps")
    kind = _KINDS[model]
    n = speeds.n
    if speeds.schedule:
        sched_t = np.array([t for t, _ in speeds.schedule])
        sched_f = np.array([f for _, f in speeds.schedule])
    else:
        sched_t, sched_f = np.zeros(0), np.zeros((0, n))
    run = PSRun(kind=kind, s=0 if model == "in_step" else int(config.staleness),
                s_low=int(config.staleness_low), s_high=int(config.staleness_high),
                query=float(cost.query), push_s=float(cost.push()), pull_s=float(cost.link()),
                worker_link=float(cost.worker_link()), shared=bool(cost.shared_link),
                total_target=0 if iterations is None else n * iterations,
                duration=0.0 if duration is None else float(duration), seed=int(speeds.seed))
    speed = Speed(speeds.base, sched_t, sched_f, float(speeds.jitter))
    capacity = 1024
    while True:     # ASP's push counts may spread far: a larger histogram, the same run
        res = PSOut(time=np.zeros((n, 3)), iters=np.zeros(n, dtype=np.int64),
                    rounds=np.zeros(n, dtype=np.int64),
                    stale_hist=np.zeros(4096, dtype=np.int64), totals=np.zeros(3))
        try:
            _loop(run, speed, res, new_queue(n), _new_work(n, capacity))
            break
        except HistogramFull:
            capacity *= 16
    rec.time[:, :3] = res.time
    rec.iters[:] = res.iters
    rec.total_iterations = int(res.iters.sum())
    rec.rounds[:] = res.rounds
    rec.local_hist[1] = rec.total_iterations
    rec.add_staleness(res.stale_hist)
    rec.syncs = rec.total_iterations
    rec.messages = int(res.totals[1])
    rec.agg_cost_s = (cost.push() + cost.link()) * float(res.totals[2])
    rec.sim_time = float(res.totals[0])
    rec.phase_since[:] = rec.sim_time
    return rec
