"""The collectives that return new tensors, as ``torch.autograd.Function`` s with Horovod's
backward passes, so ``loss = f(mps.allreduce(x)); loss.backward()`` works as in Horovod:

=====================  =====================================================================
forward                backward (what Horovod 0.28 defines; the gradient of each worker)
=====================  =====================================================================
allreduce              allreduce of the gradient with the same op and scale factors
allgather              the gradient averaged over the workers, then this worker's rows
broadcast              the gradient averaged over the workers on the root, zeros elsewhere
alltoall               alltoall of the gradient back, with the received splits
reducescatter          allgather of the gradient, times the number of workers for op=Sum
                       and times the scale factors
grouped_*              the same per tensor
=====================  =====================================================================

These are Horovod's definitions, kept so a script computes the same gradients on both; they
are what data-parallel training wants, not always the derivative of the global function
(allgather's backward averages where the derivative would sum).
"""

from __future__ import annotations

import torch

from mpsync.torch import _moves
from mpsync.torch._collectives import Average, Sum, name_of, reduce_op
from mpsync.torch.process_sets import user_ops
from mpsync.torch.dataplane.compression import Compression
from mpsync.torch.mpi_ops import (start_broadcast, start_grouped_allgather,
                                  start_grouped_allreduce, start_grouped_reducescatter,
                                  start_reducescatter)

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter"]


def _ps_rank_size(process_set) -> tuple[int, int]:
    ops = user_ops("backward", process_set)
    return ops.rank, ops.size


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, pre, post, name, process_set):
        ctx.args = (op, pre, post, process_set)
        ops = user_ops("allreduce", process_set)
        return _moves.start_allreduce(ops, tensor, op, pre, post, None, name).wait()

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set = ctx.args
        return (allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post,
                          process_set=process_set), None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the workers (default: averaged; an integer
    average is truncated, as Horovod's).  ``compression=Compression.fp16`` reduces a float16
    copy and returns the tensor's dtype.  Differentiable."""
    op = reduce_op(average, op)
    wire, cctx = compression.compress(tensor)
    out = _Allreduce.apply(wire, op, prescale_factor, postscale_factor, name_of(name),
                           process_set)
    return compression.decompress(out, cctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, name, process_set, *tensors):
        ctx.args = (op, pre, post, process_set)
        ops = user_ops("grouped_allreduce", process_set)
        return tuple(start_grouped_allreduce(ops, tensors, op, pre, post, None, name,
                                             False).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        return (None, None, None, None, None,
                *grouped_allreduce(list(grads), op=op, prescale_factor=pre,
                                   postscale_factor=post, process_set=process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> list:
    """A list of new tensors, each reduced as by :func:`allreduce`.  Differentiable."""
    op = reduce_op(average, op)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(op, prescale_factor, postscale_factor, name_of(name),
                                   process_set, *[w for w, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def _my_offset(dims: torch.Tensor, rank: int) -> int:
    return int(dims[:rank].sum()) if rank else 0


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = tensor.shape[0], process_set
        ops = user_ops("allgather", process_set)
        return _moves.start_allgather(ops, tensor, name).wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int32),
                         process_set=ctx.process_set)
        rank, _ = _ps_rank_size(ctx.process_set)
        return reduced.narrow(0, _my_offset(dims, rank), ctx.dim), None, None


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along the first dimension (whose length may
    differ between workers), in worker order.  Differentiable."""
    return _Allgather.apply(tensor, name_of(name), process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        ops = user_ops("grouped_allgather", process_set)
        return tuple(start_grouped_allgather(ops, tensors, name).wait())

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        dims = grouped_allgather([torch.tensor([d], dtype=torch.int32) for d in ctx.dims],
                                 process_set=ctx.process_set)
        rank, _ = _ps_rank_size(ctx.process_set)
        return (None, None, *[g.narrow(0, _my_offset(d, rank), n)
                              for g, d, n in zip(reduced, dims, ctx.dims)])


def grouped_allgather(tensors, name=None, process_set=None) -> list:
    """:func:`allgather` of each tensor of the list.  Differentiable."""
    return list(_GroupedAllgather.apply(name_of(name), process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        ops = user_ops("broadcast", process_set)
        return start_broadcast(ops, tensor, root_rank, name).wait()

    @staticmethod
    def backward(ctx, grad):
        from mpsync.torch import _runtime

        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if _runtime.context().worker_rank != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """A new tensor holding worker ``root_rank``'s ``tensor``.  Differentiable."""
    return _Broadcast.apply(tensor, root_rank, name_of(name), process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ops = user_ops("alltoall", process_set)
        out, received = _moves.start_alltoall(ops, tensor, splits, name).wait()
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_):
        back, _splits = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Slices of ``tensor``'s first dimension go to the workers in order (``splits`` rows
    each, default equal); returns what the others sent, and with ``splits`` given also the
    rows received from each worker.  Differentiable."""
    return _Alltoall.apply(tensor, splits, name_of(name), process_set)


def _scaled_back(grad, op, pre, post, size):
    if op == Sum:
        grad = grad * size
    if pre != 1.0:
        grad = grad * pre
    if post != 1.0:
        grad = grad * post
    return grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):
        ctx.args = (op, process_set, pre, post)
        ops = user_ops("reducescatter", process_set)
        return start_reducescatter(ops, tensor, op, pre, post, None, name).wait()

    @staticmethod
    def backward(ctx, grad):
        op, process_set, pre, post = ctx.args
        _, size = _ps_rank_size(process_set)
        return (allgather(_scaled_back(grad, op, pre, post, size), process_set=process_set),
                None, None, None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=None, prescale_factor=1.0, postscale_factor=1.0):
    """``tensor`` reduced over the workers, then split along the first dimension; this worker
    gets its part (the first ``rows % size`` workers one row more, as Horovod).
    Differentiable."""
    op = reduce_op(None, op)
    wire, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(wire, name_of(name), op, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, cctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):
        ctx.args = (op, process_set, pre, post)
        ops = user_ops("grouped_reducescatter", process_set)
        return tuple(start_grouped_reducescatter(ops, tensors, op, pre, post, None,
                                                 name).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, pre, post = ctx.args
        _, size = _ps_rank_size(process_set)
        return (None, None, None, None, None,
                *grouped_allgather([_scaled_back(g, op, pre, post, size) for g in grads],
                                   process_set=process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=None, prescale_factor=1.0, postscale_factor=1.0):
    """:func:`reducescatter` of each tensor of the list.  Differentiable."""
    op = reduce_op(None, op)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name_of(name), op, process_set, prescale_factor,
                                       postscale_factor, *[w for w, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]
