"""What ``auto`` knows of the cluster: one :class:`Measurements` record.

The live server builds it from the reports it answers (``Window``: each worker's recent compute
times; the aggregation's seconds per round as the span from the last SYNC reply of a round to
the first reset after it); the offline advice builds it from a finished run's ``metrics.json``
(:meth:`Measurements.from_metrics`) or from stated speeds and a link rate
(:meth:`Measurements.from_speeds`).  Either way the record is plain data: the ranking
(``ranking``) turns it into the simulator's speed and cost models.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from mpsync.auto.efficiency import ranked_gain

__all__ = ["Measurements", "Window", "DEFAULT_TARGET_SAMPLES", "CHANGE_FLOOR_S",
           "NOISE_MULTIPLE", "NOISE_REPORTS", "GAIN_CHANGE_FLOOR", "SLOW_LINK",
           "SLOW_LINK_WORDS"]

# The slow link a move to the parameter server is ranked on before the run has timed an
# aggregation (``Decider.decide_on_slow_link``): bytes/s and seconds per message.  100 Mbit/s,
# the slowest link mpsync's comparisons run on, and a switched Ethernet's tenth of a millisecond.
SLOW_LINK = (12.5e6, 1e-4)
SLOW_LINK_WORDS = "100 Mbit/s, 0.1 ms per message"

# Samples of BSP-equivalent progress a job needs to reach its target when nothing says more
# (the digits task of ``mpsync train`` reaches 0.9 after about 9-10k samples under BSP,
# bench/compare); only the scale of the predicted times depends on it, never their order.
DEFAULT_TARGET_SAMPLES = 10_000.0

# When a worker's compute time has changed (``Measurements.change_from``): by more than the
# relative tolerance, AND by more than NOISE_MULTIPLE standard errors of the two figures
# compared (each a median of a few reports, its error how much such medians wandered over
# that worker's recent reports: ``Window.noise``), AND by more than CHANGE_FLOOR_S.  On a loaded machine an iteration of 5 ms reads
# anywhere from 2 to 11 ms: a median of three such reads moves by a few ms between checks
# without anything having changed, and a change of a few ms cannot pay for a new ranking.
CHANGE_FLOOR_S = 5e-3
NOISE_MULTIPLE = 3.0
# Recent compute reports per worker the noise is estimated from (the median itself is over
# the window's own few: it must follow a real change quickly).
NOISE_REPORTS = 16
# The job's full-update gain as the ranking uses it (``mpsync.auto.noise``,
# ``efficiency.ranked_gain``: its lower bound, at most the fitted constant) changed when it
# moved by more than this: a ranking is redone on what the job learned.
GAIN_CHANGE_FLOOR = 0.1
# A standard deviation from the median absolute deviation (exact for normal draws).
_MAD_SIGMA = 1.4826


@dataclass(frozen=True)
class Measurements:
    """The cluster as measured (or stated).

    ``compute_s``: per worker, the mean seconds of one iteration's compute (recent window).
    ``jitter``: the per-iteration spread of compute, as a lognormal sigma (0: steady).
    ``aggregation_s``: one ring aggregation as measured, without waiting for peers; None:
    from ``model_bytes`` and ``bandwidth`` (the simulator's link model).
    ``query_s``: one state-server query round trip.
    ``compute_noise_s``: per worker, the standard error of its ``compute_s`` figure (from
    the spread of its recent reports); empty where unknown (stated or summed speeds).
    ``target_samples``: BSP-equivalent samples to the target (``DEFAULT_TARGET_SAMPLES``).
    ``topologies``: where candidates may run (the live ring job: ``("ring",)``).
    ``ps_gain``: the parameter server's progress per sample over the ring's for full updates,
    as this job measured it (``mpsync.auto.noise``), ``ps_gain_sd`` its standard deviation,
    ``ps_gain_note`` what it rests on; None: the fitted constant
    (``mpsync.auto.efficiency.PS_FULL_UPDATE_GAIN``).
    ``ps_gain_lo``/``ps_gain_hi``: the gain the progress measured on the parameter server
    allows (``mpsync.auto.progress``), ``ps_progress_note`` what it rests on; None: not
    measured.
    ``ps_stride_gain``/``ps_stride_gain_sd``: the step test's gain (``mpsync.auto.curvature``;
    None: no reading), which may raise the gain the ranking uses.
    ``ps_gain_capped``: False where the job's steps are an adaptive optimizer's (no step test;
    ``efficiency.ranked_gain``): the measured gain may then raise the fitted constant.
    """

    compute_s: tuple[float, ...]
    jitter: float = 0.0
    aggregation_s: float | None = None
    model_bytes: float = 150e3
    bandwidth: float = 1.25e9
    latency: float = 5e-6
    query_s: float = 3e-4
    batch_size: int = 32
    ps_shards: int = 2
    target_samples: float = DEFAULT_TARGET_SAMPLES
    topologies: tuple[str, ...] = ("ring", "ps")
    source: str = ""
    notes: tuple[str, ...] = field(default=())
    compute_noise_s: tuple[float, ...] = field(default=())
    ps_gain: float | None = None
    ps_gain_sd: float = 0.0
    ps_gain_note: str = ""
    ps_gain_lo: float | None = None
    ps_gain_hi: float | None = None
    ps_stride_gain: float | None = None
    ps_stride_gain_sd: float = 0.0
    ps_progress_note: str = ""
    ps_gain_capped: bool = True

    @property
    def ps_gain_bracket(self) -> tuple[float, float] | None:
        """(lowest, highest) full-update gain the progress the job made on the parameter
        server allows (``mpsync.auto.progress``), or None before any was measured."""
        if self.ps_gain_lo is None or self.ps_gain_hi is None:
            return None
        return self.ps_gain_lo, self.ps_gain_hi

    def __post_init__(self):
        if not self.compute_s or not all(c > 0 and math.isfinite(c) for c in self.compute_s):
            raise ValueError(f"compute_s: one iteration time > 0 per worker, got "
                             f"{self.compute_s!r}")
        if self.aggregation_s is not None and not self.aggregation_s >= 0:
            raise ValueError(f"aggregation_s must be >= 0 seconds, got {self.aggregation_s}")
        if not self.target_samples > 0:
            raise ValueError(f"target_samples must be > 0, got {self.target_samples}")
        if self.ps_gain is not None and not (math.isfinite(self.ps_gain) and self.ps_gain > 0):
            raise ValueError(f"ps_gain must be a number > 0 (or None), got {self.ps_gain!r}")
        if (self.ps_gain_lo is None) != (self.ps_gain_hi is None) or (
                self.ps_gain_lo is not None
                and not 0 <= self.ps_gain_lo <= self.ps_gain_hi < math.inf):
            raise ValueError(f"ps_gain_lo/ps_gain_hi: both None or 0 <= lo <= hi, got "
                             f"{self.ps_gain_lo!r}, {self.ps_gain_hi!r}")
        if self.ps_stride_gain is not None and not (
                math.isfinite(self.ps_stride_gain) and self.ps_stride_gain_sd >= 0):
            raise ValueError(f"ps_stride_gain must be a number (or None) and its sd >= 0, got "
                             f"{self.ps_stride_gain!r} +- {self.ps_stride_gain_sd!r}")

    @property
    def n(self) -> int:
        return len(self.compute_s)

    @property
    def spread(self) -> float:
        """Slowest over fastest worker's compute time (1: equal speeds)."""
        return max(self.compute_s) / min(self.compute_s)

    def with_topologies(self, topologies) -> "Measurements":
        return replace(self, topologies=tuple(topologies))

    def _noise(self, w: int) -> float:
        return self.compute_noise_s[w] if w < len(self.compute_noise_s) else 0.0

    def change_from(self, other: "Measurements", tolerance: float) -> str | None:
        """Why this cluster differs from ``other`` beyond the measurements' noise, or None.

        A worker's compute time changed when it moved by more than ``tolerance`` of the
        earlier figure, by more than ``NOISE_MULTIPLE`` times the two figures' combined
        standard error (``compute_noise_s``; where unknown, this test is skipped), and by more
        than ``CHANGE_FLOOR_S``: all three, so neither a few ms of timing noise on a short
        iteration nor a small drift of a long one reads as a change.  The aggregation
        changed when it moved by more than twice ``tolerance`` and by more than 5 ms."""
        if other is None:
            return "first measurement"
        if other.n != self.n:
            return f"{other.n} -> {self.n} workers"
        moved = []
        for w, (b, a) in enumerate(zip(other.compute_s, self.compute_s)):
            noise = math.hypot(self._noise(w), other._noise(w))
            if (abs(a - b) > tolerance * b and abs(a - b) > CHANGE_FLOOR_S
                    and abs(a - b) > NOISE_MULTIPLE * noise):
                moved.append((w, b, a, noise))
        if moved:
            w, b, a, noise = max(moved, key=lambda x: abs(x[2] - x[1]) / x[1])
            return (f"worker {w} compute {b * 1e3:.0f} -> {a * 1e3:.0f} ms/iteration "
                    f"(+-{noise * 1e3:.1f} ms standard error; {len(moved)} worker(s) moved "
                    f"by > {tolerance:.0%}, > {CHANGE_FLOOR_S * 1e3:g} ms and > "
                    f"{NOISE_MULTIPLE:g}x their standard error)")
        if "ps" in self.topologies:
            # The gain as the ranking uses it (``efficiency.ranked_gain``): a measured gain
            # above the fitted constant ranks as the constant, and changes nothing.
            b, a = other.ranked_ps_gain(), self.ranked_ps_gain()
            if abs(a - b) > GAIN_CHANGE_FLOOR:
                why = (self.ps_progress_note
                       if self.ps_gain_bracket != other.ps_gain_bracket else "")
                return (f"statistical efficiency: the parameter server's full-update gain as "
                        f"ranked {b:.2f} -> {a:.2f} ({why or self.ps_gain_note or 'measured'})")
        if other.aggregation_s and self.aggregation_s is not None:
            b, a = other.aggregation_s, self.aggregation_s
            # An aggregation of a few ms moves with the machine's load: compare above a floor.
            if abs(a - b) > 2 * tolerance * b and abs(a - b) > 5e-3:
                return f"aggregation {b * 1e3:.1f} -> {a * 1e3:.1f} ms/round"
        return None

    @property
    def ps_stride(self) -> tuple[float, float] | None:
        """The step test's (gain, sd) (``mpsync.auto.curvature``), or None: no reading."""
        if self.ps_stride_gain is None:
            return None
        return self.ps_stride_gain, self.ps_stride_gain_sd

    def on_slow_link(self) -> "Measurements":
        """These measurements with the link at ``SLOW_LINK`` (where no aggregation was timed,
        the ranking costs every transfer on the link; one that was timed stays as it is)."""
        bandwidth, latency = SLOW_LINK
        return replace(self, bandwidth=min(self.bandwidth, bandwidth),
                       latency=max(self.latency, latency),
                       notes=self.notes + (f"the link assumed slow ({SLOW_LINK_WORDS})",))

    def ranked_ps_gain(self) -> float:
        """The full-update gain the ranking uses (``efficiency.ranked_gain``)."""
        return ranked_gain(self.ps_gain, self.ps_gain_sd, self.ps_gain_lo, self.ps_gain_hi,
                           *(self.ps_stride or (None, 0.0)), capped=self.ps_gain_capped)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["compute_s"] = list(self.compute_s)
        d["topologies"] = list(self.topologies)
        d["notes"] = list(self.notes)
        d["compute_noise_s"] = list(self.compute_noise_s)
        return d

    # -- builders ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "Measurements":
        """The inverse of :meth:`as_dict`."""
        d = dict(d)
        for key in ("compute_s", "topologies", "notes", "compute_noise_s"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)

    @classmethod
    def from_speeds(cls, speeds, *, iter_time: float = 0.05, link: float | None = None,
                    model_bytes: float = 150e3, **kw) -> "Measurements":
        """Stated speeds: ``speeds`` are slowdown factors (``1,1,2,4``) of ``iter_time``
        seconds; ``link``: bytes/s of each worker's link (None: 10 Gbit/s)."""
        factors = [float(f) for f in speeds]
        if not factors or not all(f > 0 for f in factors):
            raise ValueError(f"speeds: one factor > 0 per worker, got {speeds!r}")
        return cls(compute_s=tuple(f * iter_time for f in factors), model_bytes=model_bytes,
                   bandwidth=link or 1.25e9, source=kw.pop("source", "stated speeds"), **kw)

    @classmethod
    def from_metrics(cls, metrics, **kw) -> "Measurements":
        """A finished run's ``metrics.json`` (a path or the loaded dict): each worker's
        compute per iteration, the aggregation per round of the worker that waited least
        (under a synchronous policy the slowest waits for nobody, so its figure is the
        aggregation itself), the samples at which it reached its target accuracy; from an
        ``auto`` run, the full-update gain it measured by its end (``auto_gradient_noise``:
        the noise scale with the fitted constant as its prior) in place of the constant, not
        capped where its workers stepped with an adaptive optimizer, as the run ranked it (its
        step test and progress bracket are not carried over: they describe moments of it)."""
        if not isinstance(metrics, dict):
            path = Path(metrics)
            try:
                metrics = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"metrics: cannot read {path}: {e}") from None
        workers = metrics.get("workers") or {}
        if not workers:
            raise ValueError("metrics: no 'workers' section (is this an mpsync train "
                             "metrics.json?)")
        order = sorted(workers, key=int)
        compute = tuple(max(workers[w]["compute_s"], 1e-9) / max(workers[w]["iterations"], 1)
                        for w in order)
        per_round = [workers[w]["aggregation_s"] / workers[w]["rounds"] for w in order
                     if workers[w].get("rounds")]
        config = metrics.get("config") or {}
        notes = []
        target = None
        target_acc = config.get("target_acc")
        for ev in metrics.get("evals") or ():
            if target_acc is not None and ev.get("accuracy", 0) >= target_acc:
                target = float(ev["samples"])
                break
        if target:
            notes.append(f"{config.get('policy', '?')} reached {target_acc} after "
                         f"{target:.0f} samples")
        bandwidth = float(config.get("comm_bandwidth") or 0) or 1.25e9
        values = dict(compute_s=compute,
                      aggregation_s=min(per_round) if per_round else None,
                      batch_size=int(config.get("batch_size") or 32),
                      bandwidth=bandwidth,
                      target_samples=target or DEFAULT_TARGET_SAMPLES,
                      source=f"metrics of a {config.get('policy', '?')} run",
                      notes=tuple(notes))
        noise = metrics.get("auto_gradient_noise") or {}
        if noise.get("measured") is not None and noise.get("gain"):
            values.update(ps_gain=float(noise["gain"]), ps_gain_sd=float(noise.get("sd", 0)),
                          ps_gain_note=f"as that run measured it: {noise.get('note', '')}")
        if metrics.get("auto_adaptive_workers"):
            values["ps_gain_capped"] = False
        values.update(kw)
        return cls(**values)


class Window:
    """The live server's recent measurements: per worker the last ``size`` compute times
    (a ring of floats) and the last ``history`` (>= size) for their noise, and the last
    aggregation spans (pure bookkeeping, no clock of its own: times come with the calls)."""

    def __init__(self, n: int, size: int = 16, history: int = NOISE_REPORTS):
        self.n, self.size = n, size
        self.history = max(size, history)
        self.compute = np.full((n, size), np.nan)
        self.recent = np.full((n, self.history), np.nan)
        self.count = np.zeros(n, dtype=np.int64)
        self.aggregation = np.full(size, np.nan)
        self.agg_count = 0

    def add_compute(self, w: int, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self.compute[w, self.count[w] % self.size] = seconds
            self.recent[w, self.count[w] % self.history] = seconds
            self.count[w] += 1

    def add_aggregation(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self.aggregation[self.agg_count % self.size] = seconds
            self.agg_count += 1

    def ready(self, reports: int, *, early: int | None = None, agree: float = 0.0) -> bool:
        """Every worker has reported at least ``reports`` compute times; or, with ``early``,
        at least ``early`` that agree within ``agree`` (largest / smallest <= 1 + agree)
        where it has fewer than ``reports``.  Sound for the median of 3 from 2 that agree:
        the median of {a, b, c} lies in [min(a, b), max(a, b)] whatever c is, so the two's
        median (their mean) differs from the one a third report would give by at most half
        their spread."""
        if np.all(self.count >= reports):
            return True
        if early is None or not np.all(self.count >= early):
            return False
        for w in np.flatnonzero(self.count < reports):
            seen = self.compute[w][np.isfinite(self.compute[w])]
            if seen.size < early or seen.max() > (1.0 + agree) * seen.min():
                return False
        return True

    def clear(self) -> None:
        """Forget what was measured (after a switch: waiting patterns change)."""
        self.aggregation[:] = np.nan
        self.agg_count = 0

    def noise(self) -> np.ndarray:
        """Per worker, how much the window's median compute time wanders with nothing
        changed: the medians of every ``size`` consecutive reports among its last
        ``history``, and their spread (1.4826 x their median absolute deviation, a standard
        deviation that one hiccup does not inflate).  Measured, not derived from a
        distribution: a loaded machine's timings are skewed and lumpy, and the median of three
        of them wanders more than a normal law would say.  0 until ``size + 2`` reports."""
        out = np.zeros(self.n)
        for w in range(self.n):
            count = int(self.count[w])
            seen = min(count, self.history)
            if seen < self.size + 2:
                continue
            order = [(count - seen + i) % self.history for i in range(seen)]
            reports = self.recent[w][order]
            medians = np.array([np.median(reports[i:i + self.size])
                                for i in range(seen - self.size + 1)])
            out[w] = _MAD_SIGMA * float(np.median(np.abs(medians - np.median(medians))))
        return out

    def measurements(self, **kw) -> Measurements:
        """The window as a :class:`Measurements` (medians: a single slow iteration, a
        scheduler hiccup, must not read as a slower worker), with each median's standard
        error (:meth:`noise`)."""
        med = np.nanmedian(self.compute, axis=1)
        logs = np.log(self.compute)
        sigma = float(np.nanmean(np.nanstd(logs, axis=1))) if self.compute.size else 0.0
        agg = np.nanmedian(self.aggregation) if self.agg_count else None
        return Measurements(compute_s=tuple(float(x) for x in med),
                            jitter=round(sigma if math.isfinite(sigma) else 0.0, 4),
                            aggregation_s=None if agg is None else float(agg),
                            compute_noise_s=tuple(round(float(x), 6) for x in self.noise()),
                            **kw)
