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

import math

import numpy as np
import torch

from mpsync.torch import _metadata as meta
from mpsync.torch._collectives import (Average, Fusable, Max, Min, Product, Sum, UserOps,
                                       average_scales, dtype_code, scale_,
                                       wait_while_stepping)
from mpsync.torch.dataplane.compression import as_compressor
from mpsync.torch.dataplane.progress import engine
from mpsync.torch.dataplane.scratch import pool
from mpsync.torch.dataplane.exceptions import HorovodInternalError

__all__ = ["start_allreduce", "start_allgather", "start_broadcast", "start_alltoall",
           "start_barrier", "sum_half_", "take_part_joined", "reducescatter_rows"]

_MPI_OPS = {Sum: "SUM", Average: "SUM", Min: "MIN", Max: "MAX", Product: "PROD"}
_HALF = (torch.float16, torch.bfloat16)
_REDUCIBLE = (torch.float64, torch.float32, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8) + _HALF


def _host(tensor: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """A contiguous CPU copy (the staging buffer for a CUDA tensor; a new buffer for CPU,
    leased from the pool from its size on: :meth:`ScratchPool.result`), times ``factor``
    (:func:`scale_`'s arithmetic; a CPU float tensor's in the copy's one pass)."""
    out = pool().result(tensor.shape, tensor.dtype)  # standard strides, even for size-1 dims
    if factor != 1.0 and tensor.is_floating_point() and tensor.device.type == "cpu":
        return torch.mul(tensor.detach(), factor, out=out)
    return scale_(out.copy_(tensor.detach()), factor)


def _readable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself where MPI can read it in place (a contiguous CPU tensor), else
    :func:`_host`'s copy.  A send buffer need not be copied: as in Horovod, a collective reads
    its input when its data step starts.  Copying it anyway cost a whole pass over fresh pages
    (64 MB: about 30 ms here, most of it page faults)."""
    if tensor.device.type == "cpu" and _standard_strides(tensor):
        return tensor.detach()
    return _host(tensor)


def _own_buffer(wire: torch.Tensor, tensor: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """A CPU buffer holding ``wire`` times ``factor`` that may be reduced in place: ``wire``
    itself when the compressor made it (fp16's cast: a tensor of its own), else
    :func:`_host`'s copy."""
    if wire.device.type == "cpu" and _standard_strides(wire) and \
            wire.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
        return scale_(wire, factor)
    return _host(wire, factor)


def _standard_strides(t: torch.Tensor) -> bool:
    """Row-major strides in every dimension, size-1 ones too (``is_contiguous`` ignores
    those, and a flat view of such a tensor can keep a stride that is not 1)."""
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if stride != expected:
            return False
        expected *= size
    return True


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor of any dtype (bfloat16 and bool too)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _mpi_op(op: int):
    from mpi4py import MPI

    return getattr(MPI, _MPI_OPS[op])


def _deliver(y: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y.to(device=like.device, dtype=like.dtype)
    with torch.no_grad():
        out.copy_(y)
    return out


def _on_lane(ops: UserOps, nbytes: int, call, reduction: bool = False):
    """A data step of ``nbytes`` (the same on every member) large enough to run as the
    blocking ``call(comm)`` on the progress engine's lane: its test (a
    :class:`~mpsync.torch.dataplane.progress.Flight`, whose event the waiter blocks on);
    None: start it non-blocking instead.  ``reduction``: an allreduce (its own threshold,
    :meth:`~mpsync.torch.dataplane.progress.ProgressEngine.use_lane`)."""
    if not engine().use_lane(nbytes, reduction=reduction):
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
    flight = _on_lane(ops, arr.nbytes, lambda comm: comm.Allreduce(MPI.IN_PLACE, arr,
                                                                   op=mpi_op), reduction=True)
    if flight is not None:
        return flight
    return ops.comm.Iallreduce(MPI.IN_PLACE, arr, op=mpi_op).Test


def start_allreduce(ops: UserOps, tensor: torch.Tensor, op: int, prescale: float,
                    postscale: float, compression, name, out=None,
                    kind: int = meta.ALLREDUCE, finish=None, error=None, submit=None):
    """Reduce ``tensor``; the result goes to ``out`` (default: a new tensor of ``tensor``'s
    dtype and device).  ``finish(y)`` replaces the delivery (reducescatter's slice).
    ``submit`` (every ``start_*`` here): where the collective goes, ``ops.submit`` by
    default, a grouped call's :class:`~mpsync.torch._collectives.Parts` for its parts."""
    compression = as_compressor(compression)
    if error is None and tensor.dtype not in _REDUCIBLE:
        error = ValueError(f"{meta.KIND_NAMES[kind]}: tensor type {tensor.dtype} is not "
                           f"supported")
    wire, ctx = compression.compress(tensor.detach())
    rec = meta.record(ops.size, kind, dtype=dtype_code(wire.dtype), shape=tuple(wire.shape),
                      op=op, prescale=prescale, postscale=postscale, name=name,
                      nbytes=wire.numel() * wire.element_size())
    pre, post = average_scales(op, wire.dtype, ops.size, prescale, postscale)

    def prepare():
        return _own_buffer(wire, tensor, pre)

    def deliver(x):  # the result from the reduced, postscaled x
        y = compression.decompress(x, ctx)
        return finish(y) if finish is not None else _deliver(y, tensor, out)

    def start(_records):
        x = prepare()
        return _reduce_started(ops, x, op), lambda: deliver(scale_(x, post))

    # A fused step packs the wire tensor itself (the packing is the copy, whatever its
    # strides); a device tensor is staged on the host first.
    fusion = Fusable(lambda: wire if wire.is_cpu else _host(wire),
                     lambda buf: _reduce_started(ops, buf, op),
                     deliver, pre, post) \
        if kind in (meta.ALLREDUCE, meta.REDUCESCATTER) else None
    return (submit or ops.submit)(meta.KIND_NAMES[kind], name, rec, start, error,
                                  fusion=fusion)


def start_reducescatter(ops: UserOps, tensor: torch.Tensor, op: int, prescale: float,
                        postscale: float, compression, name, submit=None):
    """Member ``rank``'s rows of the reduction of ``tensor`` over the members (rows split as
    :func:`reducescatter_rows`): each member receives and reduces only its own rows, (N-1)/N
    of the tensor's bytes in and out, half of what an allreduce moves.  One
    ``Ireduce_scatter`` below the lane's size, else :func:`_reduce_scatter_by_alltoall`.
    float16/bfloat16 (MPI has no sum for them) go through :func:`sum_half_` and keep their
    rows."""
    rows = tensor.shape[0] if tensor.dim() else 0
    first, count = reducescatter_rows(rows, ops.size, ops.rank)

    def keep_rows(y):
        return y[first:first + count].clone().to(tensor.device, tensor.dtype)

    error = check_reducescatter(tensor, op)
    if error is not None or tensor.dtype in _HALF or tensor.dtype not in _REDUCIBLE:
        return start_allreduce(ops, tensor, op, prescale, postscale, compression, name,
                               kind=meta.REDUCESCATTER, finish=keep_rows, error=error,
                               submit=submit)
    compression = as_compressor(compression)
    wire, ctx = compression.compress(tensor.detach())
    if wire.dtype in _HALF:  # an fp16 wire: the half sum, as above
        return start_allreduce(ops, tensor, op, prescale, postscale, compression, name,
                               kind=meta.REDUCESCATTER, finish=keep_rows, submit=submit)
    rec = meta.record(ops.size, meta.REDUCESCATTER, dtype=dtype_code(wire.dtype),
                      shape=tuple(wire.shape), op=op, prescale=prescale, postscale=postscale,
                      name=name, nbytes=wire.numel() * wire.element_size())
    post = postscale / ops.size if op == Average else postscale
    per_row = math.prod(wire.shape[1:])
    counts = np.array([reducescatter_rows(rows, ops.size, m)[1] * per_row
                       for m in range(ops.size)], dtype=np.int64)

    def start(_records):
        from mpi4py import MPI

        x = _readable(wire) if prescale == 1.0 else scale_(_host(wire), prescale)
        if engine().use_lane(x.numel() * x.element_size()):
            return _reduce_scatter_by_alltoall(ops, x, counts, finish)
        out = pool().result((count, *wire.shape[1:]), wire.dtype)
        send, recv = x.reshape(-1).numpy(), out.reshape(-1).numpy()
        req = ops.comm.Ireduce_scatter(send, recv, counts, op=MPI.SUM)

        def test():  # holds the buffers: the request alone does not keep them alive
            return req.Test() and x is not None and out is not None

        return test, lambda: finish(out)

    def finish(out):
        y = compression.decompress(scale_(out.view(count, *wire.shape[1:]), post), ctx)
        return y.to(tensor.device, tensor.dtype)

    def deliver(x):  # fused: x is the whole reduction (postscaled), these rows are kept
        y = compression.decompress(x[first:first + count], ctx)
        return y.to(tensor.device, tensor.dtype)

    # Small ones fuse into one allreduce (_negotiation.REDUCESCATTER_FUSION_BYTES).
    fusion = Fusable(lambda: wire if wire.is_cpu else _host(wire),
                     lambda buf: _reduce_started(ops, buf, op), deliver, prescale, post)
    return (submit or ops.submit)("reducescatter", name, rec, start, fusion=fusion)


def _reduce_scatter_by_alltoall(ops: UserOps, x: torch.Tensor, counts: np.ndarray, finish):
    """A large reduce-scatter as an ``Alltoallv`` on the lane (each member receives every
    member's copy of its own elements, into a scratch buffer) and the sum of those parts into
    the result.  Open MPI's ``Reduce_scatter`` was slower than its in-place ``Allreduce`` of
    the whole tensor here (np 2, 16 MB: 14.2 ms against 2.9 ms; 64 MB: 75 ms against 28 ms);
    the alltoall moves the same (N-1)/N of the bytes and the sum reads them once."""
    from mpi4py import MPI

    item = x.element_size()
    mine = int(counts[ops.rank])
    parts = pool().take(ops.size * mine * item, x.dtype).view(ops.size, mine)
    sc = counts * item
    sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(np.int64)
    rc = np.full(ops.size, mine * item, dtype=np.int64)
    rd = np.arange(ops.size, dtype=np.int64) * mine * item
    send = [_bytes_view(x), sc, sd, MPI.BYTE]
    recv = [_bytes_view(parts), rc, rd, MPI.BYTE]
    flight = engine().run_on_lane(ops.lane, lambda: ops.lane.Alltoallv(send, recv))

    def summed():
        out = pool().result((mine,), x.dtype)
        if ops.size == 2:
            torch.add(parts[0], parts[1], out=out)
        else:
            torch.sum(parts, dim=0, dtype=x.dtype, out=out)
        pool().give(parts)
        return finish(out)

    return flight, summed


def reducescatter_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s rows: the first ``rows % size`` members get one more."""
    base, extra = divmod(rows, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def sum_half_(ops: UserOps, x: torch.Tensor, what: str = "half sum") -> torch.Tensor:
    """In place, the sum over the members of a contiguous CPU float16/bfloat16 tensor.

    One allreduce of the 2-byte values with a sum of their own type, registered with MPI (it
    has none for them), as Horovod registers its float16 sum: each pair of partial sums is
    added in float32 and rounded once (torch's half addition), and MPI's own algorithm moves
    the bytes.  A large one runs blocking on the lane, as the allreduce does.

    It replaced an alltoall of the parts, a float32 sum of each member's part and an
    allgather: two exchanges and a pass more.  Measured here with plain mpi4py (2 cores,
    median of 15, ms): np 2, 16 MB: 7.5 against 9.9; np 4, 16 MB: 20 against 56; np 4,
    64 MB: 152 against 397.  With more than 2 members the sum is rounded after each
    addition, not once at the end (Horovod's too).  Every member receives the same bits: the
    addition commutes, and Open MPI's algorithms add the same partial sums on every member
    (tests/lane_programs.py checks it on 3)."""
    if ops.size == 1 or x.numel() == 0:
        return x
    from mpi4py import MPI

    values = x.view(-1).view(torch.int16).numpy()
    op = _half_sum_op(x.dtype)
    _exchange(ops, values.nbytes,
              lambda comm: comm.Allreduce(MPI.IN_PLACE, [values, MPI.SHORT], op=op),
              lambda: ops.comm.Iallreduce(MPI.IN_PLACE, [values, MPI.SHORT], op=op), what)
    return x


_HALF_SUMS: dict = {}


def _half_sum_op(dtype: torch.dtype):
    """The MPI reduction that adds ``dtype`` (float16 or bfloat16) values carried as MPI
    shorts: created once per dtype, for the life of the process."""
    op = _HALF_SUMS.get(dtype)
    if op is None:
        from mpi4py import MPI

        def add(inbuf, inoutbuf, _datatype):
            if len(inoutbuf):
                torch.frombuffer(inoutbuf, dtype=dtype).add_(
                    torch.frombuffer(inbuf, dtype=dtype))

        op = _HALF_SUMS[dtype] = MPI.Op.Create(add, commute=True)
    return op


def _exchange(ops: UserOps, nbytes: int, blocking, start, what: str) -> None:
    """Run one step of a collective now: ``blocking(comm)`` on the lane when ``nbytes`` (the
    same on every member) is large, else the request ``start()`` returns, waited on."""
    flight = _on_lane(ops, nbytes, blocking)
    if flight is None:
        ops._wait(start(), what)
        return
    wait_while_stepping(flight, deadline=ops.deadline, what=what, idle=ops.idle,
                        watch=ops.watch, seq=ops.execs, event=flight.event)


# -- data movement ----------------------------------------------------------------------------
def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()  # (np.prod: 10x the time per call)


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
    req = ops.comm.Iallgatherv([send, MPI.BYTE], [out, counts, displs, MPI.BYTE])

    def test():  # holds the buffers: the request alone does not keep them alive
        return req.Test() and send is not None and out is not None

    return test


def start_allgather(ops: UserOps, tensor: torch.Tensor, name, submit=None):
    """Every member's ``tensor`` concatenated along the first dimension, in member order."""
    error = None
    if tensor.dim() == 0:
        error = ValueError("allgather needs a tensor with at least one dimension")
    rec = meta.record(ops.size, meta.ALLGATHER, dtype=dtype_code(tensor.dtype),
                      shape=tuple(tensor.shape), name=name, row_bytes=_row_bytes(tensor)
                      if tensor.dim() else 0)

    def start(records):
        x = _readable(tensor)
        rows = _rows(records)
        out = pool().result((int(rows.sum()), *x.shape[1:]), x.dtype)
        test = _allgatherv(ops, _bytes_view(x), _bytes_view(out), rows * _row_bytes(x))
        return test, lambda: out.to(tensor.device)

    # Fused with others (one shape on every worker): the packed bytes in one allgather.
    fusion = Fusable(lambda: _readable(tensor),
                     lambda send, out, counts: _allgatherv(ops, send, out, counts),
                     lambda out: out.to(tensor.device))
    return (submit or ops.submit)("allgather", name, rec, start, error, fusion=fusion)


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

        x = _readable(tensor)
        recv_rows = records[:, meta.HEAD + ops.rank].copy()
        row = _row_bytes(x)
        out = pool().result((int(recv_rows.sum()), *x.shape[1:]), x.dtype)
        sc, rc = send_rows * row, recv_rows * row
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(np.int64)
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(np.int64)
        send, recv = [_bytes_view(x), sc, sd, MPI.BYTE], [_bytes_view(out), rc, rd, MPI.BYTE]
        # The lane's size test must agree on every member: the bytes moved in all, which
        # every member knows from the records (each one's own sends differ).
        total = int(records[:, meta.HEAD:meta.HEAD + ops.size].sum()) * row
        test = _on_lane(ops, total // max(ops.size, 1),
                        lambda comm: comm.Alltoallv(send, recv))
        if test is None:
            req = ops.comm.Ialltoallv(send, recv)

            def test():  # holds the buffers: the request alone does not keep them alive
                return req.Test() and x is not None and out is not None
        return test, lambda: (out.to(tensor.device),
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
    ref = meta.reference(records)
    kind = int(ref[F.KIND])
    if kind == meta.GROUP:  # a grouped allreduce: zeros into each of its data steps
        from mpsync.torch import _negotiation as neg

        parts = meta.group_parts(records)
        tests = [_zeros_reduced(ops, [parts[i] for i in step])
                 for step in neg.group_steps(parts, ops.answered_fusion_bytes)]
        tests = [t for t in tests if t is not None]

        def test():
            tests[:] = [t for t in tests if not t()]
            return not tests

        return test
    if kind == meta.ALLREDUCE:
        return _zeros_reduced(ops, [records])
    if kind == meta.BARRIER:
        return ops.comm.Ibarrier().Test
    return None


def _zeros_reduced(ops: UserOps, parts: list[np.ndarray]):
    """A joined member's zeros into one allreduce data step of ``parts`` (each its members'
    records; several: a fused step); its ``test`` (None: not an allreduce)."""
    F = meta.Field
    ref = meta.reference(parts[0])
    if int(ref[F.KIND]) != meta.ALLREDUCE:
        return None
    from mpsync.torch._collectives import DTYPES

    dtype = DTYPES[int(ref[F.DTYPE])]
    nbytes = sum(int(meta.reference(p)[F.NBYTES]) for p in parts)
    zeros = torch.zeros(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
    started = _reduce_started(ops, zeros, int(ref[F.OP]))
    return lambda: started() and zeros is not None  # the buffer lives until it is done
