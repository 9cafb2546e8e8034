"""OSP's worker strategy (OSP paper §3-4): Routine Sync of the important layers, In-Computation
Sync of the rest overlapped with the next iteration, and the local-gradient correction."""

from __future__ import annotations

import time

import numpy as np
import torch

from mpsync.torch.backends import Pending
from mpsync.torch.strategies import Strategy

__all__ = ["TwoStageSync"]


class TwoStageSync(Strategy):
    """OSP (OSP paper §3-4) on the ring.

    Iteration i, after backward (local gradients G^l):

    1. If the In-Computation Sync of iteration i-1 is in flight, finish it and apply the
       Local-Gradient-based Parameter correction, Eq. 7: P -= lr·(G^g - G^l) on its layers
       (the local gradient used in step 3 of i-1 is replaced by the global one).
    2. Importance I_l = Σ|g·p| per layer (Eq. 4) goes to the server, which returns the Gradient
       Importance Bitmap for iteration i+1 (§3.2: computed while the worker trains).
    3. Routine Sync: the layers the bitmap for i marks important are averaged (blocking); the
       others start a non-blocking allreduce (ICS) that runs during the next forward/backward;
       the optimizer steps with global gradients on RS layers and local ones on ICS layers
       (LGP, Eq. 6).

    No gradient is dropped: every ICS allreduce is finished and corrected at the next step or
    in ``synchronize()``.  Departure: Eq. 7 is exact for plain SGD; with momentum or Adam the
    correction is the same SGD-shaped term (the optimizer state keeps the local gradient).
    With the ``mpi`` backend Open MPI progresses a non-blocking collective only inside MPI
    calls, so gradient hooks call ``test()`` during backward; Horovod progresses on its own
    thread.
    """

    aggregates_every_step = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        if len(self.buffers) != 1:
            raise ValueError(f"policy={self.config.policy!r} needs all parameters in one dtype, got "
                             f"{[str(b.dtype) for b in self.buffers]}")
        self.buf = self.buffers[0]
        self.n_layers = len(self.buf.layer_names)
        self.bitmap = np.zeros(self.n_layers, dtype=bool)  # iteration 1: all Routine Sync
        self._pending: Pending | None = None
        self._ics_ranges: list | None = None
        self._ics_local: torch.Tensor | None = None
        self._ics_global: torch.Tensor | None = None
        self.ics_layers_total = 0
        self._hooks = [p.register_hook(self._progress) for p in self.buf.params
                       if p.requires_grad]

    def _lr_of_params(self) -> dict[int, float]:
        """Each parameter's current learning rate (read every time: schedulers change it)."""
        return {id(p): group["lr"] for group in self.optimizer.param_groups
                for p in group["params"]}

    def _progress(self, grad):
        if self._pending is not None:
            self._pending.test()
        return grad

    def _finish_ics(self) -> None:
        """Wait for the in-flight ICS and apply the LGP correction (Eq. 7) on its layers."""
        if self._pending is None:
            return
        t0 = time.perf_counter()
        self._pending.wait()
        correction = self._ics_global.sub_(self._ics_local)  # G^g - G^l, in place
        lr_of = self._lr_of_params()
        with torch.no_grad():
            for slot, pos in self.buf.slots_in(self._ics_ranges):
                piece = correction[pos:pos + slot.numel].view(slot.param.shape)
                slot.param.add_(piece, alpha=-lr_of[id(slot.param)])
        self._pending = None
        self._ics_local = self._ics_global = self._ics_ranges = None
        t1 = time.perf_counter()
        self.counters.aggregation_s += t1 - t0
        self.counters.event("ics_wait", t0, t1)

    def step(self, compute_time, closure=None):
        loss = closure() if closure is not None else None
        self._finish_ics()
        decision = self.ask(compute_time, self.iteration + 1)
        if not self.is_sync(decision):
            raise RuntimeError(f"policy {self.config.policy}: the server answered {decision!r}; "
                               f"two-stage sync synchronizes every iteration")
        grads = self.buf.pack_grads()
        bitmap_now = self.bitmap
        if self.client is not None:
            t0 = time.perf_counter()
            p_flat = torch.cat([s.param.detach().reshape(-1) for s in self.buf.slots])
            importance = _layer_importance(grads, p_flat, self.buf.layer_sizes)
            next_bitmap = np.asarray(self.client.report_importance(
                importance, self.buf.layer_sizes), dtype=bool)
            self.counters.wait_s += time.perf_counter() - t0
            if next_bitmap.shape != (self.n_layers,):
                raise RuntimeError(f"OSP bitmap from the server has shape {next_bitmap.shape}, "
                                   f"the model has {self.n_layers} layers")
        else:
            next_bitmap = self.bitmap
        t0 = time.perf_counter()
        nbytes = self.buf.nbytes
        if bitmap_now.any():
            ics_ranges = self.buf.layer_ranges(bitmap_now)
            rs_ranges = self.buf.layer_ranges(~bitmap_now)
            if rs_ranges:  # Routine Sync first, blocking (§3.1)
                rs = self.buf.gather(grads, rs_ranges)
                self.backend.allreduce_average_(rs, "routine sync")
                self.buf.scatter(rs, grads, rs_ranges)
            # In-Computation Sync: in flight until the next step (or synchronize()); the
            # optimizer meanwhile uses the local gradient of these layers (LGP, Eq. 6).
            self._ics_local = self.buf.gather(grads, ics_ranges)
            self._ics_global = self._ics_local.clone()
            self._ics_ranges = ics_ranges
            self._pending = self.backend.start_allreduce_average(self._ics_global, "ics")
            self.ics_layers_total += int(bitmap_now.sum())
        else:
            self.backend.allreduce_average_(grads, "routine sync")
        self.buf.unpack_to_grads()
        self._aggregated(t0, nbytes)
        self.optimizer.step()
        self.bitmap = next_bitmap
        self.iteration += 1
        self.counters.iterations += 1
        return loss

    def synchronize(self) -> None:
        self._finish_ics()
        self._broadcast_model()

    def close(self) -> None:
        self._finish_ics()
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _layer_importance(grads: torch.Tensor, params: torch.Tensor, layer_sizes) -> np.ndarray:
    from mpsync.sched import osp_layer_importance

    return osp_layer_importance(grads.detach().to(torch.float64).numpy(),
                                params.detach().to(torch.float64).numpy(),
                                np.asarray(layer_sizes, dtype=np.int64))
