"""A worker's gradient noise for ``auto``: two batches' gradients at the same weights.

The state server's ``auto`` estimates the job's gradient noise scale from them
(``mpsync.auto.noise``).  About once every ``every_s`` seconds the training loop, with this
step's gradients in ``.grad``, lets a closure compute another batch's gradients at the same
weights (``DistributedOptimizer.probe_gradient_noise``; ``mpsync train`` does it with its next
batch): the half squared difference and the dot product of the two are summed until the next
loss report carries them to the server (:meth:`GradientPairs.take`), and the step's own
gradients are put back.  The second batch is not trained on.

Cost: one forward and backward (two with the step test), one copy of the gradients and two
reductions over them, once per ``every_s`` (the first ``FIRST_PROBES`` every
``FIRST_EVERY_S``), and never more than a share of the worker's time: after a probe that took
``d`` seconds the next waits at least ``d (1 - share) / share`` (``PROBE_SHARE``,
``FIRST_PROBE_SHARE`` for the first probes).  The periods alone charged a large model in
proportion to its step: a probe of two forward and backward passes every second costs a model
with 0.3 s steps about 40% of its time.  The shares are set above what the jobs ``auto`` was
tried on pay (the wide MLP, 5 ranks on 2 cores: about 60 ms a probe, 6% of the time at 1 s,
24% at 0.25 s), so their schedule is the periods'.  A probe whose gradients are sparse,
missing or of other shapes is not counted.

The step test (``mpsync.auto.curvature``), where the closure returns its loss and the
optimizer is SGD: the second batch's loss is taken once more, ``steps_ahead`` of this
worker's own steps ahead, at ``w + k·u₁`` with ``u₁ = -ε g₁`` (``ε`` each parameter's
effective step: the learning rate over ``1 - momentum``, :func:`sgd_step_sizes`).  The
parameter server applies the n workers' updates in full, each computed ``n - 1`` updates
before it is applied: a round moves the model about ``n`` steps from nearly the same weights,
and whether the loss still falls along such a stride is what the noise scale cannot see.
Summed per pair: ``p = ε g₁ · g₂`` (the fall the slope predicts for one step, measured on the
independent batch), ``a = ε (|g₁|² + |g₂|²) / 2`` (its expected square norm, noise
included), and ``q = 2 (L₂(w + k u₁) - L₂(w) + k p) / k²`` (the curvature along the step,
``u₁ᵀ H u₁`` for a quadratic loss).  One more forward and backward; the weights are restored
bit for bit from a copy (the ring's replicas must stay equal).  Weight decay is left out of
``u₁``.  Other optimizers are not tested: with Adam the step is the preconditioned one, and a
trial on the digits read no gain for a job whose parameter server was 1.7x faster.  A worker
whose optimizer is another (``adaptive``: its steps are preconditioned) says so once, and the
server ranks the noise scale's gain without the cap it puts on SGD's
(``mpsync.auto.efficiency``).
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["GradientPairs", "PAIR_EVERY_S", "FIRST_PROBES", "FIRST_EVERY_S", "PROBE_SHARE",
           "FIRST_PROBE_SHARE", "sgd_step_sizes"]

PAIR_EVERY_S = 1.0
# The first probes come faster: auto's first ranking wants the job's own gain in its first
# seconds (the step test's early strides are the ones it can read, ``mpsync.auto.curvature``).
FIRST_PROBES = 12
FIRST_EVERY_S = 0.25
# The most of a worker's time the probes may take (module doc): a small model's probes come at
# the periods above, a large one's further apart.
PROBE_SHARE = 0.1
FIRST_PROBE_SHARE = 0.25


def sgd_step_sizes(optimizer, params) -> list[float] | None:
    """Each of ``params``' effective step size under ``optimizer`` (the learning rate times
    ``1 - dampening`` over ``1 - momentum``: a constant gradient's step once the momentum has
    built up), or None where it is not ``torch.optim.SGD``, holds a parameter not in
    ``params``' groups, or has a momentum of 1 or more."""
    if optimizer is None or not isinstance(optimizer, torch.optim.SGD):
        return None
    size = {}
    for group in optimizer.param_groups:
        beta = float(group.get("momentum", 0.0) or 0.0)
        damp = float(group.get("dampening", 0.0) or 0.0) if beta else 0.0
        if not 0.0 <= beta < 1.0:
            return None
        for p in group["params"]:
            size[id(p)] = float(group["lr"]) * (1.0 - damp) / (1.0 - beta)
    sizes = [size.get(id(p)) for p in params]
    return None if any(s is None for s in sizes) else sizes


class GradientPairs:
    """Same-weights gradient pairs of ``params`` (a list of tensors), summed; with
    ``optimizer`` (SGD) and ``steps_ahead`` (a callable: n, the workers), the step test."""

    def __init__(self, params, every_s: float = PAIR_EVERY_S, clock=time.perf_counter,
                 optimizer=None, steps_ahead=None):
        self.params = list(params)
        self.every_s = float(every_s)
        self.clock = clock
        self.optimizer, self.steps_ahead = optimizer, steps_ahead
        self._next = 0.0
        self.probes = 0
        self.noise = self.signal = 0.0
        self.pairs = 0
        # The step test's sums (module doc): pairs, p, a, q.
        self.stride = [0, 0.0, 0.0, 0.0]
        # True once a probe has run with an optimizer that is not SGD (module doc).
        self.adaptive = False

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
        self.probes += 1
        started = self.clock()
        try:
            return self._probe(second, grads)
        finally:
            first = self.probes <= FIRST_PROBES
            every = min(self.every_s, FIRST_EVERY_S) if first else self.every_s
            share = FIRST_PROBE_SHARE if first else PROBE_SHARE
            ended = self.clock()
            self._next = max(started + every, ended + (ended - started) * (1.0 - share) / share)

    def _probe(self, second, grads) -> bool:
        """One probe (``probe``), its schedule left to the caller."""
        with torch.no_grad():
            first = [g.detach().clone() for g in grads]
            for g in grads:
                g.zero_()        # (in place: gradients bound into a fusion buffer stay so)
        try:
            loss = second()
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
            self._stride(second, loss, first, other)
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

    def _stride(self, second, loss, first, other) -> None:
        """The step test (module doc), summed into ``stride`` if it can be taken."""
        k = int(self.steps_ahead()) if self.steps_ahead is not None else 0
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.SGD):
            self.adaptive = True
        sizes = sgd_step_sizes(self.optimizer, self.params) if k >= 1 else None
        if sizes is None or loss is None:
            return
        with torch.no_grad():
            slope, power = [], []
            for eps, g1, g2 in zip(sizes, first, other):
                g1, g2 = g1.reshape(-1).double(), g2.reshape(-1).double()
                slope.append(eps * torch.dot(g1, g2))
                power.append(eps * 0.5 * (torch.dot(g1, g1) + torch.dot(g2, g2)))
            # One read of both sums and the loss (on a GPU: one copy to the host).
            p, a, loss0 = torch.stack([torch.stack(slope).sum(), torch.stack(power).sum(),
                                       torch.as_tensor(loss).detach().double()
                                       .to(slope[0].device)]).tolist()
            weights = [param.detach().clone() for param in self.params]
            for param, eps, g1 in zip(self.params, sizes, first):
                param.add_(g1.to(param.dtype), alpha=-k * eps)
            for g in other:
                g.zero_()
        try:
            ahead = second()
        finally:
            with torch.no_grad():
                for param, saved in zip(self.params, weights):
                    param.copy_(saved)
        if ahead is None:
            return
        loss_k = float(ahead.detach()) if torch.is_tensor(ahead) else float(ahead)
        q = 2.0 * (loss_k - loss0 + k * p) / k ** 2
        if all(math.isfinite(v) for v in (loss0, loss_k, p, a, q)):
            for i, v in enumerate((1, p, a, q)):
                self.stride[i] += v

    def take_stride(self) -> tuple[int, float, float, float]:
        """(pairs, summed p, a, q) of the step test since the last call; reset."""
        out = tuple(self.stride)
        self.stride = [0, 0.0, 0.0, 0.0]
        return out

    def take(self) -> tuple[float, float, int]:
        """(summed ½|g₁ - g₂|², summed g₁ · g₂, pairs) since the last take; reset."""
        out = (self.noise, self.signal, self.pairs)
        self.noise = self.signal = 0.0
        self.pairs = 0
        return out
