"""The job's own statistical efficiency: the gradient noise scale, measured while it trains.

Why it matters to ``auto``.  The ring averages the n workers' gradients into one step (one
batch of n·b samples); the parameter server applies each worker's update in full (n steps of b
samples each).  How much more progress per sample the second makes depends on how noisy one
worker's gradient is: "An Empirical Model of Large-Batch Training" (McCandlish et al., 2018)
§2.2 shows that with the learning rate tuned for each batch size, a batch of B samples needs
``S_min (1 + B_noise / B)`` steps and ``E_min (1 + B / B_noise)`` samples (Eq. 2.11), the
*simple noise scale* ``B_noise = tr(Σ) / |G|²`` (Eq. 2.8; Σ the per-sample gradient
covariance, G the true gradient).  Per sample, n updates of b samples against one of n·b:

    gain = (1 + n·b / B_noise) / (1 + b / B_noise) = (φ + n) / (φ + 1),   φ = B_noise / b

1 where one worker's batch is far below the noise scale (φ >> n: averaging loses nothing),
up to n where it is far above (φ -> 0).  Pollux (OSDI 2021) §3.1 turns the same quantity
into its per-job statistical efficiency, updated as the job trains.

How it is measured (:class:`GradientNoise`, fed by the workers).  §A.1 of the paper estimates
|G|² and tr(Σ) from gradients of two batch sizes at the same weights.  Here each worker, about
once a second, sets its step's gradient g₁ (b samples) beside the gradient g₂ of another batch
of b at the same weights (a probe: ``DistributedOptimizer.probe_gradient_noise``, which
``mpsync train`` calls with its next batch); the two-batch estimators with B_small = b,
B_big = 2b reduce to

    |G|²  ≈ g₁ · g₂                (Eq. A.2 with |G_big|² = |g₁ + g₂|² / 4)
    tr(Σ) / b ≈ |g₁ - g₂|² / 2      (Eq. A.3)

so ``φ = (|g₁ - g₂|² / 2) / (g₁ · g₂)``, with no batch size needed.  As the paper advises,
numerator and denominator are averaged separately over many pairs (every worker's, the last
``window_s`` seconds) and divided once.

Where this departs from the paper: it pairs the data-parallel workers' gradients before
and after their average, which costs nothing where the gradients are averaged every step;
``auto`` runs local-step policies and the parameter server, which never average gradients, so
each worker pays one extra forward and backward per probe instead.  Consecutive steps'
gradients, which cost nothing, were tried first and read the noise wrong: one update apart,
at the learning rates jobs train at the gradient moves as much as its noise (at lr 0.1
without momentum g₁ · g₂ summed below 0, "no gain", in a job whose parameter server made
1.7-1.9x the ring's progress per sample).

The uncertainty: a jackknife over the reports in the window (each report is one worker's
pairs since its last), on the gain's scale (bounded in [1, n]).  The fitted constant of
``mpsync.auto.efficiency`` is the prior (:data:`PRIOR_SD` wide: it was fitted on other jobs);
the two are combined by their inverse variances, so the measurement overrides it as it
accumulates.  Pure: no MPI, no torch; times come with the calls.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from mpsync.auto.efficiency import PS_FULL_UPDATE_GAIN

__all__ = ["GradientNoise", "GainEstimate", "PRIOR_SD", "MODEL_SD", "MIN_REPORTS",
           "MIN_PAIRS", "gain_from_ratio"]

# The fitted gain's standard deviation as a prior for a job it was not fitted on (its residual
# on the jobs it was fitted on was 0.14, SSP at equal speeds 0.37 above it).
PRIOR_SD = 0.3
# How far the noise-scale model may be off for a job whatever the measurement's own spread (it
# assumes a learning rate tuned per batch size; momentum and a schedule move it): the
# measurement's standard deviation never goes below this.
MODEL_SD = 0.05
# Reports (each of one or more pairs) and pairs before the measurement counts at all.
MIN_REPORTS = 6
MIN_PAIRS = 12


def gain_from_ratio(phi: float, n: int) -> float:
    """Progress per sample of n full updates of b samples over one averaged update of n·b,
    for ``phi`` = B_noise / b (module doc); ``inf`` (noise only, or G · G <= 0 measured): 1."""
    if n < 2 or math.isnan(phi) or math.isinf(phi):
        return 1.0
    if phi <= 0:          # no noise at all: every sample's gradient is the true one
        return float(n)
    return (phi + n) / (phi + 1.0)


def _ratio(noise: float, signal: float) -> float:
    """φ from the summed halves of |g₁ - g₂|² and the summed g₁ · g₂: inf where the signal is
    not above 0 (the gradients' common part is lost in their noise)."""
    if signal <= 0:
        return math.inf
    return max(noise, 0.0) / signal


@dataclass(frozen=True)
class GainEstimate:
    """The parameter server's full-update gain for this job: ``gain`` (the prior and the
    measurement combined) and its standard deviation; ``measured``/``measured_sd``: the
    measurement alone (None before there is enough of it); ``ratio``: φ = B_noise / b;
    ``pairs``/``reports``/``workers``: what it rests on; ``note``: all of it in words."""

    gain: float
    sd: float
    measured: float | None
    measured_sd: float | None
    ratio: float | None
    pairs: int
    reports: int
    workers: int
    note: str

    def as_dict(self) -> dict:
        def r(x):
            return None if x is None else (round(x, 4) if math.isfinite(x) else "inf")

        return {"gain": r(self.gain), "sd": r(self.sd), "measured": r(self.measured),
                "measured_sd": r(self.measured_sd), "noise_ratio": r(self.ratio),
                "pairs": self.pairs, "reports": self.reports, "workers": self.workers,
                "note": self.note}


class GradientNoise:
    """The gradient noise reported by the workers over the last ``window_s`` seconds, and the
    gain it implies for ``n`` workers (module doc).  ``prior``/``prior_sd``: the fitted gain
    and how far it may be off for this job."""

    def __init__(self, n: int, *, window_s: float = 20.0, prior: float = PS_FULL_UPDATE_GAIN,
                 prior_sd: float = PRIOR_SD, max_reports: int = 4096):
        if n < 1:
            raise ValueError(f"GradientNoise: n must be >= 1 worker, got {n}")
        self.n, self.window_s = int(n), float(window_s)
        self.prior, self.prior_sd = float(prior), float(prior_sd)
        # (time, worker, summed ½|g₁ - g₂|², summed g₁ · g₂, pairs)
        self.reports: deque = deque(maxlen=max_reports)
        self.refused = 0

    def add(self, now: float, worker: int, noise: float, signal: float, pairs: int) -> bool:
        """One worker's pairs since its last report; False (not kept) for a report that is
        not finite or says no pairs."""
        if pairs < 1 or not (math.isfinite(noise) and math.isfinite(signal)) or noise < 0:
            self.refused += 1
            return False
        self.reports.append((float(now), int(worker), float(noise), float(signal), int(pairs)))
        return True

    def _recent(self, now: float) -> list:
        while self.reports and self.reports[0][0] < now - self.window_s:
            self.reports.popleft()
        return list(self.reports)

    def estimate(self, now: float | None = None) -> GainEstimate:
        """The gain at ``now`` (None: at the latest report): the prior where too little was
        measured, else the prior and the measurement combined by their inverse variances."""
        if now is None:
            now = self.reports[-1][0] if self.reports else 0.0
        recent = self._recent(now)
        pairs = sum(r[4] for r in recent)
        workers = len({r[1] for r in recent})
        prior_note = (f"prior {self.prior:.2f} +- {self.prior_sd:.2f} (the fitted constant, "
                      f"mpsync.auto.efficiency)")
        if len(recent) < MIN_REPORTS or pairs < MIN_PAIRS:
            return GainEstimate(self.prior, self.prior_sd, None, None, None, pairs,
                                len(recent), workers,
                                f"{prior_note}; measured: {pairs} gradient pairs in "
                                f"{len(recent)} reports so far (needs {MIN_PAIRS} in "
                                f"{MIN_REPORTS})")
        noise = sum(r[2] for r in recent)
        signal = sum(r[3] for r in recent)
        phi = _ratio(noise, signal)
        measured = gain_from_ratio(phi, self.n)
        # Jackknife: the gain without each report in turn.
        k = len(recent)
        leave_out = [gain_from_ratio(_ratio(noise - r[2], signal - r[3]), self.n)
                     for r in recent]
        mean = sum(leave_out) / k
        spread = math.sqrt((k - 1) / k * sum((g - mean) ** 2 for g in leave_out))
        measured_sd = math.hypot(spread, MODEL_SD)
        w_prior, w_meas = self.prior_sd ** -2, measured_sd ** -2
        gain = (self.prior * w_prior + measured * w_meas) / (w_prior + w_meas)
        sd = (w_prior + w_meas) ** -0.5
        phi_words = "inf" if math.isinf(phi) else f"{phi:.2f}"
        note = (f"measured {measured:.2f} +- {measured_sd:.2f} from the gradient noise scale "
                f"(B_noise / batch = {phi_words}, {pairs} same-weights gradient pairs of "
                f"{workers} worker(s), last {self.window_s:g} s), {prior_note}: "
                f"{gain:.2f} +- {sd:.2f}")
        return GainEstimate(gain, sd, measured, measured_sd, phi, pairs, k, workers, note)
