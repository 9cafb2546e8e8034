"""Slowdown factors and schedules: how much slower each worker runs, and from when.

The one parser of ``--slowdown`` and ``--slowdown-schedule`` text, shared by the emulated
heterogeneous workers of ``mpsync train`` (:mod:`mpsync.apps.heterogeneity`) and the simulator's
speed models (:mod:`mpsync.simulate`).  A factor f makes a worker's iteration take f times as
long (f >= 1, 1 = full speed); a schedule replaces the factors from a time on (a worker that
slows down or recovers mid-run, the situation DSSP §3 and ElasticBSP §1 adapt to).
"""

from __future__ import annotations

from mpsync.config import ConfigError, parse_float_list

__all__ = ["parse_factors", "parse_schedule", "check_factors"]


def check_factors(flag: str, values: list[float]) -> None:
    """Every factor >= 1, else a :class:`ConfigError` naming ``flag``."""
    bad = [v for v in values if not v >= 1.0]
    if bad:
        raise ConfigError(f"{flag}: factors must be >= 1 (1 = full speed), got {bad[0]}")


def parse_factors(flag: str, text: str, workers: int) -> list[float]:
    """``"1,1,2,4"`` -> one factor >= 1 per worker."""
    values = parse_float_list(flag, text, workers)
    check_factors(flag, values)
    return values


def parse_schedule(text: str, workers: int) -> list[tuple[float, list[float]]]:
    """``"30:1,1,1,4;60:1,1,1,1"`` -> [(30.0, [1,1,1,4]), (60.0, [1,1,1,1])], sorted by time."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        at, sep, factors = part.partition(":")
        if not sep:
            raise ConfigError(f"--slowdown-schedule: {part!r} is not TIME:f0,f1,...")
        try:
            t = float(at)
        except ValueError:
            raise ConfigError(f"--slowdown-schedule: time {at!r} is not a number") from None
        if t < 0:
            raise ConfigError(f"--slowdown-schedule: time {t} < 0")
        out.append((t, parse_factors("--slowdown-schedule", factors, workers)))
    if not out:
        raise ConfigError("--slowdown-schedule: empty")
    return sorted(out, key=lambda e: e[0])
