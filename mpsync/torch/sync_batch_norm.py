"""``mps.SyncBatchNorm``: batch normalization whose statistics are those of the whole batch,
every worker's part of it (Horovod's ``hvd.SyncBatchNorm``).

In training, each worker's per-channel sum, sum of squares and count are summed over the
workers with one differentiable ``allreduce`` (its backward is an allreduce of the gradient,
so each worker's input gets the gradient of every worker's loss through the shared
statistics: the same as batch normalization of the concatenated batch on one process).
Running statistics are updated from the global mean and the unbiased global variance; in
evaluation the layer is plain batch normalization with them.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` (any input of shape (N, C, ...))."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        from mpsync.torch import _runtime

        if not (self.training and _runtime.is_initialized()):
            return super().forward(input)
        from mpsync.torch.differentiable import allreduce
        from mpsync.torch.mpi_ops import Sum

        dims = [0] + list(range(2, input.dim()))
        # On the input's device: the sums are there, and a host count would not concatenate.
        count = torch.tensor([input.numel() // input.shape[1]], dtype=input.dtype,
                             device=input.device)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = allreduce(local, op=Sum, name=None)
        c = input.shape[1]
        n = total[2 * c]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        if self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), float(n.detach()))
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        self.num_batches_tracked.add_(1)
        m = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        unbiased = var * (n / max(n - 1.0, 1.0))
        with torch.no_grad():
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
