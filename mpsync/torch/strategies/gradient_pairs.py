"""A worker's gradient noise for ``auto``: two batches' gradients at the same weights.

The state server's ``auto`` estimates the job's gradient noise scale from them
(``mpsync.auto.noise``).  About once every ``every_s`` seconds the training loop, with this
step's gradients in ``.grad``, lets a closure compute another batch's gradients at the same
weights (``DistributedOptimizer.probe_gradient_noise``; ``mpsync train`` does it with its next
batch): the half squared difference and the dot product of the two are summed until the next
loss report carries them to the server (:meth:`GradientPairs.take`), and the step's own
gradients are put back.  The second batch is not trained on.

Cost: one forward and backward, one copy of the gradients and two reductions over them, once
per ``every_s`` (1 s: a 2% longer step of 50 ms iterations, 0.1% of 1 s ones).  A probe whose
gradients are sparse, missing or of other shapes is not counted.
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["GradientPairs", "PAIR_EVERY_S"]

PAIR_EVERY_S = 1.0


class GradientPairs:
    """Same-weights gradient pairs of ``params`` (a list of tensors), summed."""

    def __init__(self, params, every_s: float = PAIR_EVERY_S, clock=time.perf_counter):
        self.params = list(params)
        self.every_s = float(every_s)
        self.clock = clock
        self._next = 0.0
        self.noise = self.signal = 0.0
        self.pairs = 0

    def _grads(self) -> list[torch.Tensor] | None:
        grads = [p.grad for p in self.params]
        if not grads or any(g is None or g.is_sparse for g in grads):
            return None
        return grads

    def probe(self, second) -> bool:
        """If a probe is due: with this step's gradients in ``.grad``, run ``second()`` (it
        computes another batch's gradients at the same weights: a forward and
        ``backward()``), sum the pair, and put this step's gradients back.  False (``second``
        not run) when none is due or there are no dense gradients to pair."""
        if self.clock() < self._next:
            return False
        grads = self._grads()
        if grads is None:
            return False
        self._next = self.clock() + self.every_s
        with torch.no_grad():
            first = [g.detach().clone() for g in grads]
            for g in grads:
                g.zero_()        # (in place: gradients bound into a fusion buffer stay so)
        try:
            second()
            other = self._grads()
            if other is None or any(a.shape != g.shape for a, g in zip(first, other)):
                return False
            with torch.no_grad():
                dots, squares = [], []
                for a, g in zip(first, other):
                    a, g = a.reshape(-1), g.reshape(-1)
                    if a.dtype in (torch.float16, torch.bfloat16):
                        a, g = a.float(), g.float()
                    dots.append(torch.dot(a, g).double())
                    d = a - g
                    squares.append(torch.dot(d, d).double())
                # One read of both sums (on a GPU: one copy to the host).
                signal, square = torch.stack([torch.stack(dots).sum(),
                                              torch.stack(squares).sum()]).tolist()
        finally:
            with torch.no_grad():
                for p, saved in zip(self.params, first):
                    if p.grad is None or p.grad.is_sparse or p.grad.shape != saved.shape:
                        p.grad = saved
                    else:
                        p.grad.copy_(saved)
        if not (math.isfinite(signal) and math.isfinite(square)):
            return False
        self.signal += signal
        self.noise += square / 2.0
        self.pairs += 1
        return True

    def take(self) -> tuple[float, float, int]:
        """(summed ½|g₁ - g₂|², summed g₁ · g₂, pairs) since the last take; reset."""
        out = (self.noise, self.signal, self.pairs)
        self.noise = self.signal = 0.0
        self.pairs = 0
        return out
