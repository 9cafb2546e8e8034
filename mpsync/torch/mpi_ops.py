"""The collectives a training script calls itself, with ``horovod.torch``'s names and
arguments: ``allreduce`` (and ``_``/``_async`` forms, ``poll``, ``synchronize``),
``grouped_allreduce``, ``allgather``, ``allgather_object``, ``broadcast``, ``broadcast_``,
``alltoall``, ``reducescatter``, ``barrier``, ``join``; the reduce ops; the topology queries.

Everything runs over the workers only (a dedicated state-server rank never takes part): on
its own ``Dup()`` of the workers' communicator with mpi4py, or, for ``allreduce`` with
``backend='horovod'``, through Horovod (initialised on that same set of workers).  Every wait
is bounded by the run's ``deadline`` (:class:`~mpsync.torch.CollectiveTimeout`).  A CUDA
tensor is staged through host memory and the result comes back on its device.

Process sets (``process_set=``) other than the global one are refused: mpsync aggregates over
all workers.  ``op=Adasum`` is refused: use ``Average`` (Adasum needs Horovod's own
optimizer; run the script on Horovod for it).
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import torch

from mpsync.torch import _runtime
from mpsync.torch.compression import Compression
from mpsync.torch._collectives import (  # noqa: F401  (Average ... Product are public here)
    Average, Sum, Adasum, Min, Max, Product, _OP_NAMES, reduce_op, _check_process_set, _done, UserOps, user_ops, _name, _opt_name)

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "poll",
    "synchronize", "allgather", "allgather_object", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "reducescatter", "barrier", "join",
    "is_initialized", "local_size", "cross_rank", "cross_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "UserOps", "reduce_op",
]


# -- allreduce family ----------------------------------------------------------------------------
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> int:
    """Start reducing ``tensor`` into a new tensor; ``synchronize(handle)`` returns it."""
    _check_process_set(process_set)
    ops = user_ops("allreduce_async")
    op = reduce_op(average, op)
    return ops.keep(ops.start_allreduce(tensor, op, prescale_factor, postscale_factor, None,
                                        _opt_name(name)))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> int:
    """In-place form of :func:`allreduce_async`."""
    _check_process_set(process_set)
    ops = user_ops("allreduce_async_")
    op = reduce_op(average, op)
    return ops.keep(ops.start_allreduce(tensor, op, prescale_factor, postscale_factor, None,
                                        _opt_name(name), out=tensor))


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the workers (default: averaged).  Sums of integer
    tensors are exact; averaging one is refused (it has no integer result).
    ``compression=Compression.fp16`` reduces a float16 copy and returns the tensor's dtype."""
    _check_process_set(process_set)
    ops = user_ops("allreduce")
    op = reduce_op(average, op)
    return ops.start_allreduce(tensor, op, prescale_factor, postscale_factor, compression,
                               _opt_name(name)).wait()


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """In place: ``tensor`` becomes its reduction over the workers."""
    _check_process_set(process_set)
    ops = user_ops("allreduce_")
    op = reduce_op(average, op)
    return ops.start_allreduce(tensor, op, prescale_factor, postscale_factor, None,
                               _opt_name(name), out=tensor).wait()


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> list:
    """A list of new tensors, each reduced as by :func:`allreduce`."""
    return [allreduce(t, average, None if name is None else f"{name}.{i}", compression, op,
                      prescale_factor, postscale_factor, process_set)
            for i, t in enumerate(tensors)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None) -> list:
    return [allreduce_(t, average, None if name is None else f"{name}.{i}", op, prescale_factor,
                       postscale_factor, process_set) for i, t in enumerate(tensors)]


def _grouped_async(tensors, average, name, op, pre, post, process_set, in_place) -> int:
    _check_process_set(process_set)
    ops = user_ops("grouped_allreduce_async")
    op = reduce_op(average, op)
    started = [ops.start_allreduce(t, op, pre, post, None, None if name is None else f"{name}.{i}",
                                   out=t if in_place else None) for i, t in enumerate(tensors)]

    def test():
        return all(s.test() for s in started)

    return ops.keep(ops._op(test, lambda: [s.wait() for s in started],
                            _name(name, "grouped")))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None) -> int:
    return _grouped_async(tensors, average, name, op, prescale_factor, postscale_factor,
                          process_set, in_place=False)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None) -> int:
    return _grouped_async(tensors, average, name, op, prescale_factor, postscale_factor,
                          process_set, in_place=True)


def poll(handle: int) -> bool:
    """True once the collective of ``handle`` has completed (``synchronize`` then returns
    without waiting)."""
    op = user_ops("poll").handles.get(handle)
    if op is None:
        raise ValueError(f"poll: unknown handle {handle!r} (already synchronized?)")
    return op.test()


def synchronize(handle: int):
    """Wait for the collective of ``handle`` (with the deadline) and return its result."""
    ops = user_ops("synchronize")
    op = ops.handles.pop(handle, None)
    if op is None:
        raise ValueError(f"synchronize: unknown handle {handle!r} (already synchronized?)")
    return op.wait()


# -- data movement ------------------------------------------------------------------------------
def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along the first dimension (whose length may
    differ between workers), in worker order."""
    _check_process_set(process_set)
    return user_ops("allgather").allgather(tensor, _name(name, "allgather"))


def allgather_object(obj, name=None) -> list:
    """Every worker's picklable ``obj``, as a list in worker order."""
    ops = user_ops("allgather_object")
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    parts = ops.allgather_bytes(data, _name(name, type(obj).__name__))
    return [pickle.loads(p) for p in parts]


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """In place: ``tensor`` becomes worker ``root_rank``'s."""
    _check_process_set(process_set)
    return user_ops("broadcast_").broadcast_(tensor, root_rank, _name(name, "broadcast"))


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """A new tensor holding worker ``root_rank``'s ``tensor``."""
    out = tensor.detach().clone()
    return broadcast_(out, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    ops = user_ops("broadcast_async_")
    return ops.keep(_done(broadcast_(tensor, root_rank, name, process_set), "broadcast"))


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    ops = user_ops("broadcast_async")
    return ops.keep(_done(broadcast(tensor, root_rank, name, process_set), "broadcast"))


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Slices of ``tensor``'s first dimension go to the workers in order (``splits`` rows
    each, default equal); returns what the others sent, and with ``splits`` given also the
    rows received from each worker."""
    _check_process_set(process_set)
    return user_ops("alltoall").alltoall(tensor, splits, _name(name, "alltoall"))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=None, prescale_factor=1.0, postscale_factor=1.0):
    """``tensor`` reduced over the workers, then split along the first dimension; this worker
    gets its part (the first ``rows % size`` workers one row more, as Horovod)."""
    _check_process_set(process_set)
    ops = user_ops("reducescatter")
    op = reduce_op(None, op)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=Average or op=Sum, got {_OP_NAMES[op]}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    full = ops.start_allreduce(tensor, op, prescale_factor, postscale_factor, compression,
                               _name(name, "reducescatter")).wait()
    rows, size, r = tensor.shape[0], ops.size, ops.rank
    base, extra = divmod(rows, size)
    start = r * base + min(r, extra)
    return full[start:start + base + (1 if r < extra else 0)].clone()


def barrier(process_set=None) -> None:
    """Wait until every worker has reached the barrier."""
    _check_process_set(process_set)
    user_ops("barrier").barrier()


def join(device: int = -1) -> int:
    """This worker has no more data: it keeps taking part in the others' aggregations (every
    ``DistributedOptimizer``'s policy, see ``strategies``) until every worker has joined;
    then all hold the same model.  Returns the worker that joined last (by the wall clocks
    of the workers' hosts)."""
    ctx = _runtime.worker_context("join")
    entered = time.time()
    for opt in list(ctx.optimizers):
        opt.synchronize_model()
    times = allgather_object(entered, name="join")
    return int(np.argmax(times))


# -- queries --------------------------------------------------------------------------------
def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()`` in this process (Horovod's meaning)."""
    return _runtime.is_initialized()


def local_size() -> int:
    """Workers on this node."""
    return _runtime.context().local_size


def cross_rank() -> int:
    """This node's index among the nodes (the workers with this local rank, in order)."""
    return _runtime.context().cross_rank


def cross_size() -> int:
    """Number of nodes with a worker of this local rank."""
    return _runtime.context().cross_size


def mpi_built() -> bool:
    """mpsync runs on MPI (mpi4py): always True."""
    return True


def mpi_enabled() -> bool:
    return True


def mpi_threads_supported() -> bool:
    """Whether this MPI provides MPI_THREAD_MULTIPLE."""
    from mpi4py import MPI

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> bool:
    """mpsync's collectives do not use NCCL (CUDA tensors are staged through host memory)."""
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """CUDA tensors are accepted (staged through host memory) when PyTorch has CUDA."""
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False
