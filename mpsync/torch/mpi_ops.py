"""The collectives a training script calls itself, with ``horovod.torch``'s names, arguments
and semantics: the asynchronous and in-place forms (``*_async``, ``*_``, ``poll``,
``synchronize``), ``barrier``, ``join``, ``allgather_object``, the reduce ops and the
topology queries.  The differentiable forms (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter`` and their grouped variants) are in
:mod:`~mpsync.torch.differentiable`.

Everything runs over the workers only (a dedicated state-server rank never takes part), on
communicators of their own (mpi4py; the ``backend`` setting chooses how
``DistributedOptimizer`` aggregates), and never consults the state server, so every policy
runs them the same way.  ``process_set=`` limits a collective to a process set
(:mod:`~mpsync.torch.process_sets`); ``root_rank`` is a worker rank (``mps.rank()``), as in
Horovod.  Before any data moves the workers compare what each asked for; a mismatch raises
:class:`~mpsync.torch.HorovodInternalError` on every worker and the job goes on.  Every wait is
bounded by the run's ``deadline`` (:class:`~mpsync.torch.CollectiveTimeout`).
"""

from __future__ import annotations

import pickle

import torch

from mpsync.torch import _moves, _runtime
from mpsync.torch._grouped import (part_name, submit_plain_allgather, submit_plain_group,
                                   submit_plain_reducescatter)
from mpsync.torch._collectives import (  # noqa: F401  (Average ... Product are public here)
    Adasum, Average, Max, Min, Product, Sum, UserOps, Parts, _Done, _Group, name_of,
    reduce_op)
from mpsync.torch.process_sets import user_ops

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce_async", "allreduce_async_", "allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allreduce_", "sparse_allreduce_async",
    "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_",
    "broadcast_", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async",
    "poll", "synchronize", "allgather_object", "barrier", "join",
    "is_initialized", "local_size", "cross_rank", "cross_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "UserOps", "reduce_op", "SparseHandle",
]


def _keep(ops: UserOps, op) -> int:
    return ops.keep(op)


def _member_root(ops: UserOps, root_rank) -> tuple[int, Exception | None]:
    """``root_rank`` (a worker rank) as an index among the members of ``ops``."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or \
            root_rank not in ops.ranks:
        return -1, ValueError(f"broadcast received invalid root rank {root_rank!r} for the "
                              f"process set of workers {ops.ranks}")
    return ops.ranks.index(root_rank), None


# -- allreduce family ----------------------------------------------------------------------------
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> int:
    """Start reducing ``tensor`` into a new tensor; ``synchronize(handle)`` returns it."""
    ops = user_ops("allreduce_async", process_set)
    op = reduce_op(average, op)
    return _keep(ops, _moves.start_allreduce(ops, tensor, op, prescale_factor,
                                             postscale_factor, None, name_of(name)))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> int:
    """In-place form of :func:`allreduce_async`."""
    ops = user_ops("allreduce_async_", process_set)
    op = reduce_op(average, op)
    return _keep(ops, _moves.start_allreduce(ops, tensor, op, prescale_factor,
                                             postscale_factor, None, name_of(name), out=tensor))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """In place: ``tensor`` becomes its reduction over the workers."""
    ops = user_ops("allreduce_", process_set)
    op = reduce_op(average, op)
    return _moves.start_allreduce(ops, tensor, op, prescale_factor, postscale_factor, None,
                                  name_of(name), out=tensor).wait()


def start_grouped_allreduce(ops, tensors, op, pre, post, compression, name, in_place):
    """A grouped allreduce: plain host tensors as one collective (:mod:`~mpsync.torch.
    _grouped`), anything else part by part."""
    tensors = list(tensors)
    group = submit_plain_group(ops, tensors, op, pre, post, compression, name, in_place)
    if group is not None:
        return group
    parts = Parts()
    for i, t in enumerate(tensors):
        _moves.start_allreduce(ops, t, op, pre, post, compression, part_name(name, i),
                               out=t if in_place else None, submit=parts.submit)
    return ops.submit_group("grouped allreduce", name, parts.parts)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None) -> int:
    ops = user_ops("grouped_allreduce_async", process_set)
    return _keep(ops, start_grouped_allreduce(ops, tensors, reduce_op(average, op),
                                              prescale_factor, postscale_factor, None,
                                              name_of(name), False))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None) -> int:
    ops = user_ops("grouped_allreduce_async_", process_set)
    return _keep(ops, start_grouped_allreduce(ops, tensors, reduce_op(average, op),
                                              prescale_factor, postscale_factor, None,
                                              name_of(name), True))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None) -> list:
    ops = user_ops("grouped_allreduce_", process_set)
    return start_grouped_allreduce(ops, tensors, reduce_op(average, op), prescale_factor,
                                   postscale_factor, None, name_of(name), True).wait()


def start_sparse_allreduce(ops, tensor, op: int, name):
    """The indices and values of sparse COO ``tensor`` allgathered; the result is sparse."""
    if op not in (Average, Sum):
        raise ValueError(f"sparse allreduce supports op=Average or op=Sum, got {op!r}")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    base = name_of(name)
    idx = _moves.start_allgather(ops, t.indices().t().contiguous(),
                                 None if base is None else f"{base}.indices")
    val = _moves.start_allgather(ops, t.values().contiguous(),
                                 None if base is None else f"{base}.values")

    def combine(parts):
        indices, values = parts
        if op == Average:
            values = values / ops.size
        return torch.sparse_coo_tensor(indices.t(), values, t.shape).coalesce()

    return _Group([idx, val], combine)


class SparseHandle(int):
    """What :func:`sparse_allreduce_async` returns: called, it waits and returns the sparse
    result, as Horovod's function does; it is also a handle for ``poll`` / ``synchronize``."""

    def __call__(self):
        return synchronize(self)


def sparse_allreduce_async(tensor, name, op, process_set=None):
    """Horovod's sparse path: the indices and values of a sparse COO ``tensor`` are
    allgathered (so the result stays sparse, duplicates summed when coalesced); ``op=Average``
    divides the values by the number of workers.  Returns a callable that waits and returns
    the result (Horovod's), usable as a handle too."""
    ops = user_ops("sparse_allreduce_async", process_set)
    return SparseHandle(_keep(ops, start_sparse_allreduce(ops, tensor, reduce_op(None, op),
                                                          name_of(name) or "sparse")))


# -- data movement ------------------------------------------------------------------------------
def allgather_async(tensor, name=None, process_set=None) -> int:
    ops = user_ops("allgather_async", process_set)
    return _keep(ops, _moves.start_allgather(ops, tensor, name_of(name)))


def start_grouped_allgather(ops, tensors, name):
    """A grouped allgather: plain host tensors as one collective (:mod:`~mpsync.torch.
    _grouped`), anything else part by part."""
    tensors = list(tensors)

    def general():
        parts = Parts()
        for i, t in enumerate(tensors):
            _moves.start_allgather(ops, t, part_name(name, i), submit=parts.submit)
        return parts.parts

    group = submit_plain_allgather(ops, tensors, name, general)
    return group if group is not None else ops.submit_group("grouped allgather", name,
                                                            general())


def grouped_allgather_async(tensors, name=None, process_set=None) -> int:
    ops = user_ops("grouped_allgather_async", process_set)
    return _keep(ops, start_grouped_allgather(ops, tensors, name_of(name)))


def start_broadcast(ops, tensor, root_rank, name, out=None):
    root, error = _member_root(ops, root_rank)
    return _moves.start_broadcast(ops, tensor, root, name_of(name), out, error)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    ops = user_ops("broadcast_async", process_set)
    return _keep(ops, start_broadcast(ops, tensor, root_rank, name))


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    ops = user_ops("broadcast_async_", process_set)
    return _keep(ops, start_broadcast(ops, tensor, root_rank, name, out=tensor))


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    """In place: ``tensor`` becomes worker ``root_rank``'s."""
    ops = user_ops("broadcast_", process_set)
    return start_broadcast(ops, tensor, root_rank, name, out=tensor).wait()


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    """``synchronize`` returns (rows received, rows received from each worker)."""
    ops = user_ops("alltoall_async", process_set)
    return _keep(ops, _moves.start_alltoall(ops, tensor, splits, name_of(name)))


def start_reducescatter(ops, tensor, op, pre, post, compression, name):
    return _moves.start_reducescatter(ops, tensor, op, pre, post, compression, name)


def reducescatter_async(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    ops = user_ops("reducescatter_async", process_set)
    return _keep(ops, start_reducescatter(ops, tensor, reduce_op(None, op), prescale_factor,
                                          postscale_factor, None, name_of(name)))


def start_grouped_reducescatter(ops, tensors, op, pre, post, compression, name):
    """A grouped reduce-scatter: plain host tensors as one collective (:mod:`~mpsync.torch.
    _grouped`), anything else part by part."""
    tensors = list(tensors)

    def general():
        parts = Parts()
        for i, t in enumerate(tensors):
            _moves.start_reducescatter(ops, t, op, pre, post, compression,
                                       part_name(name, i), submit=parts.submit)
        return parts.parts

    group = submit_plain_reducescatter(ops, tensors, op, pre, post, compression, name,
                                       general)
    return group if group is not None else ops.submit_group("grouped reducescatter", name,
                                                            general())


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=None,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    ops = user_ops("grouped_reducescatter_async", process_set)
    return _keep(ops, start_grouped_reducescatter(ops, tensors, reduce_op(None, op),
                                                  prescale_factor, postscale_factor, None,
                                                  name_of(name)))


# -- handles ------------------------------------------------------------------------------------
def _find(handle):
    ctx = _runtime.worker_context("synchronize")
    from mpsync.torch.process_sets import every_ops

    for ops in every_ops(ctx):
        if handle in ops.handles:
            return ops, ops.handles[handle]
    return None, None


def poll(handle) -> bool:
    """True once the collective of ``handle`` has completed (``synchronize`` then returns
    without waiting)."""
    _, op = _find(handle)
    if op is None:
        raise ValueError(f"Handle {handle!r} was not created or has been cleared.")
    return op.test()


def synchronize(handle):
    """Wait for the collective of ``handle`` (with the deadline) and return its result; an
    unknown handle returns None, as in Horovod."""
    ops, op = _find(handle)
    if op is None:
        return None
    ops.handles.pop(handle, None)
    return op.wait()


# -- objects, barrier, join ----------------------------------------------------------------------
def allgather_object(obj, name=None, process_set=None) -> list:
    """Every worker's picklable ``obj``, as a list in worker order."""
    ops = user_ops("allgather_object", process_set)
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)
    sizes = _moves.start_allgather(ops, torch.tensor([data.numel()]), None).wait()
    flat = _moves.start_allgather(ops, data, name_of(name)).wait()
    out, at = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(flat[at:at + n].numpy().tobytes()))
        at += n
    return out


def barrier(process_set=None) -> None:
    """Wait until every worker (of the process set) has reached the barrier."""
    _moves.start_barrier(user_ops("barrier", process_set)).wait()


def join(device: int = -1) -> int:
    """This worker has no more data (Horovod's ``join``): until every worker has joined it
    takes part in the others' collectives -- their ``DistributedOptimizer`` aggregations
    (under every policy, see ``strategies``) and the script's own collectives (zeros into
    ``allreduce`` / ``reducescatter``, no rows into ``allgather``, a receiver of
    ``broadcast``; ``alltoall`` and a broadcast from a joined root raise
    HorovodInternalError on the others).  Returns the worker that joined last."""
    from mpsync.torch import joining

    return joining.join(_runtime.worker_context("join"))


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
