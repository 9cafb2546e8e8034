"""Speed models: how long each worker's iterations take on the virtual clock.

A :class:`SpeedModel` holds each worker's base iteration time (seconds), an optional
per-iteration jitter (lognormal, coefficient of variation ``jitter``, or factors drawn from a
measured ``spread``) and an optional slowdown
schedule (``[(t, factors)]``, factors >= 1 from virtual time t on, the same format as
``mpsync train --slowdown-schedule``).

SPEC strings (``parse_speeds``):

``lognormal:SIGMA``           base_w = iter_time * exp(N(0, SIGMA^2)), seeded
``groups:1x256,1.5x128,3x128``  factor x count: 256 workers at iter_time, 128 at 1.5x, 128 at 3x
                               (another --workers keeps these proportions)
``trace:FILE``                 the per-worker iteration times measured by a real run: the
                               ``metrics.json`` of ``mpsync train`` (compute_s / iterations per
                               worker; the wall time, aggregation and query costs it measured are
                               kept in ``trace`` for the cost model)
``const``                      every worker at iter_time
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpsync.config import ConfigError, SyncConfig
from mpsync.simulate._events import worker_behaviour
from mpsync.slowdown import parse_schedule

__all__ = ["SpeedModel", "parse_speeds", "read_trace"]


@dataclass
class SpeedModel:
    base: np.ndarray                      # float64[n] seconds per iteration at factor 1
    jitter: float = 0.0                   # per-iteration lognormal sigma
    schedule: list = field(default_factory=list)  # [(t, float64[n] factors)], sorted by t
    seed: int = 0
    trace: dict | None = None             # the run a trace: SPEC came from
    label: str = ""
    pause: np.ndarray | None = None       # seconds per iteration outside the phases (replay)
    # measured per-iteration factors (mean 1) drawn from instead of the lognormal (replay)
    spread: np.ndarray | None = None

    def __post_init__(self):
        self.base = np.asarray(self.base, dtype=np.float64)
        if self.base.ndim != 1 or self.base.size < 1 or not np.all(self.base > 0):
            raise ConfigError("speeds: every worker needs an iteration time > 0")
        self.schedule = [(float(t), np.asarray(f, dtype=np.float64)) for t, f in self.schedule]
        for t, f in self.schedule:
            if f.shape != self.base.shape:
                raise ConfigError(f"slowdown schedule at {t:g}s has {f.size} factors for "
                                  f"{self.base.size} workers")
        if self.pause is not None:
            self.pause = np.asarray(self.pause, dtype=np.float64)
            if self.pause.shape != self.base.shape or np.any(self.pause < 0):
                raise ConfigError("pause: one value >= 0 per worker")
        if self.spread is not None:
            self.spread = np.asarray(self.spread, dtype=np.float64)
            if self.spread.ndim != 1 or self.spread.size < 1 or np.any(self.spread <= 0):
                raise ConfigError("spread: one or more factors > 0")
        self.rng = np.random.default_rng([self.seed, 7])

    @property
    def n(self) -> int:
        return self.base.size

    def factors_at(self, t):
        """Slowdown factor of every worker at virtual time(s) ``t`` (scalar or float64[n])."""
        f = np.ones(self.n)
        if not self.schedule:
            return f
        t = np.broadcast_to(np.asarray(t, dtype=np.float64), (self.n,))
        for at, values in self.schedule:
            f = np.where(t >= at, values, f)
        return f

    def times(self, start, idx=None) -> np.ndarray:
        """One iteration of every worker (or of workers ``idx``), each starting at ``start``
        (float64 of the same length)."""
        base = self.base if idx is None else self.base[idx]
        if self.schedule:
            f = np.ones(base.size)
            for at, values in self.schedule:
                f = np.where(start >= at, values if idx is None else values[idx], f)
            c = base * f
        else:
            c = base.copy()
        if self.spread is not None:
            c *= self.rng.choice(self.spread, base.size)
        elif self.jitter > 0:
            c *= self.rng.lognormal(-0.5 * self.jitter ** 2, self.jitter, base.size)
        return c

    def time_of(self, w: int, start: float) -> float:
        """One iteration of worker ``w`` starting at ``start`` (the event engine's draw)."""
        c = float(self.base[w])
        for at, values in self.schedule:
            if start >= at:
                c = float(self.base[w] * values[w])
        if self.spread is not None:
            c *= float(self.spread[self.rng.integers(self.spread.size)])
        elif self.jitter > 0:
            c *= float(self.rng.lognormal(-0.5 * self.jitter ** 2, self.jitter))
        return c


def read_trace(path: str | Path) -> dict:
    """Per-worker iteration times and the costs a real run measured (``metrics.json``)."""
    try:
        m = json.loads(Path(path).read_text())
        workers = [m["workers"][k] for k in sorted(m["workers"], key=int)]
        base = [w["compute_s"] / w["iterations"] for w in workers]
    except (OSError, ValueError, KeyError, ZeroDivisionError, TypeError) as e:
        raise ConfigError(f"trace {path}: not a metrics.json of mpsync train with "
                          f"per-worker compute_s and iterations ({type(e).__name__}: {e})") \
            from None
    rounds = [max(w["rounds"], 1) for w in workers]
    if _pushes_every_step(m.get("config", {})):
        rounds = [max(w["iterations"], 1) for w in workers]   # a push-pull per iteration
    aggregation = min(w["aggregation_s"] / r for w, r in zip(workers, rounds))
    if m.get("config", {}).get("topology") == "ps":
        # A PS worker's aggregation counter mixes its transfers with the time its pulls were
        # held (the staleness rule, ElasticBSP's barrier, ESync's round), which the replay
        # applies itself; the run's timeline has each push and pull apart: a typical one is
        # the median, and the least over workers is the one that waited least.
        aggregation = _median_transfer(Path(path).with_name("trace.json")) or aggregation
    jitter, spread = _spread_from_events(m.get("server", {}).get("events") or [])
    iters = [max(w["iterations"], 1) for w in workers]
    cfg = m.get("config", {})
    # Each worker's counters book compute, server waits and aggregation; what they miss
    # (worker 0's evaluations, which wall_s also leaves out, the loop's own work) shows as a
    # worker booking less time than the others.  The span the run trained for is the most any
    # worker booked; the rest of each worker's span is a pause per iteration in a replay.
    busy = [w["compute_s"] + w["wait_s"] + w["aggregation_s"] for w in workers]
    span = max(busy)
    return {
        "path": str(path), "base": base, "policy": cfg.get("policy"), "config": cfg,
        "topology": cfg.get("topology"), "wall_s": m.get("wall_s"),
        "batch_size": cfg.get("batch_size"), "samples_per_s": m.get("samples_per_s"),
        "wait_fraction": m.get("wait_fraction"), "slowdown_schedule": cfg.get("slowdown_schedule"),
        # The worker that waits least for its peers shows the aggregation's own cost.
        "aggregation_s": aggregation,
        "query_s": float(np.median([w["wait_s"] / k for w, k in zip(workers, iters)])),
        "iterations": iters, "workers": len(workers), "jitter": jitter, "spread": spread,
        "span_s": span, "pause": [max(0.0, span - b) / k for b, k in zip(busy, iters)],
        "samples": sum(w.get("samples", 0) for w in workers),
        **_progress(m, cfg, len(workers)),
    }


def _median_transfer(trace_json: Path) -> float | None:
    """The least, over workers, of the median duration of their aggregations in the run's
    timeline (``trace.json`` of ``mpsync train``): one push and pull without waiting."""
    try:
        events = json.loads(trace_json.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    per_worker: dict = {}
    for e in events:
        if e.get("name") == "aggregate" and e.get("ph") == "X":
            per_worker.setdefault(e.get("tid"), []).append(float(e["dur"]) / 1e6)
    medians = [float(np.median(v)) for v in per_worker.values() if len(v) >= 10]
    return min(medians) if medians else None


def _pushes_every_step(cfg: dict) -> bool:
    try:
        config = SyncConfig(policy=cfg.get("policy"), topology=cfg.get("topology") or "")
        return worker_behaviour(config.validate())["push_every_step"]
    except ValueError:      # a policy this installation does not know: plain rounds
        return False


def _progress(m: dict, cfg: dict, n: int) -> dict:
    """The run's epoch length (iterations per worker) and mean loss per epoch, from its
    evaluations (what OSP's Alg. 1 sizes the In-Computation Sync from); {} if not recorded."""
    train, batch = cfg.get("train_samples"), cfg.get("batch_size")
    if not (train and batch and n):
        return {}
    per_epoch: dict = {}
    for e in m.get("evals") or []:
        if e.get("loss") is not None and e.get("samples") is not None:
            per_epoch.setdefault(int(e["samples"] // train) + 1, []).append(float(e["loss"]))
    losses, last = [], None
    for epoch in range(1, max(per_epoch, default=0) + 1):
        last = float(np.mean(per_epoch[epoch])) if epoch in per_epoch else last
        if last is not None:
            losses.append(last)
    return {"epoch_iterations": max(int(train // n // batch), 1), "losses": losses}


def _spread_from_events(events: list) -> tuple[float | None, list | None]:
    """The spread of iteration times a run's server saw, from the intervals between a worker's
    consecutive reports with a LOCAL answer in between (one iteration plus one query each):
    each interval over its worker's mean, pooled over the workers with at least 10 such
    intervals; factors outside [0.5, 2] are left out (an idle iteration of a joined worker, an
    evaluation: other phases, not iteration noise).  Returns the standard deviation of their
    log and the factors themselves (rescaled to mean 1: the base times are the means), or
    (None, None) when the run has none (policies that synchronize every iteration).  The
    factors are replayed as they are: iteration times here are mostly regular with a heavy
    tail (a log-std several times the median absolute deviation), which a lognormal of the
    same log-std does not reproduce."""
    last: dict = {}
    intervals: dict = {}
    for t, w, kind, _ in events:
        if kind == "report":
            if last.get(w) is not None:
                intervals.setdefault(w, []).append(t - last[w])
            last[w] = t
        else:
            last[w] = None
    factors = [np.asarray(v) / np.mean(v) for v in intervals.values()
               if len(v) >= 10 and min(v) > 0]
    if not factors:
        return None, None
    f = np.concatenate(factors)
    f = f[(f >= 0.5) & (f <= 2.0)]
    if f.size < 10:
        return None, None
    f = f / f.mean()
    return float(np.std(np.log(f))), f.tolist()


def _positive(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ConfigError(f"--speeds: {what} {text!r} is not a number") from None
    if not v > 0:
        raise ConfigError(f"--speeds: {what} must be > 0, got {v:g}")
    return v


def parse_speeds(spec: str, workers: int | None, iter_time: float = 0.1, seed: int = 0,
                 jitter: float | None = None, schedule: str | None = None,
                 spread=None) -> SpeedModel:
    """A :class:`SpeedModel` from a SPEC string (module doc); ``workers`` None: from the SPEC;
    ``jitter`` None: the trace's measured spread for ``trace:`` (its factors, ``spread``),
    else none; ``spread``: per-iteration factors to draw from instead."""
    kind, _, arg = spec.partition(":")
    trace = None
    if kind == "lognormal":
        sigma = float(arg) if arg else 0.3
        if not sigma >= 0:
            raise ConfigError(f"--speeds lognormal: sigma must be >= 0, got {arg!r}")
        if workers is None:
            raise ConfigError("--speeds lognormal needs --workers")
        base = iter_time * np.random.default_rng([seed, 1]).lognormal(0.0, sigma, workers)
    elif kind == "groups":
        factors, counts = [], []
        for part in filter(None, (p.strip() for p in arg.split(","))):
            f, sep, count = part.partition("x")
            if not sep:
                raise ConfigError(f"--speeds groups: {part!r} is not FACTORxCOUNT")
            try:
                c = int(count)
            except ValueError:
                raise ConfigError(f"--speeds groups: count {count!r} is not an integer") from None
            if c < 1:
                raise ConfigError(f"--speeds groups: count must be >= 1, got {c}")
            factors.append(_positive(f, "factor"))
            counts.append(c)
        if not counts:
            raise ConfigError("--speeds groups: no groups given")
        if workers is not None and workers != sum(counts):
            # a sweep over N keeps the groups' proportions
            if workers < len(counts):
                raise ConfigError(f"--speeds groups: {len(counts)} groups need at least as "
                                  f"many workers, --workers says {workers}")
            scaled = [max(1, round(c * workers / sum(counts))) for c in counts]
            scaled[int(np.argmax(scaled))] += workers - sum(scaled)
            counts = scaled
        base = np.repeat(iter_time * np.array(factors), counts)
    elif kind == "trace":
        trace = read_trace(arg)
        base = np.array(trace["base"])
        if workers is not None and workers != base.size:
            if workers % base.size:
                raise ConfigError(f"--speeds trace: {workers} workers is not a multiple of the "
                                  f"trace's {base.size}")
            base = np.tile(base, workers // base.size)
    elif kind == "const":
        if workers is None:
            raise ConfigError("--speeds const needs --workers")
        base = np.full(workers, iter_time)
    else:
        raise ConfigError(f"--speeds: unknown kind {kind!r} (lognormal:SIGMA, "
                          f"groups:FxN,..., trace:FILE, const)")
    sched = []
    if schedule:
        sched = parse_schedule(schedule, len(base))
    if jitter is None:
        jitter = (trace or {}).get("jitter") or 0.0
        if spread is None:
            spread = (trace or {}).get("spread")
    if not jitter >= 0:
        raise ConfigError(f"--jitter must be >= 0, got {jitter}")
    return SpeedModel(base, jitter=jitter, schedule=sched, seed=seed, trace=trace, label=spec,
                      spread=spread)
