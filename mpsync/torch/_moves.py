"""The data steps of the script's collectives (:class:`~mpsync.torch._collectives.UserOps`):
each ``start_*`` builds this worker's record, checks its own arguments, and hands UserOps a
function that starts the data movement once every worker's record is in.

Reductions follow Horovod's arithmetic: ``prescale_factor`` scales each worker's tensor
before the sum and ``postscale_factor`` the result (for ``op=Average`` the postscale is
divided by the number of workers); on integer tensors each scaling is done in float64 and
truncated toward zero, so an integer Average is the truncated mean.  A CUDA tensor is staged
through host memory; the result comes back on its device.
"""

from __future__ import annotations

import numpy as np
import torch

from mpsync.torch import _metadata as meta
from mpsync.torch._collectives import (Average, Max, Min, Product, Sum, UserOps, dtype_code)
from mpsync.torch.dataplane.compression import as_compressor
from mpsync.torch.dataplane.progress import engine
from mpsync.torch.dataplane.exceptions import HorovodInternalError

__all__ = ["start_allreduce", "start_allgather", "start_broadcast", "start_alltoall",
           "start_barrier", "sum_half_", "take_part_joined", "reducescatter_rows"]

_MPI_OPS = {Sum: "SUM", Average: "SUM", Min: "MIN", Max: "MAX", Product: "PROD"}
_HALF = (torch.float16, torch.bfloat16)
_REDUCIBLE = (torch.float64, torch.float32, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8) + _HALF


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (the staging buffer for a CUDA tensor; a fresh buffer for CPU)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype)  # standard strides, even for size-1 dims
    return out.copy_(tensor.detach())


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor of any dtype (bfloat16 and bool too)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _mpi_op(op: int):
    from mpi4py import MPI

    return getattr(MPI, _MPI_OPS[op])


def _scale_(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` in ``x``'s dtype; integers go through float64 and truncate (Horovod)."""
    if factor == 1.0:
        return x
    if x.is_floating_point():
        return x.mul_(factor)
    return x.copy_((x.to(torch.float64) * factor).trunc().to(x.dtype))


def _deliver(y: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y.to(device=like.device, dtype=like.dtype)
    with torch.no_grad():
        out.copy_(y)
    return out


def _on_lane(ops: UserOps, nbytes: int, call):
    """A data step of ``nbytes`` (the same on every member) large enough to run as the
    blocking ``call(comm)`` on the progress engine's lane: its test (a
    :class:`~mpsync.torch.dataplane.progress.Flight`, whose event the waiter blocks on);
    None: start it non-blocking instead."""
    if not engine().use_lane(nbytes):
        return None
    lane = ops.lane
    return engine().run_on_lane(lane, lambda: call(lane))


# -- reductions -------------------------------------------------------------------------------
def _reduce_started(ops: UserOps, x: torch.Tensor, op: int):
    """Start reducing ``x`` in place over the members; returns its ``test``."""
    from mpi4py import MPI

    if x.dtype in _HALF:
        if op in (Sum, Average):
            sum_half_(ops, x, "half sum")
            return lambda: True
        y = x.to(torch.float32)
        req = ops.comm.Iallreduce(MPI.IN_PLACE, y.numpy(), op=_mpi_op(op))

        def test():
            if not req.Test():
                return False
            x.copy_(y)
            return True

        return test
    arr, mpi_op = x.numpy(), _mpi_op(op)
    flight = _on_lane(ops, arr.nbytes, lambda comm: comm.Allreduce(MPI.IN_PLACE, arr, op=mpi_op))
    if flight is not None:
        return flight
    return ops.comm.Iallreduce(MPI.IN_PLACE, arr, op=mpi_op).Test


def start_allreduce(ops: UserOps, tensor: torch.Tensor, op: int, prescale: float,
                    postscale: float, compression, name, out=None,
                    kind: int = meta.ALLREDUCE, finish=None, error=None):
    """Reduce ``tensor``; the result goes to ``out`` (default: a new tensor of ``tensor``'s
    dtype and device).  ``finish(y)`` replaces the delivery (reducescatter's slice)."""
    compression = as_compressor(compression)
    if error is None and tensor.dtype not in _REDUCIBLE:
        error = ValueError(f"{meta.KIND_NAMES[kind]}: tensor type {tensor.dtype} is not "
                           f"supported")
    wire, ctx = compression.compress(tensor.detach())
    rec = meta.record(ops.size, kind, dtype=dtype_code(wire.dtype), shape=tuple(wire.shape),
                      op=op, prescale=prescale, postscale=postscale, name=name,
                      nbytes=wire.numel() * wire.element_size())
    post = postscale / ops.size if op == Average else postscale

    def prepare():
        return _scale_(_host(wire), prescale)

    def finish_from(x):
        y = compression.decompress(_scale_(x, post), ctx)
        return finish(y) if finish is not None else _deliver(y, tensor, out)

    def start(_records):
        x = prepare()
        return _reduce_started(ops, x, op), lambda: finish_from(x)

    fusion = (prepare, finish_from, lambda buf: _reduce_started(ops, buf, op)) \
        if kind == meta.ALLREDUCE else None
    return ops.submit(meta.KIND_NAMES[kind], name, rec, start, error, fusion=fusion)


def reducescatter_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s rows: the first ``rows % size`` members get one more."""
    base, extra = divmod(rows, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def sum_half_(ops: UserOps, x: torch.Tensor, what: str = "half sum") -> torch.Tensor:
    """In place, the sum over the members of a contiguous CPU float16/bfloat16 tensor.

    The bandwidth-optimal allreduce as two exchanges of 2-byte values: each member receives
    everyone's copy of its own 1/N of the tensor (alltoall), adds them in float32, and the
    sums are gathered back (allgather).  Bytes moved per member: 2(N-1)/N x the tensor's
    bytes, half of what a float32 allreduce moves."""
    n, size = x.numel(), ops.size
    if size == 1 or n == 0:
        return x
    chunk = -(-n // size)
    padded = torch.zeros(chunk * size, dtype=x.dtype)
    padded[:n] = x.reshape(-1)
    send = padded.view(torch.int16).numpy()
    recv = np.empty_like(send)
    ops._wait(ops.comm.Ialltoall(send, recv), what + " (exchange)")
    parts = torch.from_numpy(recv).view(x.dtype).reshape(size, chunk)
    mine = parts.to(torch.float32).sum(dim=0).to(x.dtype).contiguous()
    gathered = np.empty_like(send)
    ops._wait(ops.comm.Iallgather(mine.view(torch.int16).numpy(), gathered), what + " (gather)")
    x.reshape(-1).copy_(torch.from_numpy(gathered).view(x.dtype)[:n])
    return x


# -- data movement ----------------------------------------------------------------------------
def _row_bytes(t: torch.Tensor) -> int:
    return int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()


def _rows(records: np.ndarray) -> np.ndarray:
    """Rows each member sends (a joined member: none)."""
    rows = records[:, meta.Field.DIMS].copy()
    rows[records[:, meta.Field.KIND] == meta.JOINED] = 0
    return rows


def _allgatherv(ops: UserOps, send: np.ndarray, out: np.ndarray, counts: np.ndarray):
    from mpi4py import MPI

    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    flight = _on_lane(ops, out.nbytes, lambda comm: comm.Allgatherv(
        [send, MPI.BYTE], [out, counts, displs, MPI.BYTE]))
    if flight is not None:
        return flight
    return ops.comm.Iallgatherv([send, MPI.BYTE], [out, counts, displs, MPI.BYTE]).Test


def start_allgather(ops: UserOps, tensor: torch.Tensor, name):
    """Every member's ``tensor`` concatenated along the first dimension, in member order."""
    error = None
    if tensor.dim() == 0:
        error = ValueError("allgather needs a tensor with at least one dimension")
    rec = meta.record(ops.size, meta.ALLGATHER, dtype=dtype_code(tensor.dtype),
                      shape=tuple(tensor.shape), name=name, row_bytes=_row_bytes(tensor)
                      if tensor.dim() else 0)

    def start(records):
        x = _host(tensor)
        rows = _rows(records)
        out = torch.empty((int(rows.sum()), *x.shape[1:]), dtype=x.dtype)
        test = _allgatherv(ops, _bytes_view(x), _bytes_view(out), rows * _row_bytes(x))
        return test, lambda: out.to(tensor.device)

    return ops.submit("allgather", name, rec, start, error)


def start_broadcast(ops: UserOps, tensor: torch.Tensor, root: int, name, out=None,
                    error=None):
    """Member ``root``'s ``tensor`` into ``out`` (in place) or a new tensor."""
    rec = meta.record(ops.size, meta.BROADCAST, dtype=dtype_code(tensor.dtype),
                      shape=tuple(tensor.shape), root=root, name=name,
                      nbytes=tensor.numel() * tensor.element_size())

    def start(_records):
        x = _host(tensor)
        # Ibcast spun on, never a lane: on a lane a 16 MB Bcast took 3-7x a plain Bcast
        # here, the spun Ibcast 1.05x (bench/collectives/README.md).
        req = ops.comm.Ibcast(_bytes_view(x), root=root)
        return req.Test, lambda: _deliver(x, tensor, out)

    return ops.submit("broadcast", name, rec, start, error)


def start_alltoall(ops: UserOps, tensor: torch.Tensor, splits, name):
    """Rows of ``tensor`` to each member (``splits``, default equal); returns (rows received,
    rows received from each member)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    error, send_rows = None, np.zeros(ops.size, dtype=np.int64)
    if tensor.dim() == 0:
        error = ValueError("alltoall needs a tensor with at least one dimension")
    elif splits is None:
        if rows % ops.size:
            error = ValueError(f"alltoall: first dimension {rows} does not split evenly over "
                               f"{ops.size} workers; pass splits=")
        else:
            send_rows[:] = rows // ops.size
    else:
        given = np.asarray(torch.as_tensor(splits).cpu(), dtype=np.int64).reshape(-1)
        if given.size != ops.size or np.any(given < 0) or given.sum() != rows:
            error = ValueError(f"alltoall: splits {given.tolist()} must be {ops.size} "
                               f"non-negative counts summing to {rows}")
        else:
            send_rows = given
    rec = meta.record(ops.size, meta.ALLTOALL, dtype=dtype_code(tensor.dtype),
                      shape=tuple(tensor.shape), name=name,
                      row_bytes=_row_bytes(tensor) if tensor.dim() else 0, splits=send_rows)

    def start(records):
        from mpi4py import MPI

        x = _host(tensor)
        recv_rows = records[:, meta.HEAD + ops.rank].copy()
        row = _row_bytes(x)
        out = torch.empty((int(recv_rows.sum()), *x.shape[1:]), dtype=x.dtype)
        sc, rc = send_rows * row, recv_rows * row
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(np.int64)
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(np.int64)
        req = ops.comm.Ialltoallv([_bytes_view(x), sc, sd, MPI.BYTE],
                                  [_bytes_view(out), rc, rd, MPI.BYTE])
        return req.Test, lambda: (out.to(tensor.device),
                                  torch.from_numpy(recv_rows.astype(np.int32)))

    return ops.submit("alltoall", name, rec, start, error)


def start_barrier(ops: UserOps):
    rec = meta.record(ops.size, meta.BARRIER)
    return ops.submit("barrier", None, rec, lambda _r: (ops.comm.Ibarrier().Test,
                                                         lambda: None))


def check_reducescatter(tensor: torch.Tensor, op: int) -> Exception | None:
    if op not in (Average, Sum):
        return HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM")
    if tensor.dim() == 0:
        return ValueError("reducescatter needs a tensor with at least one dimension")
    return None


# -- a joined member's part -------------------------------------------------------------------
def take_part_joined(ops: UserOps, records: np.ndarray):
    """Start a joined member's part of the collective the active members described: zeros
    into an allreduce, a barrier (Horovod answers the other kinds with an error while a worker
    has joined).  Returns its ``test`` (None: nothing to do); the caller polls it, so a joined
    worker keeps answering everything else meanwhile (its optimizers' aggregations)."""
    F = meta.Field
    active = records[records[:, F.KIND] != meta.JOINED]
    ref = active[0]
    kind = int(ref[F.KIND])
    if kind == meta.ALLREDUCE:
        from mpsync.torch._collectives import DTYPES

        dtype = DTYPES[int(ref[F.DTYPE])]
        zeros = torch.zeros(int(ref[F.NBYTES]) // torch.empty((), dtype=dtype).element_size(),
                            dtype=dtype)
        started = _reduce_started(ops, zeros, int(ref[F.OP]))
        return lambda: started() and zeros is not None  # the buffer lives until it is done
    if kind == meta.BARRIER:
        return ops.comm.Ibarrier().Test
    return None
