"""The progress per sample each policy made while the job ran it, measured from the training loss
the workers report; pure.

What it answers.  ``auto`` ranks candidates by samples per second times a statistical
efficiency, each candidate's progress per sample relative to BSP's (``efficiency``).  The
efficiency is a model fitted on other jobs; what the run itself can measure is the progress it
makes.  Pollux (OSDI 2021, §3.1) measures a job's statistical efficiency while it trains, from
the gradient noise scale (``mpsync.auto.noise`` does that here, and it bounds the gain of the
parameter server's full updates from above only: it assumes a learning rate tuned for each
batch size).  Around a switch the job shows its progress per sample under two policies
directly: the training loss, falling under the policy left and under the one switched to, at
nearly the same point of training.

How it is measured (:class:`PhaseProgress`).  Each loss report (a worker's mean loss over its
iterations since its last report, ``mpsync.torch.strategies.switching``) is placed at the number
of iterations the whole job had done when it arrived.  The policy left: over its last
``window_s`` seconds, the rate ``ρ = -d ln L / d iterations`` and the level of ln L at the
switch, by weighted least squares (each report weighted by the iterations its mean covers).
The new policy: the fall from that level to the mean of ln L over its first ``window_s``
seconds after ``settle_s`` (reports that arrive just after a switch still cover iterations
before it), per iteration since the switch.  A rise right after the switch counts against the
new policy, and a recovery from that rise does not read as fast progress (a slope fitted
within the new window read a policy that overshot and came back as 2-3x faster).  The ratio of
the two rates is the new policy's progress per sample relative to the old one's; its
uncertainty comes from the fits' standard errors (delta method).

Why the relative rate of the *logarithm*, and what it still misses.  The loss falls more slowly
as training goes on, so the later window reads as slower progress under any policy.  For a loss
that decays exponentially the relative rate is constant (the tests recover known ratios of 0.3
and 2 without bias); real losses decay more slowly than that: across an unchanged switch (a
softmax model on the digits, trained by the same SGD before and after, 8-12 seeds at three
points of training) the ratio read 0.33-0.82 of the truth (medians).  Correcting for the
flattening with a model of the loss curve (a power law in the iterations) was tried and read a
true 4x as 4-30x.  So the measurement is used as a bracket (:meth:`ProgressRatio.bracket`):
at least the ratio less two standard errors, at most ``FLATTENING`` times the ratio plus two
(it held the truth of the unchanged switch in 30 of 32 seeds); the efficiency the model
predicts (the prior) is moved into the bracket (:func:`clamp`) and otherwise left as it is.
It catches what matters: a policy that crawls or diverges (a learning rate too large for the
parameter server's full updates: 0.16-0.27 of BSP's progress per sample measured where the
fitted model predicts 1.2, which no noise scale sees), and a gain well above the fitted one.

Where it departs from Pollux: Pollux predicts the efficiency of batch sizes the job has not run
from the noise scale and never measures the progress itself; here a policy's efficiency is
measured once the job has run it, and what was not run keeps its model.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["PhaseProgress", "ProgressRatio", "clamp", "FLATTENING", "BRACKET_SES",
           "MIN_REFERENCE_S", "MIN_REPORTS", "SIGNIFICANT"]

# Under an unchanged policy the relative rate falls between the two windows (the loss decays
# more slowly than an exponential): measured on a real model trained through a switch to the
# same policy, the ratio read 0.33-0.82 of the truth (module doc).  The bracket's upper end
# allows for that: the measurement bounds the progress per sample from below as it stands,
# from above only this many times higher.
FLATTENING = 2.0
# Standard errors either side of the measured ratio the bracket spans.
BRACKET_SES = 2.0
# Seconds of the policy left the reference window must cover to bound the new policy's
# progress from below: a run's first seconds are slow (measured: -d ln loss / d iteration
# 2.2e-4 over the first 1.1 s against 4.3e-4 later), so a reference from them overstates the
# ratio; a shorter reference still bounds it from above.
MIN_REFERENCE_S = 2.0
# Loss reports a window needs before its slope is fitted.
MIN_REPORTS = 8
# The policy left must have been making progress: its rate this many standard errors above
# zero, or there is nothing to compare against (a flat loss, late in a run).
SIGNIFICANT = 2.0


@dataclass(frozen=True)
class _Line:
    """A weighted least-squares line of ln L on iterations: ``rho`` = -slope and its standard
    error; the weighted means; ``sigma2`` the residual variance of one report of mean
    weight; ``sxx`` and ``sw`` as the fit summed them."""
    rho: float
    rho_se: float
    mx: float
    my: float
    sigma2: float
    sxx: float
    sw: float
    k: int

    def level_sd(self, x: float) -> float:
        """The standard error of the line's ln L at ``x``."""
        return math.sqrt(self.sigma2 * (self.sw / self.k)
                         * (1.0 / self.sw + (x - self.mx) ** 2 / self.sxx))


def _fit(points) -> _Line | None:
    """The line through ``points`` ((iterations, ln L, weight)), or None where they span no
    iterations.  Weights are the iterations a report's mean covers, scaled to their mean so
    that the residual variance is per report, as the degrees of freedom count them."""
    k = len(points)
    sw = sum(w for _, _, w in points)
    mx = sum(x * w for x, _, w in points) / sw
    my = sum(y * w for _, y, w in points) / sw
    sxx = sum(w * (x - mx) ** 2 for x, _, w in points)
    if sxx <= 0 or k < 3:
        return None
    slope = sum(w * (x - mx) * (y - my) for x, y, w in points) / sxx
    resid = sum(w * (y - my - slope * (x - mx)) ** 2 for x, y, w in points)
    sigma2 = resid / (k - 2) * k / sw
    return _Line(-slope, math.sqrt(sigma2 * (sw / k) / sxx), mx, my, sigma2, sxx, sw, k)


def _mean_level(points) -> tuple[float, float, float]:
    """(mean iterations, mean ln L, the standard error of that mean) of ``points``, weighted
    as :func:`_fit` weighs them."""
    k = len(points)
    sw = sum(w for _, _, w in points)
    mx = sum(x * w for x, _, w in points) / sw
    my = sum(y * w for _, y, w in points) / sw
    var = sum(w * (y - my) ** 2 for _, y, w in points) / max(k - 1, 1) * k / sw
    return mx, my, math.sqrt(var / k)


@dataclass(frozen=True)
class ProgressRatio:
    """The policy switched to (``label``) against the one left (``left``): ``ratio`` of their
    progress per sample ± ``sd``; the two rates ``rho``/``left_rho`` (per iteration of the
    job) with their standard errors, the reports each rests on; ``diverged``: the new phase
    reported a non-finite loss; ``reference_s``: the seconds of the policy left its rate was
    fitted over."""

    left: str
    label: str
    ratio: float
    sd: float
    rho: float
    rho_se: float
    left_rho: float
    left_rho_se: float
    reports: int
    left_reports: int
    diverged: bool = False
    reference_s: float = math.inf

    @property
    def note(self) -> str:
        if self.diverged:
            return (f"{self.label}: the training loss was not finite after the switch from "
                    f"{self.left}")
        return (f"{self.label} made {self.ratio:.2f} +- {self.sd:.2f} of {self.left}'s progress "
                f"per sample (-d ln loss / d iteration {self.rho:.2e} +- {self.rho_se:.1e} over "
                f"{self.reports} loss reports against {self.left_rho:.2e} +- "
                f"{self.left_rho_se:.1e} over {self.left_reports} in the {self.reference_s:.1f} s "
                f"before the switch)")

    def bracket(self, left_efficiency: float = 1.0) -> tuple[float, float]:
        """(lowest, highest) efficiency of the policy switched to that the measurement allows,
        given the policy left's ``left_efficiency``: the ratio ``BRACKET_SES`` standard errors
        either side, the upper end ``FLATTENING`` times higher (module doc), the lower end 0
        where the policy left ran less than ``MIN_REFERENCE_S``; (0, 0) for a phase whose
        loss was not finite."""
        if self.diverged:
            return 0.0, 0.0
        lo = max(self.ratio - BRACKET_SES * self.sd, 0.0) * left_efficiency
        if self.reference_s < MIN_REFERENCE_S - 1e-6:
            lo = 0.0
        hi = max(self.ratio + BRACKET_SES * self.sd, 0.0) * FLATTENING * left_efficiency
        return lo, hi

    def as_dict(self) -> dict:
        return {"left": self.left, "policy": self.label, "ratio": round(self.ratio, 4),
                "sd": round(self.sd, 4), "rho": self.rho, "rho_se": self.rho_se,
                "left_rho": self.left_rho, "left_rho_se": self.left_rho_se,
                "reports": self.reports, "left_reports": self.left_reports,
                "diverged": self.diverged, "reference_s": round(self.reference_s, 3),
                "note": self.note}


class PhaseProgress:
    """The loss reports of the phase running now and of the one before it (module doc).

    ``label``: the policy the run starts on. ``add(now, loss, count, iterations)``: a report of
    the mean of ``count`` iterations' losses, ``iterations`` the job's total when it arrived.
    ``begin(now, label)``: a policy runs from ``now``. ``ratio(now)``: the running policy
    against the one before, or None while either window is short (or the one before was making
    no measurable progress; ``declined`` says which).
    """

    def __init__(self, label: str | None = None, *, window_s: float = 3.0,
                 settle_s: float = 0.5, min_reports: int = MIN_REPORTS,
                 max_reports: int = 8192):
        if not (window_s > 0 and settle_s >= 0 and min_reports >= 3):
            raise ValueError("PhaseProgress: window_s > 0, settle_s >= 0, min_reports >= 3")
        self.window_s, self.settle_s = float(window_s), float(settle_s)
        self.min_reports = int(min_reports)
        self.max_reports = int(max_reports)
        self.label = label         # the running phase's policy (None: not named yet)
        self.start: float | None = None   # when it began (None: with the run)
        self.current: deque = deque(maxlen=max_reports)   # (time, iterations, loss, count)
        self.before: list = []     # the phase before's last window
        self.before_label: str | None = None
        self.before_span = 0.0     # the seconds that window covers
        self.start_iterations = 0  # the job's iterations when the running phase began
        self.declined: str | None = None   # why the last ratio() read nothing

    def add(self, now: float, loss: float, count: int, iterations: int) -> None:
        self.current.append((float(now), int(iterations), float(loss), max(int(count), 1)))

    def begin(self, now: float, label: str, iterations: int | None = None) -> None:
        """``label`` runs from ``now``, when the job had done ``iterations`` (None: as the
        last report said); the phase before keeps its last window."""
        if self.label is not None:
            # the run's first phase began with the run: no switch to settle from
            lo = now - self.window_s if self.start is None else \
                max(now - self.window_s, self.start + self.settle_s)
            self.before = [r for r in self.current if lo <= r[0] <= now]
            # the seconds the window covers: the run's first phase may be younger than it
            self.before_label = self.label
            self.before_span = now - self.before[0][0] if self.before else 0.0
        # reports after the switch stay: they are the new phase's
        kept = [r for r in self.current if r[0] > now]
        self.current = deque(kept, maxlen=self.max_reports)
        self.label, self.start = label, now
        self.start_iterations = (int(iterations) if iterations is not None
                                 else (self.before[-1][1] if self.before else 0))

    def _window_after(self, now: float) -> list:
        lo = (self.start or 0.0) + self.settle_s
        return [r for r in self.current if lo <= r[0] <= min(now, lo + self.window_s)]

    @staticmethod
    def _points(reports) -> list:
        return [(float(x), math.log(loss), c) for _, x, loss, c in reports]

    def ratio(self, now: float, min_span_s: float | None = None) -> ProgressRatio | None:
        """The running policy's progress per sample against the one before it, or None while
        there is too little to say it (fewer than ``min_reports`` reports in either window, the
        new window shorter than ``min_span_s`` (default: ``window_s``), or no significant
        progress before the switch).

        The policy left's line (its last window) gives the level at the switch and its rate;
        the new policy's rate is the fall from that level to the mean of its window, over the
        iterations between: a rise right after the switch counts against it, a recovery from
        the rise does not read as fast progress."""
        if self.before_label is None:
            return self._declined("no switch yet")
        if len(self.before) < self.min_reports:
            return self._declined(f"{len(self.before)} loss reports before the switch "
                                  f"(needs {self.min_reports})")
        start = self.start or 0.0
        after = self._window_after(now)
        span = now - start - self.settle_s        # (a tolerance: times are summed floats)
        if span < (self.window_s if min_span_s is None else min_span_s) - 1e-6:
            return self._declined(f"the window after the switch is {max(span, 0.0):.1f} s "
                                  f"so far")
        if any(not math.isfinite(r[2]) for r in self.before):
            return self._declined("a loss before the switch was not finite")
        if any(r[2] <= 0 for r in self.before) or any(r[2] <= 0 for r in after):
            # a script's own objective that reaches 0 or below has no logarithm
            return self._declined("a loss at or below 0")
        old = _fit(self._points(self.before))
        if old is None:
            return self._declined("the reports before the switch span no iterations")
        if any(not math.isfinite(r[2]) for r in after):
            self.declined = None
            return ProgressRatio(self.before_label, self.label, 0.0, 0.0, -math.inf, 0.0,
                                 old.rho, old.rho_se, len(after), len(self.before),
                                 diverged=True, reference_s=self.before_span)
        if len(after) < self.min_reports:
            return self._declined(f"{len(after)} loss reports after the switch "
                                  f"(needs {self.min_reports})")
        if not old.rho > SIGNIFICANT * old.rho_se:
            return self._declined(f"the loss was not falling measurably before the switch "
                                  f"(-d ln loss / d iteration {old.rho:.1e} +- "
                                  f"{old.rho_se:.1e})")
        x_s = self.start_iterations
        y_s = old.my - old.rho * (x_s - old.mx)
        mx, my, my_se = _mean_level(self._points(after))
        if not mx > x_s:
            return self._declined("no iterations after the switch")
        rho = (y_s - my) / (mx - x_s)
        rho_se = math.hypot(old.level_sd(x_s), my_se) / (mx - x_s)
        ratio = rho / old.rho
        self.declined = None
        sd = math.hypot(rho_se / old.rho, ratio * old.rho_se / old.rho)
        return ProgressRatio(self.before_label, self.label, ratio, sd, rho, rho_se, old.rho,
                             old.rho_se, len(after), len(self.before),
                             reference_s=self.before_span)

    def stalled(self, now: float) -> str | None:
        """Why neither the policy left (its last window) nor the running one (from the switch,
        after ``settle_s``, to ``now``) made measurable progress, or None where either did or
        there is too little to say.  Where the policy left was not falling, :meth:`ratio` has
        no reference; the running policy's own slope still shows whether it moves the job.
        Each is judged as :meth:`ratio` judges the policy left: ``-d ln L / d iteration``
        more than ``SIGNIFICANT`` standard errors above 0."""
        lo = (self.start or 0.0) + self.settle_s
        after = [r for r in self.current if lo <= r[0] <= now]
        if self.before_label is None or min(len(self.before), len(after)) < self.min_reports:
            return None
        if any(not (math.isfinite(r[2]) and r[2] > 0) for r in self.before + after):
            return None
        old, new = _fit(self._points(self.before)), _fit(self._points(after))
        if old is None or new is None or old.rho > SIGNIFICANT * old.rho_se \
                or new.rho > SIGNIFICANT * new.rho_se:
            return None
        return (f"neither {self.before_label}'s last {self.before_span:.1f} s nor "
                f"{self.label}'s {now - lo:.1f} s since the switch made measurable progress "
                f"(-d ln loss / d iteration {old.rho:.1e} +- {old.rho_se:.1e} over "
                f"{len(self.before)} loss reports, then {new.rho:.1e} +- {new.rho_se:.1e} "
                f"over {len(after)})")

    def _declined(self, why: str) -> None:
        self.declined = why
        return None


def clamp(model: float, lo: float | None, hi: float | None) -> float:
    """The model's figure (the prior) moved into what the measurement allows: the measurement
    overrides the model where they disagree, and leaves it where they do not."""
    if lo is not None:
        model = max(model, lo)
    if hi is not None:
        model = min(model, hi)
    return model
