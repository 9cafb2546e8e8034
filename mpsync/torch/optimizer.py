"""``DistributedOptimizer``: wraps a torch optimizer; its ``step()`` runs the policy.

It is a ``torch.optim.Optimizer`` that *shares* ``param_groups`` and ``state`` with the wrapped
optimizer (so learning-rate schedulers and ``isinstance`` checks work) and delegates the update
itself; no class is created at run time (Horovod builds a dynamic subclass of the wrapped
optimizer's class, which breaks under further subclassing).

Per-iteration compute time, reported to the state server, is the time since the previous
``step()`` returned: forward, backward, data loading and any emulated slowdown.
"""

from __future__ import annotations

import contextlib
import time

import torch

from mpsync.torch.fusion import group_by_dtype
from mpsync.torch.strategies import Strategy, make_strategy

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(torch.optim.Optimizer):
    """``mps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())``.

    ``step()`` does what the policy says for this iteration (gradient averaging, a local step,
    a delta aggregation, a push/pull, OSP's two-stage sync); ``synchronize()`` forces the
    aggregation now (BSP: average the current gradients, so the next ``step()`` does not do it
    again; other policies: the final aggregation after which every worker holds the same
    model).  Horovod keywords that change nothing here are accepted (``backward_passes_per_step``:
    mpsync aggregates in ``step()``, so gradients of several backward passes are already summed);
    ones that would change the result (``compression``, ``op`` other than average) are refused.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, *,
                 compression=None, backward_passes_per_step: int = 1, op=None,
                 gradient_predivide_factor: float = 1.0, _context=None):
        # Deliberately not calling Optimizer.__init__: the wrapped optimizer owns the groups.
        from mpsync.torch import _runtime

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        _check_horovod_keywords(compression, backward_passes_per_step, op,
                                gradient_predivide_factor)
        ctx = _context if _context is not None else _runtime.worker_context("DistributedOptimizer")
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        named = name_parameters(optimizer, named_parameters)
        self._buffers = group_by_dtype(named)
        self._counters = ctx.counters
        self._strategy: Strategy = make_strategy(
            ctx.config, optimizer, self._buffers, ctx.data_backend or ctx.backend, ctx.client,
            ctx.counters,
            worker_rank=ctx.worker_rank)
        self._last_step_end = time.perf_counter()
        ctx.optimizers.append(self)

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def step(self, closure=None):
        now = time.perf_counter()
        compute_time = now - self._last_step_end
        self._counters.compute_s += compute_time
        self._counters.event("compute", self._last_step_end, now)
        result = self._strategy.step(compute_time, closure)
        self._last_step_end = time.perf_counter()
        return result

    def synchronize(self) -> None:
        self._strategy.synchronize()
        self._last_step_end = time.perf_counter()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod idiom ``synchronize(); clip; with skip_synchronize(): step()``: here
        ``step()`` after ``synchronize()`` already skips the second allreduce."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """BSP keeps the gradients inside the fusion buffer and zeroes them there (they are
        zero tensors afterwards, not None); other policies defer to the wrapped optimizer."""
        if not self._strategy.zero_grad():
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise RuntimeError("DistributedOptimizer: add parameter groups to the wrapped optimizer "
                           "before wrapping it (the fusion buffer is laid out once)")

    def close(self) -> None:
        self._strategy.close()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, strategy={type(self._strategy).__name__})"


def _check_horovod_keywords(compression, backward_passes_per_step, op, predivide) -> None:
    if compression is not None and getattr(compression, "__name__", "") not in ("NoneCompressor",):
        raise ValueError("DistributedOptimizer: gradient compression is not supported "
                         "(pass compression=None)")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                         f"{backward_passes_per_step!r}")
    if op is not None and op != 0:  # horovod.torch.Average == 0 in Horovod 0.28
        raise ValueError(f"DistributedOptimizer: only op=Average is supported, got {op!r}")
    if predivide != 1.0:
        raise ValueError("gradient_predivide_factor is not supported (must be 1.0)")


def name_parameters(optimizer, named_parameters) -> list[tuple[str, torch.Tensor]]:
    """(name, param) for every parameter of the optimizer, in optimizer order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len({id(p) for p in params}) != len(params):
        raise ValueError("the optimizer holds the same parameter twice")
    if named_parameters is None:
        return [(f"param_{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, e.g. "
                         "model.named_parameters()")
    names = [n for n, _ in named]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"named_parameters has duplicate names: {dup}")
    name_of = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in name_of]
    if missing:
        raise ValueError(f"{len(missing)} optimizer parameter(s) are not in named_parameters "
                         f"(first index {missing[0]}); pass model.named_parameters() of the "
                         f"model the optimizer trains")
    return [(name_of[id(p)], p) for p in params]
