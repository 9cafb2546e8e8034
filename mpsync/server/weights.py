"""The parameter server's copy of the model (PS topology): one flat float64 vector, the updates
applied to it, and its version.

No MPI here: the serve loop receives a payload, asks this store to take it, and sends what it
returns.  A refused payload leaves the weights as they were, and the reason comes back as text
for the loop's rejection log.
"""

from __future__ import annotations

import numpy as np

__all__ = ["WeightStore"]


class WeightStore:
    """The central weights of the PS topology.

    ``scale`` is the factor every pushed update is applied with, from the policy's registry
    entry (``ps_average``, ``global_step``): 1 applies each worker's update as it is (ASP,
    SSP, DSSP, ElasticBSP, Downpour style); 1/n averages a round's deltas (BSP) and ε/n is
    ESync's Eq. 7-8, where the policy's rules make every delta of a round arrive before
    anyone reads the result and every pull of it happen before the next round's deltas.
    ``version`` counts the updates applied, so a worker can tell how fresh its pull is.
    """

    def __init__(self, scale: float = 1.0):
        self.weights: np.ndarray | None = None
        self.version = 0
        self.scale = float(scale)

    @property
    def ready(self) -> bool:
        """Initialised by the first worker's ``ps_init``; pulls wait until then."""
        return self.weights is not None

    @property
    def size(self) -> int:
        return 0 if self.weights is None else int(self.weights.size)

    def init(self, data: np.ndarray) -> None:
        """The initial weights; the first ``ps_init`` wins (workers start from one broadcast
        model, so later ones carry the same values)."""
        if self.weights is None:
            self.weights = np.array(data, dtype=np.float64)

    def apply(self, update: np.ndarray) -> str | None:
        """Add ``scale * update``; returns None, or why the update was refused."""
        if self.weights is None or update.shape != self.weights.shape:
            return "push before ps_init or of the wrong length"
        if not np.all(np.isfinite(update)):
            return "push with NaN or inf"
        if self.scale == 1.0:
            self.weights += update
        else:
            self.weights += self.scale * update
        self.version += 1
        return None

    def pull_problem(self, count: int) -> str | None:
        """None if a pull of ``count`` values matches the model, else why not."""
        if count != self.size:
            return f"pull of {count} values, the model has {self.size}"
        return None
