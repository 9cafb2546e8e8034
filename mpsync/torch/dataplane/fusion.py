"""Tensor fusion: many parameters, one flat contiguous buffer, one collective per step.

A model with 100 parameter tensors would otherwise pay 100 collective latencies per step;
Horovod fuses tensors into a 128 MB buffer for the same reason.  mpsync keeps one flat buffer
per dtype and per model, allocated once, and views into it for each parameter.

The buffer lives on the parameters' device: on a GPU the gradients are views into device
memory (``bind_grads``), so a step packs and unpacks nothing and the collective reduces them
where backward left them.  A transport that needs host memory gets it from
:class:`~mpsync.torch.dataplane.staging.HostStaged` around the aggregator, one pinned mirror
per bucket, never from per-parameter copies here.

Parameters are grouped into *layers* (the module that owns them: ``fc1.weight`` and ``fc1.bias``
are layer ``fc1``).  OSP ranks and splits the model by layer (OSP §4.1.1, Eq. 4), so each
layer's parameters are laid out contiguously and ``layer_bounds`` gives their slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["FusionBuffer", "group_by_dtype", "layer_name"]


def layer_name(param_name: str) -> str:
    """``"encoder.fc1.weight"`` -> ``"encoder.fc1"``; a top-level parameter is its own layer."""
    head, dot, _ = param_name.rpartition(".")
    return head if dot else param_name


@dataclass
class _Slot:
    param: torch.Tensor
    name: str
    offset: int
    numel: int


class FusionBuffer:
    """Flat buffer over ``params`` (all of one dtype), laid out layer by layer.

    ``flat`` holds whatever was packed last (gradients, parameters or deltas); it is reused
    every step, so the only per-step memory traffic is the pack and unpack copies.
    """

    def __init__(self, params: list[torch.Tensor], names: list[str]):
        if not params:
            raise ValueError("FusionBuffer needs at least one parameter")
        if len(names) != len(params):
            raise ValueError("params and names differ in length")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"FusionBuffer needs one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = params[0].dtype
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"FusionBuffer needs its parameters on one device, got "
                             f"{sorted(map(str, devices))}; move the model with .to(device)")
        self.device = params[0].device
        # Keep each layer's parameters together, layers in order of first appearance.
        layers: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            layers.setdefault(layer_name(n), []).append(i)
        self.slots: list[_Slot] = []
        self.layer_names: list[str] = []
        bounds = []
        offset = 0
        for lname, idx in layers.items():
            start = offset
            for i in idx:
                p = params[i]
                self.slots.append(_Slot(p, names[i], offset, p.numel()))
                offset += p.numel()
            self.layer_names.append(lname)
            bounds.append((start, offset))
        self.numel = offset
        self.layer_bounds = np.array(bounds, dtype=np.int64).reshape(-1, 2)
        self.layer_sizes = (self.layer_bounds[:, 1] - self.layer_bounds[:, 0]).astype(np.int64)
        self.grads_bound = False
        self._allocate(0)

    def _allocate(self, header: int) -> None:
        # ``wire`` = ``flat`` (the parameters' layout) followed by ``header`` (a few numbers a
        # strategy sends in the same collective, see ``add_header``).
        self.wire = torch.zeros(self.numel + header, dtype=self.dtype, device=self.device)
        self.flat = self.wire[:self.numel]
        self.header = self.wire[self.numel:]
        self._views = [self.flat[s.offset:s.offset + s.numel].view(s.param.shape)
                       for s in self.slots]
        # Frozen parameters (requires_grad=False) never get a gradient from mpsync: a zero
        # gradient would still let weight decay or momentum move them.
        self._bound_ptrs = [(s.param, v.data_ptr()) for s, v in zip(self.slots, self._views)
                            if s.param.requires_grad]

    def add_header(self, n: int) -> None:
        """Reserve ``n`` elements after the parameters' layout: aggregating ``wire`` carries
        them in the same collective (no extra latency).  Before ``bind_grads``."""
        if self.grads_bound:
            raise RuntimeError("add_header must come before bind_grads")
        self._allocate(int(n))

    @property
    def params(self) -> list[torch.Tensor]:
        return [s.param for s in self.slots]

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()

    def views(self, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per-parameter views into ``flat`` (default: this buffer)."""
        if flat is None:
            return self._views
        return [flat[s.offset:s.offset + s.numel].view(s.param.shape) for s in self.slots]

    # -- packing ------------------------------------------------------------------------------
    def all_bound(self) -> bool:
        """Every gradient is its view of ``flat`` (the steady state after ``bind_grads``)."""
        for p, ptr in self._bound_ptrs:
            g = p.grad
            if g is None or g.data_ptr() != ptr:
                return False
        return True

    def pack_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy every ``param.grad`` into ``out`` (default ``flat``); a missing grad is zeros, so
        every worker contributes the same layout even when a branch of the model was unused.
        A gradient that already *is* its view of ``flat`` (see ``bind_grads``) is not copied."""
        out = self.flat if out is None else out
        bound = self.grads_bound and out is self.flat
        if bound and self.all_bound():
            return out
        with torch.no_grad():
            for s, v in zip(self.slots, self.views(out)):
                g = s.param.grad
                if g is None:
                    v.zero_()
                elif not (bound and g.data_ptr() == v.data_ptr()):
                    v.copy_(g)
        return out

    def unpack_to_grads(self, src: torch.Tensor | None = None) -> None:
        """Put ``src`` (default ``flat``) into the gradients.  With ``grads_bound`` each gradient
        becomes its view of ``flat`` instead of receiving a copy."""
        src = self.flat if src is None else src
        bind = self.grads_bound and src is self.flat
        if bind and self.all_bound():
            return
        with torch.no_grad():
            for s, v in zip(self.slots, self.views(src)):
                g = s.param.grad
                if not s.param.requires_grad:
                    continue
                if bind:
                    if g is None or g.data_ptr() != v.data_ptr():
                        s.param.grad = v
                elif g is None:
                    s.param.grad = v.detach().to(s.param.device, copy=True)
                else:
                    g.copy_(v)

    def bind_grads(self) -> None:
        """Let the gradients live in ``flat`` (zero-copy fusion for gradient averaging).

        Backward accumulates into an existing ``.grad`` in place, so once ``param.grad`` is a
        view of ``flat`` the gradients arrive in the fusion buffer with no pack copy and the
        averaged result needs no unpack copy.  A ``zero_grad(set_to_none=True)`` elsewhere
        unbinds a parameter; the next unpack binds it again.  The same on a GPU: the buffer is
        on the parameters' device, so the views are device memory too.
        """
        self.grads_bound = True
        with torch.no_grad():
            self.pack_grads()
        self.unpack_to_grads()

    def zero_bound_grads(self) -> None:
        with torch.no_grad():
            self.flat.zero_()
        self.unpack_to_grads()

    def pack_params(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.flat if out is None else out
        with torch.no_grad():
            for s, v in zip(self.slots, self.views(out)):
                v.copy_(s.param)
        return out

    def unpack_to_params(self, src: torch.Tensor | None = None) -> None:
        src = self.flat if src is None else src
        with torch.no_grad():
            for s, v in zip(self.slots, self.views(src)):
                s.param.copy_(v)

    # -- layers -------------------------------------------------------------------------------
    def layer_ranges(self, layers: np.ndarray) -> list[tuple[int, int]]:
        """[start, end) of the given layers (bool mask over layers) in ``flat``, in order."""
        mask = np.asarray(layers, dtype=bool)
        if mask.shape != (len(self.layer_names),):
            raise ValueError(f"layer mask has shape {mask.shape}, the model has "
                             f"{len(self.layer_names)} layers")
        return [(int(a), int(b)) for (a, b), m in zip(self.layer_bounds, mask) if m]

    @staticmethod
    def gather(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The given ranges of ``flat``, concatenated into a new contiguous tensor."""
        if len(ranges) == 1:
            a, b = ranges[0]
            return flat[a:b].clone()
        return torch.cat([flat[a:b] for a, b in ranges])

    @staticmethod
    def scatter(src: torch.Tensor, flat: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        """Inverse of :meth:`gather`: copy ``src`` back into the ranges of ``flat``."""
        pos = 0
        for a, b in ranges:
            flat[a:b].copy_(src[pos:pos + b - a])
            pos += b - a

    def slots_in(self, ranges: list[tuple[int, int]]) -> list[tuple[_Slot, int]]:
        """(slot, position in the gathered tensor) for every parameter inside ``ranges``."""
        out, pos = [], 0
        for a, b in ranges:
            for s in self.slots:
                if a <= s.offset < b:
                    out.append((s, pos + s.offset - a))
            pos += b - a
        return out


def group_by_dtype(named: list[tuple[str, torch.Tensor]]) -> list[FusionBuffer]:
    """One :class:`FusionBuffer` per parameter dtype (usually exactly one)."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, p in named:
        by_dtype.setdefault(p.dtype, []).append((name, p))
    return [FusionBuffer([p for _, p in items], [n for n, _ in items])
            for items in by_dtype.values()]
