"""The cost model: what an aggregation, a server query and the parameter server's work cost
on the virtual clock.

Ring allreduce of ``B`` bytes among ``n`` workers (reduce-scatter then all-gather, 2(n-1)
steps, each moving B/n bytes per link):

    T_ring(n) = 2(n-1)/n * B / bandwidth + 2(n-1) * latency

Parameter server with ``S`` shards (``ps_shards``): the flat model is split into S pieces of
B/S bytes, each held by a shard server behind its own link; a push sends every piece at once
(and a pull fetches every piece at once).  A shard serves the pieces that reach it one at a
time in arrival order (a FIFO queue): receiving a pushed piece and applying it to its weights,
or sending a pulled piece, each take

    T_push_piece = (B/S) / bandwidth + latency + (B/S) / apply_rate
    T_pull_piece = (B/S) / bandwidth + latency

The apply term is the server's own work on an update, in proportion to its bytes: the ZipLine
paper (§6.2.2) names the server's processing of the pushes that queue at it as what slows ASP,
SSP and DSSP on a parameter server.  What that work is depends on who runs the optimizer
(``ps_optimizer``, :mod:`mpsync.server.shard_optimizer`):

    worker                   (B/S) / apply_rate         add the pushed delta
    server, per push         (B/S) / optimizer_rate     an optimizer step on the gradient
    server, per round of m   (B/S) / apply_rate + (B/S) / optimizer_rate / m
                             merge each push; one step per round, its cost spread over the
                             round's m pushes (BSP: m = n)

An optimizer step reads and writes its state as well as the weights (Adam: about eight passes
over the range where an add is two), so with the server's optimizer the shards saturate at
fewer workers: ``shard_busy_fraction`` in a simulated row (time a shard spends serving / the
run's time) near 1 says that the server is the bottleneck.  Every shard sees the same requests in the same order, so
one queue of piece service times stands for all S of them.  The worker's own link bounds it
from below: a push or pull is done no sooner than B / bandwidth + latency after it started.
n workers pushing at once finish after about n * T_push_piece: with one shard the PS
bottleneck (n * B through one link), with S = n shards about one model per link, as the ring.

A server query (a step report and its reply) costs ``query`` seconds round trip, half each
way; the state server's decisions are taken as instantaneous (``decisions_per_s`` in the
output says how fast a real server must be for that to hold).

``fixed_aggregation`` replaces T_ring / the PS transfers by a measured per-round cost (what a
replayed trace measured), for validation against the run the trace came from.  A measured cost
is taken as a latency each worker pays, not as a queue the workers wait in
(``shared_link`` False): on one host a push of a small model is a memory copy (~0.1 ms for
150 KB) and the 10-30 ms measured per push+pull are process scheduling on an oversubscribed
CPU, which workers do not pay one after the other; the server's apply of such an update is
inside the measured figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpsync.config import ConfigError

__all__ = ["CostModel", "parse_rate"]

# A shard server's apply rate unless told (bytes of update per second; see CostModel): the
# server's own ``WeightStore.apply`` of a 100 MB float64 update took 3.1 GB/s with a scale
# (averaging policies) and 6.3 GB/s without, medians of 7 on this 2-core machine under load.
APPLY_RATE = 3e9
# A shard's optimizer step (bytes of its range per second; see CostModel): the server-side
# Adam (``ServerUpdates`` per push) on a 4.35 MB float32 range took 6.77 ms (0.64 GB/s) beside
# 1.38 ms for adding a delta, medians on an otherwise idle 16-core Xeon (bench/psopt).
OPTIMIZER_RATE = 0.65e9
PS_OPTIMIZERS = ("worker", "server")

_UNITS = {"": 1.0, "b": 1.0, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9}


def parse_rate(text: str | float, what: str) -> float:
    """``"10G"``, ``"1.25GB"``, ``"5e8"`` -> bytes (per second); bits are not guessed at."""
    if isinstance(text, (int, float)):
        v = float(text)
    else:
        s = text.strip().lower().removesuffix("/s")
        num = s.rstrip("kmgb")
        unit = s[len(num):]
        if unit not in _UNITS:
            raise ConfigError(f"{what}: unknown unit in {text!r} (use K, M, G: bytes)")
        try:
            v = float(num) * _UNITS[unit]
        except ValueError:
            raise ConfigError(f"{what}: {text!r} is not a number") from None
    if not v > 0:
        raise ConfigError(f"{what} must be > 0, got {text!r}")
    return v


@dataclass
class CostModel:
    model_bytes: float = 100e6       # B: bytes of the model (or gradients) per worker
    bandwidth: float = 1.25e9        # bytes/s per link (10 Gbit/s)
    latency: float = 5e-6            # seconds per ring step / per PS message
    query: float = 100e-6            # server query round trip, seconds
    fixed_aggregation: float | None = None   # measured cost per round, replaces the model
    ps_shards: int = 1               # S: shard servers of the parameter server, a link each
    # bytes/s a shard server applies a pushed update at (its own work per push)
    apply_rate: float = APPLY_RATE
    # bytes/s a shard runs the optimizer at, when it runs it (ps_optimizer "server")
    optimizer_rate: float = OPTIMIZER_RATE
    ps_optimizer: str = "worker"
    # pushes merged before one optimizer step on the server (BSP's round: the n workers)
    round_pushes: int = 1

    def __post_init__(self):
        if isinstance(self.ps_shards, bool) or not isinstance(self.ps_shards, int) or \
                self.ps_shards < 1:
            raise ConfigError(f"ps_shards must be an integer >= 1, got {self.ps_shards!r}")
        if self.ps_optimizer not in PS_OPTIMIZERS:
            raise ConfigError(f"ps_optimizer must be one of {', '.join(PS_OPTIMIZERS)}, got "
                              f"{self.ps_optimizer!r}")
        if isinstance(self.round_pushes, bool) or not isinstance(self.round_pushes, int) or \
                self.round_pushes < 1:
            raise ConfigError(f"round_pushes must be an integer >= 1, got {self.round_pushes!r}")
        for name in ("model_bytes", "bandwidth", "apply_rate", "optimizer_rate"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("latency", "query"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.fixed_aggregation is not None and not self.fixed_aggregation >= 0:
            raise ConfigError(f"fixed aggregation cost must be >= 0, got {self.fixed_aggregation}")

    def ring(self, n: int, fraction: float = 1.0) -> float:
        """One ring allreduce of ``fraction`` of the model among ``n`` workers."""
        if self.fixed_aggregation is not None:
            return self.fixed_aggregation * fraction
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * fraction * self.model_bytes / self.bandwidth + \
            2 * (n - 1) * self.latency

    @property
    def shared_link(self) -> bool:
        """Do PS transfers queue for the server's link (the model) or not (a measured cost)?"""
        return self.fixed_aggregation is None

    def link(self) -> float:
        """One pull: a shard's service of its piece (half a measured push+pull)."""
        if self.fixed_aggregation is not None:
            return self.fixed_aggregation / 2
        return self.model_bytes / self.ps_shards / self.bandwidth + self.latency

    def for_run(self, config, n_workers: int) -> "CostModel":
        """This model for ``config``'s run: who runs the optimizer (``config.ps_optimizer``)
        and, for a policy whose server completes rounds (``ps_average``: BSP), how many
        pushes one optimizer step merges."""
        from dataclasses import replace

        rounds = config.resolved().spec.ps_average
        return replace(self, ps_optimizer=config.ps_optimizer,
                       round_pushes=max(1, int(n_workers)) if rounds else 1)

    def server_update(self) -> float:
        """A shard's own work on one pushed piece (module doc's table)."""
        piece = self.model_bytes / self.ps_shards
        if self.ps_optimizer == "worker":
            return piece / self.apply_rate
        if self.round_pushes == 1:
            return piece / self.optimizer_rate
        return piece / self.apply_rate + piece / self.optimizer_rate / self.round_pushes

    def push(self) -> float:
        """One push: a shard receives its piece and applies it (half a measured push+pull)."""
        if self.fixed_aggregation is not None:
            return self.fixed_aggregation / 2
        return self.link() + self.server_update()

    def worker_link(self) -> float:
        """The least time a push or a pull takes: the whole model through the worker's link
        (0 with a measured cost, which is the whole of it)."""
        if self.fixed_aggregation is not None:
            return 0.0
        return self.model_bytes / self.bandwidth + self.latency

    def describe(self) -> dict:
        return {"model_bytes": self.model_bytes, "bandwidth_bytes_per_s": self.bandwidth,
                "latency_s": self.latency, "query_rtt_s": self.query,
                "fixed_aggregation_s": self.fixed_aggregation, "ps_shards": self.ps_shards,
                "apply_rate_bytes_per_s": self.apply_rate,
                "optimizer_rate_bytes_per_s": self.optimizer_rate,
                "ps_optimizer": self.ps_optimizer, "round_pushes": self.round_pushes}
