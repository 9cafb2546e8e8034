"""The ring policies (bsp, osp, esync, ebsp) at scale: one synchronization round at a time.

On the ring every worker is told SYNC for the same round (DESIGN.md invariant), so a round is
a closed unit: all workers start computing when the previous collective ends, each runs some
local iterations (one query round trip after each), and the collective starts when the last
worker's SYNC reply arrives.  A round is therefore computed with numpy over all workers, one
vector step per local iteration, instead of one event per report.

How many iterations each worker runs in a round is the policy's answer:

* bsp, osp: one (their ``on_step`` answers SYNC to every report).
* ebsp: ``z + 1`` from the real planning kernels, ``sched.zipline(sched.predict(last, interval,
  R))``, on the table the server holds at the last reset of the round before (last event =
  the reset, interval = the one each worker's last report closed), i.e. what
  ``ElasticBSP._try_plan`` computes; the monitoring phase (two reports from everyone first)
  is replayed the same way (with jitter it draws its own iteration times, a first round that
  differs in its draws from the event engine's).
* esync: Alg. 2's test (``sched.esync_ready``), evaluated for all workers at once per local
  iteration: READY at the first report where the slowest device (largest capability, lowest
  index) has reported, or p cannot finish another iteration before it does
  (c_p + eps > c_slowest - now + t_e,slowest), or p itself is now the slowest.  The first round
  everyone is READY at once (all capabilities start at 0, so each reporter is the slowest so
  far).  The slowest is fixed at the round's start, which is exact for constant speeds;
  with jitter or a schedule a worker whose capability overtakes it mid-round is taken as
  the slowest from then on, the others keep comparing against the round's first one.

Tests run this engine and the event engine (the policy objects themselves) on the same seeded
speeds and compare iterations, rounds and times.
"""

from __future__ import annotations

import numpy as np

from mpsync import sched

__all__ = ["run_ring"]


def run_ring(config, speeds, cost, rec, *, iterations=None, duration=None):
    """Fill the recorder ``rec`` with a simulated run of bsp / osp / esync / ebsp on the ring."""
    n = speeds.n
    q = cost.query
    half = q / 2
    policy = config.policy
    osp = config.osp_ics_max_fraction if policy == "osp" else 0.0
    target = None if iterations is None else n * iterations
    horizon = np.inf if duration is None else duration
    T0 = 0.0
    total = 0
    cap = np.zeros(n)                 # ESync capability table (last compute per worker)
    interval = np.full(n, np.nan)     # ElasticBSP: the interval each worker's last report closed
    first_round = True
    while True:
        S = np.full(n, T0)
        plan_j = None
        if policy == "ebsp":
            # Every superstep starts with the monitoring phase (ZipLine Fig. 5).
            plan_j = _ebsp_monitoring(config, speeds, cost, S.copy())
        # per local iteration i, over the workers still running: start S, compute c, report
        # D (the server sees it at D + half); the time each spends is booked as it goes
        idx = np.arange(n)
        Si = S
        j = np.zeros(n, dtype=np.int64)
        D_sync = np.zeros(n)
        D_prev = np.full(n, np.nan)
        reports = []                  # report times of this round, for the stop check
        esync = policy == "esync" and not first_round
        if esync:
            s = int(np.argmax(cap))
            cap_s = cap[s]
            lf_s = T0 + half
        i = 0
        while idx.size:
            i += 1
            c = speeds.times(Si, idx)
            D = Si + c
            reports.append((D, c, idx))
            j[idx] += 1
            if policy in ("bsp", "osp") or (policy == "esync" and first_round):
                sync = np.ones(idx.size, dtype=bool)
            elif policy == "ebsp":
                sync = j[idx] >= plan_j[idx]
            else:  # esync, Alg. 2 per report
                N = D + half
                if i == 1:
                    N_s = N[s]                  # the slowest's first report: it is READY
                sync = (N >= N_s) | (c + config.esync_slack > cap_s - N + lf_s) | (c > cap_s)
                if i == 1:
                    sync[s] = True
            if policy == "esync":
                cap[idx] = c
            if policy == "ebsp":
                prev = D_prev[idx]
                # the interval this report closes: from the previous report, or the reset
                interval[idx] = np.where(np.isnan(prev), (D + half) - (T0 + half),
                                         (D + half) - (prev + half))
                D_prev[idx] = D
            D_sync[idx[sync]] = D[sync]
            keep = ~sync
            idx = idx[keep]
            Si = (D[keep] + half) + half
        E = (D_sync + half) + half
        start_agg = float(E.max())
        blocking = cost.ring(n, 1.0 - osp)
        # OSP's In-Computation Sync overlaps the next iteration (as in the event engine)
        hidden = max(0.0, cost.ring(n, osp) - _min_c(reports)) if osp else 0.0
        done = start_agg + blocking + hidden
        # stop inside this round?
        count = int(j.sum())
        t_end = None
        if target is not None and total + count >= target:
            all_D = np.concatenate([r[0] for r in reports])
            t_end = float(np.partition(all_D, target - total - 1)[target - total - 1])
        if horizon < done and (t_end is None or horizon < t_end):
            t_end = horizon
        if t_end is None:
            _account(rec, reports, T0, E, done, q, np.inf, blocking + hidden)
            total += count
            rec.rounds += 1
            rec.collectives += 1
            rec.add_local_steps(j)
            T0 = done
            first_round = False
            continue
        counted = _account(rec, reports, T0, E, done, q, t_end, blocking + hidden)
        total += counted
        rec.sim_time = t_end
        break
    rec.total_iterations = total
    rec.syncs = int(rec.collectives) * n
    rec.locals = total - rec.syncs
    rec.messages = total + rec.syncs   # a report per iteration, a reset per round
    rec.phase_since[:] = rec.sim_time
    return rec


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
