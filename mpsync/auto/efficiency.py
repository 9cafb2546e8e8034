"""Statistical efficiency: a policy's progress per sample relative to BSP's.

Throughput alone would always pick the policy that waits least (ASP, or local steps without
end).  ``auto`` multiplies each candidate's simulated samples per second by a statistical
efficiency, its progress per sample relative to BSP's (Pollux, OSDI 2021, calls the product
goodput), from what the simulation of the candidate measured:

* updates applied in full, on arrival (the registry's policies on the parameter server without
  ``ps_average``: ASP, SSP, DSSP, ElasticBSP within a superstep).  Two effects:

  - the gain: the PS applies each worker's update as it is (the final model is w0 + the *sum*
    of the updates) where the ring averages n of them into one step, so per sample it takes n
    times the ring's steps at the same learning rate: faster progress per sample early on.
    ``PS_FULL_UPDATE_GAIN``.
  - the cost of staleness *beyond* n - 1.  Worker w's update is ``s_w = sum_{v != w} r_v / r_w``
    updates old, ``r`` the workers' iteration rates *in the simulation of the candidate* (each
    worker's iterations over the simulated time: SSP's and DSSP's bounds, which the simulator
    applies, hold the fast workers back to the slowest's rate, so ``s_w`` is n - 1 for all;
    ASP lets a 4x straggler's updates be 10 updates old against 1.75 for the fast ones).  The
    update-weighted mean of ``s_w`` is n - 1 whatever the rates; what hurts is a worker far
    behind the others: ``excess = sum_w (r_w / R) max(0, s_w - (n - 1))``.  Efficiency:
    ``PS_FULL_UPDATE_GAIN / (1 + PS_EXCESS_STALENESS_COST * excess)``.

* local steps: averaging the deltas of ``k`` local steps (ESync Eq. 6-8, local SGD between
  ElasticBSP barriers) drifts the replicas apart; ``1 / (1 + LOCAL_STEP_COST * (k - 1))`` with
  ``k`` the mean local steps per round of the simulation.

How the constants were fitted.  Measured progress per sample: BSP's median samples to the
target (worker 0's first evaluation at or above it) over the policy's, in the same comparison
(``python -m mpsync.auto.explain OUT`` prints it).  The parameter server's two constants by
least squares on eff = G / (1 + C x) over 15 measurements, each row's excess ``x`` computed as
``rank_candidates`` does (SSP at its default bound 3, DSSP at 3-15, 120 iterations per worker)
on that comparison's BSP runs (``Measurements.from_metrics``), averaged over its 2 repeats:

  ==========================================================  ======  =====  ========  ======
  comparison (digits, 4 workers, target 0.9)                   policy  x      measured  fitted
  ==========================================================  ======  =====  ========  ======
  slowdown 1,1,2,4, 50 ms iterations                           ASP     0.85   0.71      0.78
  (the same)                                                   SSP     0.03   1.11      1.20
  (the same)                                                   DSSP    0.05   1.01      1.18
  slowdown 1,1,2,4, 0.15 s (two comparisons)                   ASP     0.85   0.85 0.68  0.78
  (the same)                                                   SSP     0.03   1.15 1.12  1.20
  equal speeds, 0.4 s                                          ASP     0.01   1.17      1.21
  (the same)                                                   SSP     0.01   1.58      1.21
  1,1,1,1 -> 1,1,1,4 after 10 s, 0.35 s                         ASP     0.55   0.84      0.90
  (the same)                                                   SSP     0.03   1.12      1.20
  the same at 0.2 s                                            ASP     0.34   0.93      1.00
  (the same)                                                   SSP     0.03   1.28      1.20
  4 nodes at 1gbit, wide MLP, slowdown 1,1,2,4, 0.1 s          ASP     0.53   1.16      0.90
  (the same)                                                   SSP     0.03   1.23      1.20
  ==========================================================  ======  =====  ========  ======

gives G = 1.22 and C = 0.67 (root-mean-square residual 0.14; the largest: SSP at equal
speeds, 1.58 measured, and ASP at 1gbit, 1.16, both above the fit, DSSP 0.17 below it; the
spread between repeats of one policy is 20-30% in samples to target).  The late straggler's
``x`` comes from BSP's compute over the whole run (the straggler for part of it).  ASP and SSP
predict the same at equal speeds (SSP measured more there, and in every row); the ranking
breaks such ties for the bounded policy (``ranking.TIE_TOLERANCE``).  ``LOCAL_STEP_COST``: a
least-squares fit of 1/efficiency - 1 on the extra local steps of ElasticBSP and ESync in the
first comparisons (0.78-1.26 measured per sample): 0.01 per step.

Fitted on 4 workers, the digits MLP and the wide MLP, lr 0.05 with momentum 0.9 only: the gain
of full updates grows with n and with the learning rate until it turns into divergence, and
none of that is validated here.  So a live run measures its own gain, from its gradient noise
scale (``mpsync.auto.noise``), with ``PS_FULL_UPDATE_GAIN`` as the prior the measurement
overrides as it accumulates (``efficiency(..., gain=)``, ``Measurements.ps_gain``); the
staleness and local-step costs stay the fitted constants.

A measured gain bounds the gain from above, and is used to lower the fitted one, never to
raise it: ranked at ``min(measured - MEASURED_GAIN_RISK_SDS sd, PS_FULL_UPDATE_GAIN)``.  The
noise scale's formula assumes a learning rate tuned for each batch size; at the job's own
learning rate, full updates gain that at most, and where the learning rate is too large for
n full updates they diverge, which no noise measurement sees.  Measured here (digits, 4
workers, equal speeds, 50 ms iterations, bench/auto/README.md): early in training both jobs
measured a gain of about 3.3 (B_noise / b about 0.3); at lr 0.1 without momentum SSP and ASP
on the PS made 2.27 and 1.82 of BSP's progress per sample, at lr 0.05 with momentum 0.9 they
diverged or crawled (0.16-0.27).  Where the measurement says the gradients are noisy (a gain
near 1, as late in training), the PS is not worth its risk, and the ranking knows it.

What the noise scale cannot see, the step test measures from the start: whether the loss still
falls along a parameter server round's stride, n of the job's own steps from the same weights,
and by how much against the ring's step (``mpsync.auto.curvature``).  Its gain, ranked at its
lower bound (``STRIDE_RISK_SDS``), may raise the gain above the fitted constant, never lower it
(late in training it reads low where the parameter server trains on).

An adaptive optimizer's steps (Adam, AdamW, anything not SGD) admit no step test: the stride
it takes is the preconditioned one, and a trial with it read no gain where the PS was 1.5x
faster.  There the noise scale's gain is ranked uncapped (``capped=False``), at its lower
bound as always: the cap's reason is SGD's, whose step grows with the gradient, so that n full
updates of a learning rate tuned near its stability limit overshoot; an adaptive step is about
the learning rate per coordinate whatever the gradient.  On the CNN with Adam at lr 0.003 the
noise scale's gain put ASP at 1.20 and SSP at 1.90 of BSP's progress per sample where the
comparison measured 1.28 and 1.86, against the capped constants' 0.76 and 1.20
(bench/auto/README.md).  A wrong raise is guarded as any other: the loss watch and the
progress measured on the parameter server (``lo``/``hi``) bound it.

What the noise scale cannot see, the run's own progress shows once it has run a parameter
server policy: the training loss's rate per iteration after the switch against before it
(``mpsync.auto.progress``) brackets that policy's efficiency, and the bracket, turned into
the gain by the staleness factor the model put on the policy, bounds the gain every
candidate applying updates in full is ranked with (``ranked_gain``'s ``lo``/``hi``): it can
raise the gain above the fitted constant where the PS measurably made more progress, and
lower it below anything the noise scale says where it crawled or diverged.
"""

from __future__ import annotations

__all__ = ["PS_FULL_UPDATE_GAIN", "PS_EXCESS_STALENESS_COST", "LOCAL_STEP_COST",
           "MEASURED_GAIN_RISK_SDS", "STRIDE_RISK_SDS", "ranked_gain",
           "efficiency", "excess_staleness", "ps_efficiency"]

PS_FULL_UPDATE_GAIN = 1.22
# A gain the run measured (``mpsync.auto.noise``) is ranked this many standard deviations
# below its estimate (module doc).
MEASURED_GAIN_RISK_SDS = 1.0
# The step test's gain (``mpsync.auto.curvature``) is ranked this many standard deviations
# below its estimate.
STRIDE_RISK_SDS = 1.0
PS_EXCESS_STALENESS_COST = 0.67
LOCAL_STEP_COST = 0.01
_FLOOR = 0.05


def ranked_gain(gain: float | None, sd: float = 0.0, lo: float | None = None,
                hi: float | None = None, stride: float | None = None,
                stride_sd: float = 0.0, capped: bool = True) -> float:
    """The full-update gain the ranking uses for a measured ``gain`` +- ``sd`` (None: the
    fitted constant): an upper bound, ranked at its lower bound, never above the fitted
    constant (module doc: what the noise scale cannot see is a divergence) unless
    ``capped`` is False (an adaptive optimizer's steps, module doc); raised to the
    step test's ``stride`` +- ``stride_sd`` at its lower bound where that is higher
    (``mpsync.auto.curvature``; None: no reading); then moved into [``lo``, ``hi``], what the
    progress the job made on the parameter server allows (``mpsync.auto.progress``; None:
    not measured)."""
    used = PS_FULL_UPDATE_GAIN if gain is None else gain - MEASURED_GAIN_RISK_SDS * sd
    if capped:
        used = min(used, PS_FULL_UPDATE_GAIN)
    if stride is not None:
        used = max(used, stride - STRIDE_RISK_SDS * stride_sd)
    if lo is not None:
        used = max(used, lo)
    if hi is not None:
        used = min(used, hi)
    return max(used, _FLOOR)


def excess_staleness(rates) -> tuple[float, float]:
    """(the update-weighted mean staleness beyond n - 1, the stalest worker's staleness) of
    updates applied on arrival from workers iterating at ``rates`` (module doc)."""
    rates = [float(r) for r in rates if r > 0]
    n, total = len(rates), sum(rates)
    if n < 2:
        return 0.0, 0.0
    excess = worst = 0.0
    for r in rates:
        s = (total - r) / r
        excess += r / total * max(0.0, s - (n - 1))
        worst = max(worst, s)
    return excess, worst


def ps_efficiency(rates, gain: float | None = None) -> tuple[float, float, float]:
    """(efficiency, excess staleness, stalest worker's staleness) of a parameter server that
    applies every update in full on arrival, workers iterating at ``rates``; ``gain``: the
    job's own full-update gain (``mpsync.auto.noise``; None: ``PS_FULL_UPDATE_GAIN``)."""
    excess, worst = excess_staleness(rates)
    gain = PS_FULL_UPDATE_GAIN if gain is None else gain
    return gain / (1.0 + PS_EXCESS_STALENESS_COST * excess), excess, worst


def _rates(row: dict, compute_s) -> list[float]:
    """Each worker's iterations per simulated second (the candidate's own rates: a bound
    the simulator applied shows), or 1 / compute time where the row has no counts."""
    each, t = row.get("iterations_each"), row.get("sim_time_s")
    if each and t:
        return [i / t for i in each]
    return [1.0 / c for c in compute_s]


def efficiency(row: dict, stale_reads: bool, compute_s, gain: float | None = None,
               gain_sd: float = 0.0, gain_bracket: tuple | None = None,
               stride: tuple | None = None, capped: bool = True) -> tuple[float, str]:
    """(efficiency > 0, the reason in words) of one simulated candidate: ``row`` from
    ``mpsync.simulate.simulate``; ``stale_reads``: the parameter server applies updates in
    full as they arrive; ``compute_s``: the workers' iteration times; ``gain``/``gain_sd``:
    the full-update gain the job measured (``mpsync.auto.noise``; None: the fitted one);
    ``gain_bracket``: (lowest, highest) gain the progress the job made on the parameter
    server allows (``mpsync.auto.progress``; None: not measured); ``stride``: the step
    test's (gain, sd) (``mpsync.auto.curvature``; None: no reading); ``capped``: False where
    the job's steps are an adaptive optimizer's (``ranked_gain``)."""
    eff, why = 1.0, []
    if stale_reads and len(compute_s) > 1:
        lo, hi = gain_bracket if gain_bracket is not None else (None, None)
        used = ranked_gain(gain, gain_sd, lo, hi, *(stride or (None, 0.0)), capped=capped)
        e, excess, worst = ps_efficiency(_rates(row, compute_s), used)
        eff *= e
        if gain is None:
            gain_words = f"x{PS_FULL_UPDATE_GAIN:.2f}, fitted"
        else:
            gain_words = (f"{'at most ' if capped else ''}x{gain:.2f} +-{gain_sd:.2f} "
                          f"measured in the run with the fitted prior"
                          f"{'' if capped else ' (adaptive steps: not capped)'}")
        if stride is not None:
            gain_words += f"; x{stride[0]:.2f} +-{stride[1]:.2f} by the step test"
        if gain_bracket is not None:
            gain_words += (f"; x{lo:.2f}-{hi:.2f} by the progress measured on the parameter "
                           f"server")
        if gain is not None or gain_bracket is not None or stride is not None:
            gain_words += f", ranked at x{used:.2f}"
        why.append(f"every update applied in full ({gain_words}), "
                   f"staleness {excess:.2f} beyond n - 1 on average "
                   f"(stalest worker {worst:.1f})")
    local = (row.get("local_steps_per_round") or {}).get("mean") or 1.0
    if local > 1:
        eff /= 1.0 + LOCAL_STEP_COST * (local - 1.0)
        why.append(f"{local:.1f} local steps per round")
    eff = max(eff, _FLOOR)
    return eff, (f"efficiency {eff:.2f} ({', '.join(why)})" if why
                 else "efficiency 1.00 (every update on the current weights)")
