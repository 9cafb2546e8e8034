"""What the simulated training reports besides its timing: epochs, losses, layers.

OSP's Alg. 1 sizes the In-Computation Sync from the training's progress: S(G^u) = 0 in epoch
1, then (1 - loss_i / L)·U_max, with L the loss of epoch 1 and U_max from Eq. 5 (OSP paper
§4.1-4.2); the bitmap picks whole layers (§3.2).  A virtual cluster trains nothing, so a
:class:`TrainingModel` states what the workers would report: how many iterations an epoch has,
the mean loss of each epoch (given, or falling by ``loss_decay`` per epoch), and the model's
layers (``layers`` of equal size; OSP moves whole layers).  Replaying a real run, the epochs and
losses come from its metrics (``from_trace``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpsync import sched
from mpsync.config import ConfigError
from mpsync.sched._numba import jit

__all__ = ["TrainingModel"]


@dataclass(frozen=True)
class TrainingModel:
    epoch_iterations: int = 100      # iterations of one worker per epoch
    loss_decay: float = 0.2          # the mean loss falls by this fraction per epoch
    losses: tuple = ()               # mean loss of epochs 1, 2, ... (the last one repeats)
    layers: int = 10                 # equal layers the model is made of
    itemsize: int = 4                # bytes per model element (float32)

    def __post_init__(self):
        if isinstance(self.epoch_iterations, bool) or not isinstance(self.epoch_iterations, int) \
                or self.epoch_iterations < 1:
            raise ConfigError(f"epoch iterations must be an integer >= 1, got "
                              f"{self.epoch_iterations!r}")
        if not 0.0 <= self.loss_decay < 1.0:
            raise ConfigError(f"loss decay must be in [0, 1), got {self.loss_decay!r}")
        if any(not (math.isfinite(v) and v >= 0) for v in self.losses):
            raise ConfigError("losses must be finite and >= 0")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ConfigError(f"layers must be an integer >= 1, got {self.layers!r}")

    def epoch(self, k: int) -> int:
        """The 1-based epoch of a worker's 1-based iteration ``k``."""
        return (int(k) - 1) // self.epoch_iterations + 1

    def loss(self, epoch: int) -> float:
        if self.losses:
            return float(self.losses[min(epoch, len(self.losses)) - 1])
        return (1.0 - self.loss_decay) ** (epoch - 1)

    def layer_sizes(self, model_bytes: float) -> np.ndarray:
        elements = max(int(model_bytes // self.itemsize), self.layers)
        sizes = np.full(self.layers, elements // self.layers, dtype=np.float64)
        sizes[: elements % self.layers] += 1
        return sizes

    def u_max(self, rate_bytes_s: float, t_compute: float, n: int) -> float:
        """Eq. 5's U_max in model elements for a worker computing ``t_compute`` seconds per
        iteration, the aggregation moving ``rate_bytes_s`` per worker (an allreduce of S bytes
        in T seconds among N workers moved N·S bytes through a PS link: b = N·S/T); the same
        kernel (``sched.osp_ics_budget``) and reading the workers use, lr = 0, cap left to
        the server."""
        if not (rate_bytes_s > 0 and t_compute > 0):
            return 0.0
        return float(sched.osp_ics_budget(n * rate_bytes_s / self.itemsize, 0.0, t_compute,
                                          max(n, 1), np.inf))

    def u_max_all(self, rate_bytes_s: float, t_compute: np.ndarray, n: int) -> np.ndarray:
        """:meth:`u_max` of every worker's ``t_compute`` at once (the same kernel, compiled
        over the array: one Python call per round instead of one per worker)."""
        if not rate_bytes_s > 0:
            return np.zeros(t_compute.shape[0])
        return _ics_budgets(n * rate_bytes_s / self.itemsize, np.asarray(t_compute, np.float64),
                            max(n, 1))

    @classmethod
    def from_trace(cls, trace: dict, **kw) -> "TrainingModel":
        """Epoch length and per-epoch losses of a replayed run (``read_trace``)."""
        if trace.get("epoch_iterations"):
            kw.setdefault("epoch_iterations", int(trace["epoch_iterations"]))
        if trace.get("losses"):
            kw.setdefault("losses", tuple(trace["losses"]))
        return cls(**kw)


@jit
def _ics_budgets(bandwidth, t_compute, n):
    out = np.zeros(t_compute.shape[0])
    for i in range(t_compute.shape[0]):
        if t_compute[i] > 0:
            out[i] = sched.osp_ics_budget(bandwidth, 0.0, t_compute[i], n, np.inf)
    return out
