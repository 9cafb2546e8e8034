"""This worker's own counters, reported by ``mps.stats()["local"]``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["LocalCounters"]


@dataclass
class LocalCounters:
    iterations: int = 0      # optimizer steps (local or synchronized)
    rounds: int = 0          # aggregations this worker took part in
    compute_s: float = 0.0   # time between steps: forward, backward, data, emulated slowdown
    wait_s: float = 0.0      # waiting for the state server (decisions, importance bitmaps)
    aggregation_s: float = 0.0  # allreduce / push+pull / broadcast of the model
    bytes_sent: int = 0      # payload this worker contributed to aggregations
    max_events: int = 100_000
    # (name, t0, t1) on the wall clock (time.time()), for the Chrome trace.
    events: list = field(default_factory=list)

    def event(self, name: str, t0: float, t1: float) -> None:
        """Record a span measured with ``time.perf_counter`` as wall-clock times."""
        if len(self.events) < self.max_events:
            shift = time.time() - time.perf_counter()
            self.events.append((name, t0 + shift, t1 + shift))

    def as_dict(self) -> dict:
        return {
            "iterations": self.iterations,
            "rounds": self.rounds,
            "compute_s": self.compute_s,
            "wait_s": self.wait_s,
            "aggregation_s": self.aggregation_s,
            "bytes_sent": self.bytes_sent,
            "events": list(self.events),
        }
