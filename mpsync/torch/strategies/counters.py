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
    # Bytes on this worker's link, data plane (model/gradient payloads) and control plane
    # (state-server messages) apart, each way.  The PS's are counted message by message
    # (mps.stats adds its clients' counts); the ring's are what a ring allreduce moves per
    # worker, 2(n-1)/n·B each way (the MPI library's own algorithm is not visible from here).
    data_sent: int = 0
    data_received: int = 0
    control_sent: int = 0
    control_received: int = 0
    # The analytic minimum of data bytes moved (each counted once) for the synchronizations
    # done: ring 2(n-1)/n·B per round, sharded PS 2·B per push+pull (push out, pull in).
    data_min: int = 0
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
            "data_sent": self.data_sent,
            "data_received": self.data_received,
            "control_sent": self.control_sent,
            "control_received": self.control_received,
            "data_min": self.data_min,
            "events": list(self.events),
        }
