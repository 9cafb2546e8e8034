"""The parameter-server policies (asp, ssp, dssp, bsp on PS) at scale: one compiled event loop.

Same worker cycle as the event engine (compute; step query, one round trip, always SYNC for
these policies; a push queued at the shard servers, which receive and apply it; a pull, held by
the staleness rule, queued at them too; the next iteration starts when the weights are back),
on a heap of events in Numba, so one event costs well under a microsecond.  Every shard sees
the same requests in the same order (a push or pull goes to all of them at once), so one queue
of a shard's service times stands for all of them (``CostModel``).

Decisions: the staleness rule of SSP / BSP-on-PS (``ssp_may_continue``: pushes[w] - min <= s)
is evaluated with the minimum kept incrementally (a histogram of push counts), which is the
kernel's own comparison without its O(n) scan.  DSSP: lines 3-9 of Alg. 1 (an extra iteration
left, or within s_L) are that same O(1) test, and line 11 (is p a fastest worker?) compares
with the maximum, also kept incrementally; a push of a fastest worker beyond s_L calls the
real kernel ``sched.dssp_on_push`` on the full table (the controller, Alg. 2), with the
allowance r_max computed as ``server.policies.DSSP.on_push`` computes it.  Tests run both
engines on the same seeded cases and require identical iteration counts.

``_loop`` is the dispatch over the four event kinds; each step it takes is a small helper
compiled into it (``jit(inline=True)``), so naming the steps adds no function call per event.
What it is told and what it fills are named tuples (:class:`PSRun`, :class:`Speed`,
:class:`PSOut`), which Numba passes as they are.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from mpsync import policies, sched
from mpsync.sched._numba import jit

__all__ = ["run_ps", "PSRun", "PSOut", "Speed"]

# ordered as the event engine orders simultaneous events (server messages first), ties
# then in scheduling order (a sequence number), so both engines agree event for event
_PUSHED, _PULL, _DONE, _REPLIED = 2, 3, 4, 5
ASP, SSP, DSSP = 0, 1, 2
# the registry's simulation models on the PS -> the rule the loop applies at a pull
_KINDS = {"no_wait": ASP, "staleness": SSP, "in_step": SSP, "dynamic_staleness": DSSP}


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


@jit
def _key(ev, seq, w):
    """Heap order after the time: event kind, then scheduling order; the worker rides in the
    low 20 bits (up to 1,048,576 workers, 2**38 events)."""
    return (np.int64(ev) << 58) | (np.int64(seq) << 20) | np.int64(w)


@jit(inline=True)
def _schedule(heap, seq, t, ev, w):
    """Event ``ev`` of worker ``w`` at ``t``, after every event already scheduled for ``t``."""
    seq[0] += 1
    heapq.heappush(heap, (t, _key(ev, seq[0], w)))


@jit(inline=True)
def _iteration_time(speed, w, t):
    """One iteration of ``w`` starting at ``t`` (a :class:`Speed`)."""
    c = speed.base[w]
    for i in range(speed.sched_t.shape[0]):
        if t >= speed.sched_t[i]:
            c = speed.base[w] * speed.sched_f[i, w]
    if speed.jitter > 0.0:
        c *= np.exp(np.random.normal(-0.5 * speed.jitter * speed.jitter, speed.jitter))
    return c


@jit(inline=True)
def _transfer(t, server_free, service, run):
    """A push or pull started at ``t`` that costs each shard ``service``: when it is done,
    and when the shards are free again (transfers queue at them when ``run.shared``, else each
    takes ``service`` on its own); never sooner than the worker's own link allows."""
    if run.shared:
        server_free = max(t, server_free) + service
        return max(server_free, t + run.worker_link), server_free
    return t + service, server_free


@jit(inline=True)
def _computed(book, w, t):
    """``w``'s iteration ended at ``t``: compute time booked, waiting for the server begins."""
    start, phase, time_, _ = book
    time_[w, 0] += t - start[w]
    start[w] = t
    phase[w] = 1


@jit(inline=True)
def _pushed(book, w, t, query):
    """``w``'s push reached the server at ``t``: the step query's round trip was waiting, the
    rest of the time since the iteration ended aggregating, which goes on until the pull."""
    start, phase, time_, _ = book
    time_[w, 1] += query
    time_[w, 2] += t - start[w] - query
    start[w] = t
    phase[w] = 2


@jit(inline=True)
def _record_push(w, t, pushes, table):
    """Count ``w``'s push at ``t`` and keep its last two push times (the table the DSSP
    controller reads); returns its push count before this one."""
    old = pushes[w]
    pushes[w] = old + 1
    table[w, 0] = table[w, 1] if old > 0 else t
    table[w, 1] = t
    return old


@jit(inline=True)
def _count_push(count, old, lo, hi):
    """A worker's push count went from ``old`` to ``old + 1``: move it in the histogram
    ``count`` (grown when needed) and keep min (``lo``) and max (``hi``) of the push counts
    without a scan; returns (count, lo, hi, whether the minimum rose)."""
    if old + 1 >= count.shape[0]:
        bigger = np.zeros(2 * count.shape[0], dtype=np.int64)
        bigger[:count.shape[0]] = count
        count = bigger
    count[old] -= 1
    count[old + 1] += 1
    if old + 1 > hi:
        hi = old + 1
    raised = False
    while count[lo] == 0:
        lo += 1
        raised = True
    return count, lo, hi, raised


@jit(inline=True)
def _dssp_push(w, pushes, lo, hi, r_extra, dssp_held, table, s_low, s_high):
    """DSSP at ``w``'s push (Alg. 1): will its next pull be held?  Lines 3-9 (an extra
    iteration left, or within s_L) in O(1); a fastest worker beyond s_L asks the controller
    (Alg. 2, the real kernel) with r_max as ``server.policies.DSSP.on_push`` computes it."""
    gap = pushes[w] - lo
    if r_extra[w] > 0:
        r_extra[w] -= 1
        dssp_held[w] = False
    elif gap <= s_low:
        dssp_held[w] = False
    elif pushes[w] < hi:
        dssp_held[w] = True     # not the fastest: line 11 fails, line 17 holds
    else:
        r_max = max(0, min(s_high - s_low, s_high - gap + 1))
        ok, r_new = sched.dssp_on_push(pushes, r_extra[w], table, w, s_low, r_max)
        r_extra[w] = r_new
        dssp_held[w] = not ok


@jit(inline=True)
def _may_pull(kind, gap, s, s_low, held_by_dssp):
    """The staleness rule at a pull request, ``gap`` = pushes[w] - min(pushes)."""
    if kind == ASP:
        return True
    if kind == SSP:
        return gap <= s
    return (not held_by_dssp) or gap <= s_low


@jit(inline=True)
def _resume(w, t, gap, server_free, run, book, stale_hist, heap, seq, speed):
    """The pull of ``w`` answered at ``t`` with staleness ``gap``: the weights come back from
    the shards, the reset is sent and the next iteration starts (its end is the next event);
    returns when the shards are free again.  ``book``: (start, phase, time_, rounds)."""
    start, phase, time_, rounds = book
    stale_hist[min(gap, stale_hist.shape[0] - 1)] += 1
    end, server_free = _transfer(t, server_free, run.pull_s, run)
    back = end + run.query / 2.0
    rounds[w] += 1
    time_[w, 2] += back - start[w]
    start[w] = back
    phase[w] = 0
    _schedule(heap, seq, back + _iteration_time(speed, w, back), _DONE, w)
    return server_free


@jit(inline=True)
def _release_held(held, n_held, bound, pushes, lo, dssp_held, t, server_free, run, book,
                  stale_hist, heap, seq, speed):
    """The minimum push count rose: answer every held pull now within ``bound`` of it (SSP's
    s, DSSP's s_L: a held DSSP pull waits for the slowest), in the order they were held;
    returns (how many are still held, when the shards are free again)."""
    keep = 0
    for i in range(n_held):
        v = held[i]
        gap = pushes[v] - lo
        if gap <= bound:
            dssp_held[v] = False
            server_free = _resume(v, t, gap, server_free, run, book, stale_hist, heap, seq,
                                  speed)
        else:
            held[keep] = v
            keep += 1
    return keep, server_free


@jit(inline=True)
def _close_phases(t_end, book):
    """Book each worker's open phase up to ``t_end``; weights still on the way back at
    ``t_end`` do not count as a round."""
    start, phase, time_, rounds = book
    for w in range(start.shape[0]):
        if start[w] > t_end:
            time_[w, 2] -= start[w] - t_end
            rounds[w] -= 1
        else:
            time_[w, phase[w]] += t_end - start[w]


@jit
def _loop(run, speed, res):
    """Fill ``res`` (a :class:`PSOut`) with the run ``run`` (a :class:`PSRun`) of workers
    ``speed`` (a :class:`Speed`).  Per event: an iteration done (the step query goes out), its
    reply in (the push goes to the shards), the push at the server, the pull request
    (answered or held)."""
    np.random.seed(run.seed)
    n = speed.base.shape[0]
    half = run.query / 2.0
    pushes = np.zeros(n, dtype=np.int64)
    table = np.zeros((n, 2), dtype=np.float64)
    r_extra = np.zeros(n, dtype=np.int64)
    dssp_held = np.zeros(n, dtype=np.bool_)
    start = np.zeros(n)                       # when the current phase began
    phase = np.zeros(n, dtype=np.int64)
    book = (start, phase, res.time, res.rounds)
    count = np.zeros(1024, dtype=np.int64)    # workers per push count
    count[0] = n
    lo, hi = 0, 0                             # min(pushes), max(pushes)
    held = np.empty(n, dtype=np.int64)
    n_held = 0
    server_free = 0.0
    messages = 0
    total = 0
    heap = [(0.0, np.int64(0))]
    heap.pop()
    seq = np.zeros(1, dtype=np.int64)
    for w in range(n):
        _schedule(heap, seq, _iteration_time(speed, w, 0.0), _DONE, w)
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
            res.iters[w] += 1
            total += 1
            _computed(book, w, t)
            messages += 1
            # step query (always SYNC); the push goes out when the reply is in;
            # (t + half) + half: the sum the event engine computes
            _schedule(heap, seq, (t + half) + half, _REPLIED, w)
            if run.total_target > 0 and total >= run.total_target:
                break
        elif ev == _REPLIED:
            end, server_free = _transfer(t, server_free, run.push_s, run)
            _schedule(heap, seq, end, _PUSHED, w)
        elif ev == _PUSHED:
            _pushed(book, w, t, run.query)
            messages += 1
            old = _record_push(w, t, pushes, table)
            count, lo, hi, raised = _count_push(count, old, lo, hi)
            if run.kind == DSSP:
                _dssp_push(w, pushes, lo, hi, r_extra, dssp_held, table, run.s_low, run.s_high)
            _schedule(heap, seq, t + run.query, _PULL, w)
            if raised and n_held > 0:
                # the slowest moved on: held pulls may go now (the loop retries after a message)
                bound = run.s if run.kind == SSP else run.s_low
                n_held, server_free = _release_held(held, n_held, bound, pushes, lo, dssp_held,
                                                    t, server_free, run, book, res.stale_hist,
                                                    heap, seq, speed)
        elif ev == _PULL:
            messages += 1
            gap = pushes[w] - lo
            if _may_pull(run.kind, gap, run.s, run.s_low, dssp_held[w]):
                dssp_held[w] = False
                server_free = _resume(w, t, gap, server_free, run, book, res.stale_hist, heap,
                                      seq, speed)
            else:
                held[n_held] = w
                n_held += 1
    _close_phases(t_end, book)
    res.totals[0] = t_end
    res.totals[1] = messages
    res.totals[2] = pushes.sum()


def run_ps(config, speeds, cost, rec, *, iterations=None, duration=None):
    """Fill the recorder ``rec`` with a simulated run of asp / ssp / dssp / bsp on PS."""
    model = policies.get(config.policy).simulation_model("ps")
    kind = _KINDS[model]
    n = speeds.n
    if n > 1 << 20:
        raise ValueError(f"the PS engine handles up to {1 << 20} workers, got {n}")
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
    res = PSOut(time=np.zeros((n, 3)), iters=np.zeros(n, dtype=np.int64),
                rounds=np.zeros(n, dtype=np.int64), stale_hist=np.zeros(4096, dtype=np.int64),
                totals=np.zeros(3))
    _loop(run, Speed(speeds.base, sched_t, sched_f, float(speeds.jitter)), res)
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
