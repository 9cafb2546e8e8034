"""Compression of what goes on the wire, with Horovod's interface (``hvd.Compression``).

A compressor has two static methods: ``compress(tensor) -> (wire_tensor, ctx)`` and
``decompress(wire_tensor, ctx) -> tensor``.  ``Compression.fp16`` sends floating tensors as
float16 (half the bytes of float32) and gives the result back in the tensor's own dtype;
integer tensors travel as they are.  Horovod's own compressor classes have the same two
methods and are accepted too.

:class:`WireSum` is how :class:`~mpsync.torch.DistributedOptimizer` reduces over the workers:
compression, Horovod's ``gradient_predivide_factor`` (scale by 1/f before the sum and by f
after it) and the reduction as a *sum*, so a strategy can divide by the number of workers
that actually contributed (uneven step counts: a worker that has finished contributes
zeros, see ``strategies``).
"""

from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression", "as_compressor",
           "WireSum"]


class Compressor:
    """Interface: ``compress`` before the collective, ``decompress`` after it."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The tensor goes on the wire as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16; the result comes back in the original dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return _cast(tensor, torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else _cast(tensor, ctx)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``; a CPU tensor's in memory the scratch pool leases from its size
    on (:meth:`~mpsync.torch.dataplane.scratch.ScratchPool.result`): a fresh tensor of that
    size page-faults at every call (16 MB of float32 cast to float16: 2.9 ms into a fresh
    tensor, 1.0 ms into reused memory; the cast back 1.6 against 0.9)."""
    if tensor.device.type != "cpu" or tensor.requires_grad:
        return tensor.to(dtype)
    from mpsync.torch.dataplane.scratch import pool

    return pool().result(tensor.shape, dtype).copy_(tensor)


class Compression:
    """``Compression.none`` and ``Compression.fp16``, as in ``horovod.torch``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def as_compressor(compression):
    """``None`` means no compression; anything else must have ``compress``/``decompress``."""
    if compression is None:
        return NoneCompressor
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must be Compression.none, Compression.fp16 or an object "
                        f"with compress()/decompress(), got {compression!r}")
    return compression


class _Chained:
    """A collective in flight followed by a local finishing step (``test``/``wait`` as
    :class:`~mpsync.torch.dataplane.backends.Pending`)."""

    def __init__(self, inner, finish):
        self.inner = inner
        self._finish = finish
        self.done = False

    def test(self) -> bool:
        if not self.done and self.inner.test():
            self._finish()
            self.done = True
        return self.done

    def wait(self, deadline: float | None = None) -> None:
        if not self.done:
            self.inner.wait(deadline)
            self._finish()
            self.done = True


class _Done:
    done = True

    def test(self) -> bool:
        return True

    def wait(self, deadline: float | None = None) -> None:
        return None


class WireSum:
    """Sum a flat tensor over the workers through ``backend`` (an ``Aggregator``), with
    ``compression`` and pre/post scaling; in place.

    ``start_sum(tensor, what, payload=n, divisor=f)``: the first ``n`` elements are data, the
    rest a header of small counts.  The header comes back as the exact sum (rounded); the
    data as the sum divided by ``f(header)`` (called once the header has arrived, so a
    strategy can divide by the number of workers that contributed), in one scaling pass.

    The aggregators average; the sum is that average times the number of workers.  A float16
    wire on the ``mpi`` backend (MPI has no float16 reduction) goes through ``half_sum``
    (:func:`mpsync.torch._moves.sum_half_`: the halves themselves travel, in one allreduce
    with a half sum registered with MPI, each addition done in float32).
    """

    def __init__(self, backend, compression=None, prescale: float = 1.0,
                 postscale: float = 1.0, half_sum=None):
        self.backend = backend
        self.size = backend.size
        self.compression = as_compressor(compression)
        self.prescale = float(prescale)
        self.postscale = float(postscale)
        self.half_sum = half_sum

    def start_sum(self, tensor: torch.Tensor, what: str, payload: int | None = None,
                  divisor=None):
        n = tensor.numel() if payload is None else int(payload)
        wire, ctx = self.compression.compress(tensor)
        if self.prescale != 1.0:
            wire[:n].mul_(self.prescale)  # ``tensor`` itself or the compressor's copy: ours
        total = self.size * self.postscale

        def finish():
            out = self.compression.decompress(wire, ctx)
            if out is not tensor:
                tensor.copy_(out)
            header = tensor[n:]
            if header.numel():
                header.mul_(self.size).round_()
            scale = total / (divisor(header) if divisor is not None else 1.0)
            if scale != 1.0:
                tensor[:n].mul_(scale)

        if wire.dtype in (torch.float16, torch.bfloat16) and self.half_sum is not None:
            self.half_sum(wire, what)
            wire.div_(self.size)   # back to the average the finishing step expects
            finish()
            return _Done()
        return _Chained(self.backend.start_allreduce_average(wire, what), finish)

    def sum_(self, tensor: torch.Tensor, what: str, payload: int | None = None,
             divisor=None) -> torch.Tensor:
        self.start_sum(tensor, what, payload, divisor).wait()
        return tensor
