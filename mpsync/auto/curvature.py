"""The step test: whether the loss still falls along a parameter server round's stride, measured
while the job trains; pure.

What the noise scale cannot see.  ``mpsync.auto.noise`` gives the parameter server's gain from
the gradient noise scale, which assumes a learning rate tuned for each batch size: at the job's
own learning rate the full updates may gain more than that (a step far below the stable one:
n full steps make n times the progress), or diverge (a step near it).  So its reading is
capped at the fitted constant (``efficiency.ranked_gain``), and on jobs it was never fitted on
the cap kept ``auto`` off a parameter server that trained 1.5-2.4x faster per second
(``bench/auto``, jobs the constants were never fitted on).  What tells them apart is the
curvature along the step, against the slope.

The model.  "An Empirical Model of Large-Batch Training" (McCandlish et al., 2018) §2.1
expands the loss after one step ``u`` to second order: it falls by ``-G·u - ½ uᵀHu`` (Eq. 2.3,
G the true gradient, H the Hessian).  For SGD, ``u = -ε g`` from a batch's gradient ``g``
(``ε`` the effective step size), so in expectation the fall is ``p - q/2`` with ``p = ε G·G``
and ``q = ε² gᵀHg``, the second including the batch's noise.  Split ``q`` into the part of the
true gradient, ``f q``, and the noise's, ``(1 - f) q``, in the ratio the squared norms have
(``f = p / a``, ``a = ε E|g|²``: the simple noise scale's assumption, §2.2, that H scales the
signal and the noise alike).  Then per n·b samples:

* the ring (BSP): one step of the n workers' mean gradient, its noise n times smaller:
  ``D_ring = p - ½ q (f + (1 - f) / n)``;
* the parameter server applying n full updates, each computed n - 1 updates before it is
  applied (the Downpour-style ASP round: n steps from nearly the same weights, so their cross
  terms add up): ``D_ps = n p - ½ n q (1 + (n - 1) f)``;

and the gain is ``D_ps / D_ring``: n where the step is far below the stable one (``q`` small
against ``p``), falling to 0 and below where n strides overshoot (a divergence).

How it is measured (``mpsync.torch.strategies.gradient_pairs``, with the noise probe, SGD
only): at the step's weights ``w``, g₁ the step's gradient and g₂ an independent batch's, the
worker sums ``p = ε g₁·g₂`` (unbiased for ε G·G), ``a = ε (|g₁|² + |g₂|²) / 2``, and, from one
more forward and backward of the second batch at ``w + n u₁``, ``q = 2 (L₂(w + n u₁) - L₂(w) +
n p) / n²`` (a quadratic loss's ``u₁ᵀHu₁``; the second batch is independent of u₁, so the
loss's own sampling noise does not bias it).  The sums of the last ``window_s`` seconds over
all workers give the gain; the uncertainty is a jackknife over the reports, as the noise
scale's.

Where it departs from the paper, and what it misses.  The paper's expansion is for one step
with the learning rate tuned; here it is evaluated at the job's learning rate, over a stride
of n steps, with momentum folded into ε (lr / (1 - momentum): a constant gradient's step).
Measured in one process on the digits, a ring-trained CNN (4 or 8 workers of batch 32, the
same probe; ``bench/auto/README.md``): early in training it read 2.9-3.7 at lr 0.01 with
momentum 0.9 and at lr 0.1 without (the parameter server trained 1.9-2.4x faster per second
in the comparisons), and 1.2 to below 0 at lr 0.05 with momentum 0.9 (4 and 8 workers: the
parameter server crawled or diverged).  Later in training, once the loss is sharper and the
gradient mostly noise, it reads below 1 or has no reading (the ring's own stride does not
fall) even where the parameter server trains on: so it may only raise the gain the ranking
uses (``efficiency.ranked_gain``), never lower it, and what the parameter server then does is
measured by the run's progress and its loss (``progress``, ``stability``).  For the same
reason the reading the ranking uses is the one with the highest lower bound so far
(:meth:`StepTest.kept`), until the learning rate changes: the evidence of the early strides
is not undone by the late ones, only by what the parameter server measurably did.

A falling gain.  Since a kept reading counts for the rest of the run, an early one has to be
about the strides to come, not the window's average: where the later half of the window's
strides (by pairs) reads below the whole window by more than the window's spread, the
estimate is the later half's (0, the ranking's floor, where the later half has no reading),
its spread widened by the drop.  Read from one process's reports (``bench/auto``): on the
digits CNN at lr 0.05 with momentum 0.9, 1,1,2,4 stragglers at 0.15 s, the first ranking's
21 strides read 2.56 +- 0.37 while their later half read 1.87, and the readings after it fell
(1.93, 1.31, 0.96 by 4 s): the parameter server chosen on the first reading reached the target
in 14-22 s where the ring took 12-14.  On the same CNN at lr 0.1 without momentum, where the
parameter server wins, the later halves of the first rankings' strides read 3.33-3.35 against
windows of 3.05-3.60: higher in two runs; in the third, 3.33 +- 0.31 for the window's 3.60,
still a raise that ranks the parameter server first.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["StepTest", "StrideEstimate", "stride_gain", "MIN_REPORTS", "MIN_PAIRS",
           "MODEL_SD"]

# Reports and pairs before the test counts at all (the workers probe 4 times a second at
# first: ``gradient_pairs.FIRST_PROBES``).
MIN_REPORTS = 8
MIN_PAIRS = 16
# How far the second-order model may be off whatever the measurement's own spread.
MODEL_SD = 0.1


def stride_gain(p: float, a: float, q: float, n: int) -> float | None:
    """The parameter server's gain over the ring per sample for n workers from the summed
    ``p``, ``a``, ``q`` (module doc), at most n; None where there is no reading: fewer than
    2 workers, no slope (``p`` or ``a`` not above 0), or the ring's own step not falling."""
    if n < 2 or not (p > 0 and a > 0):
        return None
    f = min(p / a, 1.0)
    ring = p - 0.5 * q * (f + (1.0 - f) / n)
    if not ring > 0:
        return None
    ps = n * p - 0.5 * n * q * (1.0 + (n - 1) * f)
    return min(ps / ring, float(n))


@dataclass(frozen=True)
class StrideEstimate:
    """``gain`` +- ``sd`` (None: no reading yet), ``pairs``/``reports``/``workers`` it rests
    on, and ``note``: all of it in words."""

    gain: float | None
    sd: float | None
    pairs: int
    reports: int
    workers: int
    note: str
    at: float = 0.0

    @property
    def lower(self) -> float:
        """The gain less one standard deviation (-inf: no reading)."""
        return -math.inf if self.gain is None else self.gain - self.sd

    def as_dict(self) -> dict:
        r = (lambda x: None if x is None else round(x, 4))
        return {"gain": r(self.gain), "sd": r(self.sd), "pairs": self.pairs,
                "reports": self.reports, "workers": self.workers, "note": self.note}

    def with_note(self, note: str) -> "StrideEstimate":
        return StrideEstimate(self.gain, self.sd, self.pairs, self.reports, self.workers,
                              note, self.at)


class StepTest:
    """The step tests reported by the workers over the last ``window_s`` seconds, and the
    parameter server's gain they imply for ``n`` workers (module doc)."""

    def __init__(self, n: int, *, window_s: float = 20.0, max_reports: int = 4096):
        if n < 1:
            raise ValueError(f"StepTest: n must be >= 1 worker, got {n}")
        self.n, self.window_s = int(n), float(window_s)
        self.reports: deque = deque(maxlen=max_reports)   # (time, worker, pairs, p, a, q)
        self.refused = 0
        self.best: StrideEstimate | None = None
        # The clock's reading the notes count seconds from (the run's start on the server).
        self.origin = 0.0

    def reset(self) -> None:
        """Forget every stride (the learning rate changed: they were the old rate's)."""
        self.reports.clear()
        self.best = None

    def kept(self, now: float | None = None) -> StrideEstimate:
        """The reading the ranking uses (module doc): of the estimates so far, the one with
        the highest lower bound; the current one where none had a reading."""
        current = self.estimate(now)
        if current.gain is not None and (self.best is None
                                         or current.lower > self.best.lower):
            self.best = current
        if self.best is None or self.best is current:
            return current
        return self.best.with_note(f"{self.best.note}, kept from "
                                   f"{self.best.at - self.origin:.1f} s (now: "
                                   f"{current.note.removeprefix('step test: ')})")

    def add(self, now: float, worker: int, pairs: int, p: float, a: float, q: float) -> bool:
        """One worker's sums since its last report; False (not kept) for one that is not
        finite, has no pairs or a negative ``a``."""
        if pairs < 1 or a < 0 or not all(math.isfinite(v) for v in (p, a, q)):
            self.refused += 1
            return False
        self.reports.append((float(now), int(worker), int(pairs), float(p), float(a),
                             float(q)))
        return True

    def estimate(self, now: float | None = None) -> StrideEstimate:
        """The gain at ``now`` (None: at the latest report)."""
        if now is None:
            now = self.reports[-1][0] if self.reports else 0.0
        while self.reports and self.reports[0][0] < now - self.window_s:
            self.reports.popleft()
        recent = list(self.reports)
        pairs = sum(r[2] for r in recent)
        workers = len({r[1] for r in recent})
        k = len(recent)
        if k < MIN_REPORTS or pairs < MIN_PAIRS:
            return StrideEstimate(None, None, pairs, k, workers,
                                  f"step test: {pairs} strides in {k} reports so far (needs "
                                  f"{MIN_PAIRS} in {MIN_REPORTS})")
        p, a, q = (sum(r[i] for r in recent) for i in (3, 4, 5))
        gain = stride_gain(p, a, q, self.n)
        words = (f"p {p / pairs:.3g}, q {q / pairs:.3g}, signal share {min(p / a, 1):.2f}"
                 if a > 0 else "no slope")
        if gain is None:
            return StrideEstimate(None, None, pairs, k, workers,
                                  f"step test: no reading ({words}: the ring's own stride "
                                  f"does not fall), {pairs} strides of {workers} worker(s)")
        # Jackknife: the gain without each report in turn (a leave-out with no reading
        # counts as the floor of the ranking, 0).
        leave_out = [stride_gain(p - r[3], a - r[4], q - r[5], self.n) or 0.0
                     for r in recent]
        mean = sum(leave_out) / k
        spread = math.sqrt((k - 1) / k * sum((g - mean) ** 2 for g in leave_out))
        sd = math.hypot(spread, MODEL_SD)
        falling = ""
        later = _later_half_gain(recent, pairs, self.n)
        if gain - later > sd:       # (module doc: a falling gain)
            falling = (f"; falling: the later half of the strides reads {later:.2f}, "
                       f"the window {gain:.2f}")
            sd, gain = math.hypot(sd, gain - later), later
        return StrideEstimate(gain, sd, pairs, k, workers,
                              f"step test: {gain:.2f} +- {sd:.2f} ({words}; {pairs} strides "
                              f"of {workers} worker(s), last {self.window_s:g} s{falling})",
                              now)


def _later_half_gain(recent: list, pairs: int, n: int) -> float:
    """The gain of the reports that hold the later half of the ``pairs`` strides of
    ``recent`` (oldest first); 0, the ranking's floor, where they have no reading."""
    later, count = [], 0
    for r in reversed(recent):
        later.append(r)
        count += r[2]
        if 2 * count >= pairs:
            break
    return stride_gain(*(sum(r[i] for r in later) for i in (3, 4, 5)), n) or 0.0
