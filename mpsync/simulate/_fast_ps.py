"""The parameter-server policies (asp, ssp, dssp, bsp on PS) at scale: one compiled event loop.

Same worker cycle as the event engine (compute; step query, one round trip, always SYNC for
these policies; push through the server's FIFO link; pull, held by the staleness rule; the
next iteration starts when the weights are back), on a heap of events in Numba, so one event
costs well under a microsecond.

Decisions: the staleness rule of SSP / BSP-on-PS (``ssp_may_continue``: pushes[w] - min <= s)
is evaluated with the minimum kept incrementally (a histogram of push counts), which is the
kernel's own comparison without its O(n) scan.  DSSP: lines 3-9 of Alg. 1 (an extra iteration
left, or within s_L) are that same O(1) test, and line 11 (is p a fastest worker?) compares
with the maximum, also kept incrementally; a push of a fastest worker beyond s_L calls the
real kernel ``sched.dssp_on_push`` on the full table (the controller, Alg. 2), with the
allowance r_max computed as ``server.policies.DSSP.on_push`` computes it.  Tests run both
engines on the same seeded cases and require identical iteration counts.
"""

from __future__ import annotations

import heapq

import numpy as np

from mpsync import sched
from mpsync.sched._numba import jit

__all__ = ["run_ps"]

# ordered as the event engine orders simultaneous events (server messages first), ties
# then in scheduling order (a sequence number), so both engines agree event for event
_PUSHED, _PULL, _DONE, _REPLIED = 2, 3, 4, 5
ASP, SSP, DSSP = 0, 1, 2


@jit
def _key(ev, seq, w):
    """Heap order after the time: event kind, then scheduling order; the worker rides in the
    low 20 bits (up to 1,048,576 workers, 2**38 events)."""
    return (np.int64(ev) << 58) | (np.int64(seq) << 20) | np.int64(w)


@jit
def _iteration_time(base, w, t, sched_t, sched_f, jitter):
    c = base[w]
    for i in range(sched_t.shape[0]):
        if t >= sched_t[i]:
            c = base[w] * sched_f[i, w]
    if jitter > 0.0:
        c *= np.exp(np.random.normal(-0.5 * jitter * jitter, jitter))
    return c


@jit
def _resume(w, t, link_free, link_s, shared, half, start, phase, time_, rounds, heap, seq, base,
            sched_t, sched_f, jitter):
    """The pull of ``w`` answered at ``t``: the weights take the link, come back, the reset is
    sent and the next iteration starts (its end is the next event); returns the link's next
    free time."""
    end = max(t, link_free) + link_s if shared else t + link_s
    back = end + half
    rounds[w] += 1
    time_[w, 2] += back - start[w]
    start[w] = back
    phase[w] = 0
    c = _iteration_time(base, w, back, sched_t, sched_f, jitter)
    seq[0] += 1
    heapq.heappush(heap, (back + c, _key(_DONE, seq[0], w)))
    return end if shared else link_free


@jit
def _loop(kind, s, s_low, s_high, base, sched_t, sched_f, jitter, seed, query, link_s,
          shared, total_target, duration, time_, iters, rounds, stale_hist, out):
    """``out``: [t_end, messages, pushes]; ``time_[w]``: compute, wait, aggregate seconds."""
    np.random.seed(seed)
    n = base.shape[0]
    half = query / 2.0
    pushes = np.zeros(n, dtype=np.int64)
    table = np.zeros((n, 2), dtype=np.float64)
    r_extra = np.zeros(n, dtype=np.int64)
    dssp_held = np.zeros(n, dtype=np.bool_)
    start = np.zeros(n)                       # when the current phase began
    phase = np.zeros(n, dtype=np.int64)
    cap = 1024
    count = np.zeros(cap, dtype=np.int64)     # workers per push count
    count[0] = n
    lo = 0                                    # min(pushes)
    hi = 0
    held = np.empty(n, dtype=np.int64)
    n_held = 0
    link_free = 0.0
    messages = 0
    total = 0
    heap = [(0.0, np.int64(0))]
    heap.pop()
    seq = np.zeros(1, dtype=np.int64)
    for w in range(n):
        c = _iteration_time(base, w, 0.0, sched_t, sched_f, jitter)
        seq[0] += 1
        heapq.heappush(heap, (c, _key(_DONE, seq[0], w)))
    t_end = 0.0
    while len(heap) > 0:
        t, key = heapq.heappop(heap)
        ev = key >> 58
        w = key & 0xFFFFF
        if duration > 0.0 and t > duration:
            t_end = duration
            break
        t_end = t
        if ev == _DONE:
            iters[w] += 1
            total += 1
            time_[w, 0] += t - start[w]
            start[w] = t
            phase[w] = 1
            messages += 1
            # step query (always SYNC); the push takes the server's link when the reply is in
            seq[0] += 1  # (t + half) + half: the sum the event engine computes
            heapq.heappush(heap, ((t + half) + half, _key(_REPLIED, seq[0], w)))
            if total_target > 0 and total >= total_target:
                break
        elif ev == _REPLIED:
            end = t + link_s
            if shared:
                link_free = max(t, link_free) + link_s
                end = link_free
            seq[0] += 1
            heapq.heappush(heap, (end, _key(_PUSHED, seq[0], w)))
        elif ev == _PUSHED:
            time_[w, 1] += query
            time_[w, 2] += t - start[w] - query
            start[w] = t
            phase[w] = 2
            messages += 1
            old = pushes[w]
            pushes[w] = old + 1
            table[w, 0] = table[w, 1] if old > 0 else t
            table[w, 1] = t
            if old + 1 >= cap:
                bigger = np.zeros(2 * cap, dtype=np.int64)
                bigger[:cap] = count
                count = bigger
                cap *= 2
            count[old] -= 1
            count[old + 1] += 1
            if old + 1 > hi:
                hi = old + 1
            raised = False
            while count[lo] == 0:
                lo += 1
                raised = True
            if kind == DSSP:
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
            seq[0] += 1
            heapq.heappush(heap, (t + query, _key(_PULL, seq[0], w)))
            if raised and n_held > 0:
                # the slowest moved on: held pulls may go now (the loop retries after a message)
                keep = 0
                for i in range(n_held):
                    v = held[i]
                    gap = pushes[v] - lo
                    ok = gap <= s if kind == SSP else gap <= s_low
                    if ok:
                        if kind == DSSP:
                            dssp_held[v] = False
                        stale_hist[min(gap, stale_hist.shape[0] - 1)] += 1
                        link_free = _resume(v, t, link_free, link_s, shared, half, start,
                                            phase, time_, rounds, heap, seq, base, sched_t,
                                            sched_f, jitter)
                    else:
                        held[keep] = v
                        keep += 1
                n_held = keep
        elif ev == _PULL:
            messages += 1
            gap = pushes[w] - lo
            if kind == ASP:
                ok = True
            elif kind == SSP:
                ok = gap <= s
            else:
                ok = (not dssp_held[w]) or gap <= s_low
            if ok:
                if kind == DSSP:
                    dssp_held[w] = False
                stale_hist[min(gap, stale_hist.shape[0] - 1)] += 1
                link_free = _resume(w, t, link_free, link_s, shared, half, start, phase,
                                    time_, rounds, heap, seq, base, sched_t, sched_f, jitter)
            else:
                held[n_held] = w
                n_held += 1
    for w in range(n):
        if start[w] > t_end:   # its weights were still on the way back
            time_[w, 2] -= start[w] - t_end
            rounds[w] -= 1
        else:
            time_[w, phase[w]] += t_end - start[w]
    out[0] = t_end
    out[1] = messages
    out[2] = pushes.sum()


def run_ps(config, speeds, cost, rec, *, iterations=None, duration=None):
    """Fill the recorder ``rec`` with a simulated run of asp / ssp / dssp / bsp on PS."""
    kind = {"asp": ASP, "ssp": SSP, "bsp": SSP, "dssp": DSSP}[config.policy]
    if speeds.n > 1 << 20:
        raise ValueError(f"the PS engine handles up to {1 << 20} workers, got {speeds.n}")
    s = 0 if config.policy == "bsp" else config.staleness
    if speeds.schedule:
        sched_t = np.array([t for t, _ in speeds.schedule])
        sched_f = np.array([f for _, f in speeds.schedule])
    else:
        sched_t, sched_f = np.zeros(0), np.zeros((0, speeds.n))
    n = speeds.n
    time_ = np.zeros((n, 3))
    iters = np.zeros(n, dtype=np.int64)
    rounds = np.zeros(n, dtype=np.int64)
    stale = np.zeros(4096, dtype=np.int64)
    out = np.zeros(3)
    _loop(kind, s, config.staleness_low, config.staleness_high, speeds.base, sched_t, sched_f,
          float(speeds.jitter), int(speeds.seed), cost.query, cost.link(), cost.shared_link,
          0 if iterations is None else n * iterations, 0.0 if duration is None else duration,
          time_, iters, rounds, stale, out)
    rec.time[:, :3] = time_
    rec.iters[:] = iters
    rec.total_iterations = int(iters.sum())
    rec.rounds[:] = rounds
    rec.add_local_steps(np.ones(1, dtype=np.int64) * 1)
    rec.local_hist[1] = rec.total_iterations
    rec.add_staleness(stale)
    rec.syncs = rec.total_iterations
    rec.messages = int(out[1])
    rec.agg_cost_s = 2 * cost.link() * float(out[2])
    rec.sim_time = float(out[0])
    rec.phase_since[:] = rec.sim_time
    return rec
