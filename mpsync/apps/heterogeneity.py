"""Emulated heterogeneous workers: slowdown factors, schedules and communication delay.

A factor f makes a worker's iteration take f times as long.  With an emulated device time
``iter_time`` T the iteration is padded to f*T (sleep f*T - measured compute, never negative):
the real compute of a tiny model on an oversubscribed CPU is noisy and small, so a fixed device
time keeps the ratio between workers what was asked for.  Without ``iter_time`` the worker
sleeps (f-1) x its measured compute time.

``--slowdown-schedule "T:f0,f1,..;T2:.."`` replaces the factors from wall time T seconds on
(both parsed by :mod:`mpsync.slowdown`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mpsync.config import ConfigError
from mpsync.slowdown import parse_factors, parse_schedule

__all__ = ["Heterogeneity"]


@dataclass
class Heterogeneity:
    worker: int
    factors: list[float]
    schedule: list[tuple[float, list[float]]] = field(default_factory=list)
    iter_time: float | None = None
    comm_delay: float = 0.0
    slept_s: float = 0.0

    @classmethod
    def from_flags(cls, worker: int, workers: int, slowdown: str | None, schedule: str | None,
                   iter_time: float | None, comm_delay: float) -> "Heterogeneity":
        factors = parse_factors(slowdown, workers)
        if iter_time is not None and not iter_time > 0:
            raise ConfigError(f"--iter-time must be > 0 seconds, got {iter_time}")
        if comm_delay < 0:
            raise ConfigError(f"--comm-delay must be >= 0 seconds, got {comm_delay}")
        return cls(worker, factors, parse_schedule(schedule, workers) if schedule else [],
                   iter_time, comm_delay)

    def factor(self, elapsed: float) -> float:
        f = self.factors
        for at, values in self.schedule:
            if elapsed >= at:
                f = values
        return f[self.worker]

    def pad(self, compute_s: float, elapsed: float) -> float:
        """Sleep so this iteration lasts as a worker of the current factor; returns the sleep."""
        f = self.factor(elapsed)
        target = f * self.iter_time if self.iter_time is not None else f * compute_s
        pause = max(0.0, target - compute_s)
        if pause > 0:
            time.sleep(pause)
            self.slept_s += pause
        return pause

    def describe(self) -> str:
        base = (f"iteration = factor x {self.iter_time * 1000:.0f} ms emulated device time"
                if self.iter_time is not None else "iteration = factor x measured compute")
        text = f"slowdown {','.join(f'{v:g}' for v in self.factors)} ({base})"
        if self.schedule:
            text += "; schedule " + "; ".join(
                f"from {t:g}s: {','.join(f'{v:g}' for v in vals)}" for t, vals in self.schedule)
        if self.comm_delay:
            text += f"; +{self.comm_delay * 1000:.0f} ms per aggregation"
        return text
