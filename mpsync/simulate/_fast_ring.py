"""The ring policies (bsp, osp, ebsp; esync in ``_fast_esync``) at scale: one synchronization
round at a time.

On the ring every worker is told SYNC for the same round (an invariant the server keeps), so a round is
a closed unit: all workers start computing when the previous collective ends, each runs some
local iterations (one query round trip after each), and the collective starts when the last
worker's SYNC reply arrives.  A round is therefore computed with numpy over all workers, one
vector step per local iteration, instead of one event per report.

How many iterations each worker runs in a round is the policy's answer:

* bsp, osp: one (their ``on_step`` answers SYNC to every report).  OSP's bitmap of the round
  comes from the server's own OSP object (``bitmap_for``, Alg. 1 with Eq. 5's bound), called
  once per round with the round's first report: the epoch and loss of ``TrainingModel`` and the
  smallest bound the workers reported so far (what the object would hold had every worker
  reported; with jitter the others' bounds are those of the round before).
* ebsp: ``z + 1`` from the real planning kernels, ``sched.zipline(sched.predict(last, interval,
  R))``, on the table the server holds after the superstep's monitoring phase (ZipLine Fig. 5,
  two reports from everyone after every barrier), i.e. what ``ElasticBSP._try_plan``
  computes; with jitter the monitoring phase draws its own iteration times.
* esync: the event loop of ``_fast_esync``, which calls the server's ESync rules.

Tests run this engine and the event engine (the policy objects themselves) on the same seeded
speeds and compare iterations, rounds and times.
"""

from __future__ import annotations

import numpy as np

from mpsync import policies, sched
from mpsync.simulate._adapter import PolicyDriver
from mpsync.simulate._fast_esync import run_esync
from mpsync.simulate._training import TrainingModel

__all__ = ["run_ring"]


def run_ring(config, speeds, cost, rec, *, iterations=None, duration=None, training=None):
    """Fill the recorder ``rec`` with a simulated run of bsp / osp / esync / ebsp on the ring."""
    model = policies.get(config.policy).simulation_model("ring")
    if model == "query_state":
        return run_esync(config, speeds, cost, rec, iterations=iterations, duration=duration)
    n = speeds.n
    q = cost.query
    half = q / 2
    ics = _Overlap(config, n, cost, training or TrainingModel()) if model == "overlap" else None
    target = None if iterations is None else n * iterations
    horizon = np.inf if duration is None else duration
    T0 = 0.0
    total = 0
    state = _RingState(n)
    while True:
        plan_j = _ebsp_monitoring(config, speeds, cost, np.full(n, T0)) \
            if model == "planned" else None
        j, D_sync, reports = _local_iterations(speeds, half, T0, plan_j, state)
        E = (D_sync + half) + half
        start_agg = float(E.max())
        osp = ics.fraction(int(rec.collectives) + 1, reports) if ics else 0.0
        blocking = cost.ring(n, 1.0 - osp)
        # OSP's In-Computation Sync overlaps the next iteration (as in the event engine)
        hidden = max(0.0, cost.ring(n, osp) - _min_c(reports)) if osp else 0.0
        done = start_agg + blocking + hidden
        count = int(j.sum())
        t_end = _stop_time(reports, None if target is None else target - total, count,
                           horizon, done)
        if t_end is not None:
            total += _account(rec, reports, T0, E, done, q, t_end, blocking + hidden)
            rec.sim_time = t_end
            break
        _account(rec, reports, T0, E, done, q, np.inf, blocking + hidden)
        total += count
        rec.rounds += 1
        rec.collectives += 1
        rec.add_local_steps(j)
        T0 = done
    _finish(rec, total, n)
    return rec


class _RingState:
    """What the server's tables carry from one round to the next."""

    def __init__(self, n):
        self.interval = np.full(n, np.nan)    # ElasticBSP: the interval each last report closed


class _Overlap:
    """OSP: the In-Computation Sync fraction of each round, from the server's OSP object."""

    def __init__(self, config, n, cost, training):
        self.drv = PolicyDriver(config, n)
        self.training = training
        self.sizes = training.layer_sizes(cost.model_bytes)
        agg = cost.ring(n, 1.0)
        self.rate = cost.model_bytes / agg if agg > 0 else 0.0
        self.n = n
        self.u = np.full(n, np.inf)        # each worker's last Eq. 5 bound

    def fraction(self, k, reports):
        """The bitmap of iteration ``k`` (every worker's k-th iteration is this round's),
        decided at its first report."""
        D, c, idx = reports[0]
        first = int(np.argmin(D))
        tr = self.training
        u_first = tr.u_max(self.rate, float(c[first]), self.n)
        others = np.delete(self.u, idx[first])
        u = min(u_first, float(others.min())) if others.size else u_first
        self.u[idx] = tr.u_max_all(self.rate, c, self.n)
        epoch = tr.epoch(k)
        return self.drv.importance(int(idx[first]), k, epoch, tr.loss(epoch), u, self.sizes)


def _local_iterations(speeds, half, T0, plan_j, state):
    """One round's local iterations, one vector step each over the workers still running:
    start S, compute c, report D (the server sees it at D + half).  Returns the iterations
    per worker, each worker's SYNC report time and the reports ``(D, c, idx)`` in order."""
    n = speeds.n
    idx = np.arange(n)
    Si = np.full(n, T0)
    j = np.zeros(n, dtype=np.int64)
    D_sync = np.zeros(n)
    D_prev = np.full(n, np.nan)
    reports = []
    while idx.size:
        c = speeds.times(Si, idx)
        D = Si + c
        reports.append((D, c, idx))
        j[idx] += 1
        if plan_j is not None:
            sync = j[idx] >= plan_j[idx]
            _close_intervals(state.interval, D_prev, idx, D, T0, half)
        else:   # bsp, osp: SYNC at every report
            sync = np.ones(idx.size, dtype=bool)
        D_sync[idx[sync]] = D[sync]
        keep = ~sync
        idx = idx[keep]
        Si = (D[keep] + half) + half
    return j, D_sync, reports


def _close_intervals(interval, D_prev, idx, D, T0, half):
    """ElasticBSP: the interval each report closes, from the previous report or the reset."""
    prev = D_prev[idx]
    interval[idx] = np.where(np.isnan(prev), (D + half) - (T0 + half),
                             (D + half) - (prev + half))
    D_prev[idx] = D


def _stop_time(reports, left, count, horizon, done):
    """When the run ends inside this round (``left`` iterations to go, ``horizon``), or None."""
    t_end = None
    if left is not None and count >= left:
        all_D = np.concatenate([r[0] for r in reports])
        t_end = float(np.partition(all_D, left - 1)[left - 1])
    if horizon < done and (t_end is None or horizon < t_end):
        t_end = horizon
    return t_end


def _finish(rec, total, n):
    """The run's counters: a report per iteration, a SYNC per worker and collective, a reset
    per round."""
    rec.total_iterations = total
    rec.syncs = int(rec.collectives) * n
    rec.locals = total - rec.syncs
    rec.messages = total + rec.syncs
    rec.phase_since[:] = rec.sim_time


def _min_c(reports) -> float:
    return float(min(r[1].min() for r in reports))


def _account(rec, reports, T0, E, done, q, t_end, agg_cost) -> int:
    """Book one round's time per worker up to ``t_end``; returns the iterations counted."""
    counted = 0
    if t_end == np.inf:
        for D, c, idx in reports:
            rec.time[idx, 0] += c
            rec.time[idx, 1] += q
            rec.iters[idx] += 1
            counted += idx.size
    else:
        for D, c, idx in reports:
            S = D - c
            rec.time[idx, 0] += np.clip(np.minimum(D, t_end) - S, 0, None)
            rec.time[idx, 1] += np.clip(np.minimum(D + q, t_end) - D, 0, None)
            done_here = D <= t_end
            rec.iters[idx] += done_here
            counted += int(done_here.sum())
    rec.time[:, 2] += np.clip(np.minimum(done, t_end) - E, 0, None)
    if t_end >= done:
        rec.agg_cost_s += agg_cost * rec.n
    return counted


def _ebsp_monitoring(config, speeds, cost, S):
    """An ElasticBSP superstep's monitoring phase (ZipLine Fig. 5, after every barrier):
    everyone LOCAL until every worker has reported twice since the round began; the plan is
    made at that report (``_try_plan`` in ``on_step``), from each worker's latest
    report and the interval it closed; returns the iterations each worker runs this round."""
    n = speeds.n
    half = cost.query / 2
    c = speeds.times(S)
    # the first two reports of everyone (and further ones of the fast, until the plan)
    N1 = S + c + half
    S2 = N1 + half
    c2 = speeds.times(S2)
    N2 = S2 + c2 + half
    plan_at = float(N2.max())
    k = np.full(n, 2, dtype=np.int64)
    last, prev = N2.copy(), N1.copy()
    nxt = last + half
    while True:
        cn = speeds.times(nxt)
        Nn = nxt + cn + half
        more = Nn <= plan_at
        if not more.any():
            break
        prev = np.where(more, last, prev)
        last = np.where(more, Nn, last)
        k += more
        nxt = np.where(more, Nn + half, nxt)
    interval = last - prev
    res = sched.zipline(sched.predict(last, np.maximum(interval, 1e-9), config.lookahead),
                        config.zipline_variant)
    return k + res.z + 1
