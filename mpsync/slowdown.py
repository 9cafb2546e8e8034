"""Slowdown factors and schedules as the command line gives them (``--slowdown 1,1,2,4``,
``--slowdown-schedule "30:1,1,1,4;60:1,1,1,1"``), for the training workers that emulate them
and the simulator that models them alike.

A factor f makes a worker's iteration take f times as long; a schedule replaces the factors
from wall time T seconds on (a worker that slows down or recovers mid-run, the situation
DSSP §3 and ElasticBSP §1 adapt to).
"""

from __future__ import annotations

from mpsync.config import ConfigError, parse_float_list, parse_number

__all__ = ["parse_factors", "parse_schedule", "check_factors"]


def check_factors(flag: str, values: list[float]) -> None:
    bad = [v for v in values if not v >= 1.0]
    if bad:
        raise ConfigError(f"{flag}: factors must be >= 1 (1 = full speed), got {bad[0]}")


def parse_factors(text: str | None, workers: int, flag: str = "--slowdown") -> list[float]:
    """One factor per worker; all 1.0 when ``text`` is empty."""
    factors = parse_float_list(flag, text, workers) if text else [1.0] * workers
    check_factors(flag, factors)
    return factors


def parse_schedule(text: str, workers: int) -> list[tuple[float, list[float]]]:
    """``"30:1,1,1,4;60:1,1,1,1"`` -> [(30.0, [1,1,1,4]), (60.0, [1,1,1,1])], sorted by time."""
    flag = "--slowdown-schedule"
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        at, sep, factors = part.partition(":")
        if not sep:
            raise ConfigError(f"{flag}: {part!r} is not TIME:f0,f1,...")
        out.append((parse_number(f"{flag} time", at, float, at_least=0.0),
                    parse_factors(factors, workers, flag)))
    if not out:
        raise ConfigError(f"{flag}: empty")
    return sorted(out, key=lambda e: e[0])
