"""A worker's gradient noise for ``auto``: two consecutive steps' gradients, now and then.

The state server's ``auto`` estimates the job's gradient noise scale from them
(``mpsync.auto.noise``: what is measured and why consecutive steps).  Here: every ``every_s``
seconds the gradients at a step's start are copied (before any aggregation touches them:
the worker's own, of its own batch), and at the next step's start set beside that step's
gradients: the half squared difference and the dot product are summed until the next loss
report carries them to the server (:meth:`GradientPairs.take`).

Cost: one copy of the gradients held for one step, and two reductions over them, once per
``every_s`` (0.2 s: with a 10 ms step, 1 step in 20).  A step whose gradients are sparse,
missing or of another shape than the copy's is skipped, not measured.
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["GradientPairs", "PAIR_EVERY_S"]

PAIR_EVERY_S = 0.2


class GradientPairs:
    """Consecutive-step gradient pairs of ``params`` (a list of tensors), summed."""

    def __init__(self, params, every_s: float = PAIR_EVERY_S, clock=time.perf_counter):
        self.params = list(params)
        self.every_s = float(every_s)
        self.clock = clock
        self._first: list[torch.Tensor] | None = None
        self._next = 0.0
        self.noise = self.signal = 0.0
        self.pairs = 0

    def _grads(self) -> list[torch.Tensor] | None:
        grads = [p.grad for p in self.params]
        if not grads or any(g is None or g.is_sparse for g in grads):
            return None
        return grads

    def observe(self) -> None:
        """At a step's start, before its aggregation: the first half of a pair, or its
        second (then the pair is summed)."""
        if self._first is None and self.clock() < self._next:
            return
        grads = self._grads()
        if grads is None:
            self._first = None
            return
        with torch.no_grad():
            if self._first is None:
                self._first = [g.detach().clone() for g in grads]
                return
            first, self._first = self._first, None
            self._next = self.clock() + self.every_s
            if any(a.shape != g.shape for a, g in zip(first, grads)):
                return
            dots, squares = [], []
            for a, g in zip(first, grads):
                a, g = a.reshape(-1), g.reshape(-1)
                if a.dtype in (torch.float16, torch.bfloat16):
                    a, g = a.float(), g.float()
                dots.append(torch.dot(a, g).double())
                a.sub_(g)
                squares.append(torch.dot(a, a).double())
            # One read of both sums (on a GPU: one copy to the host).
            signal, square = torch.stack([torch.stack(dots).sum(),
                                          torch.stack(squares).sum()]).tolist()
        if math.isfinite(signal) and math.isfinite(square):
            self.signal += signal
            self.noise += square / 2.0
            self.pairs += 1

    def take(self) -> tuple[float, float, int]:
        """(summed ½|g₁ - g₂|², summed g₁ · g₂, pairs) since the last take; reset."""
        out = (self.noise, self.signal, self.pairs)
        self.noise = self.signal = 0.0
        self.pairs = 0
        return out
