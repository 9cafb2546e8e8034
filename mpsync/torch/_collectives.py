"""The machinery under :mod:`mpsync.torch.mpi_ops`: the reduce ops, bounded waits that keep
answering the state server, handles of asynchronous collectives, and :class:`UserOps`, the
collectives on a ``Dup()`` of the workers' communicator (or through Horovod).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from mpsync.torch import _runtime
from mpsync.torch._wait import poll_until_done
from mpsync.torch.compression import as_compressor

# Horovod's values, so ``op=horovod.torch.Average`` means the same here.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}


def reduce_op(average=None, op=None) -> int:
    """Horovod's rule: ``op`` wins; the deprecated ``average`` flag maps to Average/Sum;
    neither means Average.  Adasum is refused with what to use instead."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduce op {op!r}; use Average, Sum, Min, Max or Product")
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by mpsync; use op=Average (Adasum needs "
                         "Horovod's own DistributedOptimizer: run the script on horovod.torch)")
    return op


def _check_process_set(process_set) -> None:
    if process_set is None:
        return
    if getattr(process_set, "process_set_id", None) == 0:
        return  # Horovod's global_process_set: all workers, which is what mpsync reduces over
    raise ValueError("process_set: mpsync collectives run over all workers; only the global "
                     "process set is supported")


# A script's collective that has waited this long while a policy with local steps runs:
# the others may be inside an aggregation this worker has not been told about yet (they
# finished their loop at another point of the sync schedule), so it starts taking part.
_IDLE_AFTER_S = 0.2


def wait_while_stepping(test, *, deadline: float, what: str, idle=None) -> None:
    """``test()`` until True, within ``deadline``; after ``_IDLE_AFTER_S`` each poll also runs
    ``idle()`` (the strategies' idle iterations: ask the server, aggregate on SYNC)."""
    if idle is None:
        poll_until_done(test, deadline=deadline, what=what, watch=None, seq=0, sleep=1e-4,
                        spin_for=2e-3)
        return
    try:
        poll_until_done(test, deadline=_IDLE_AFTER_S, what=what, watch=None, seq=0,
                        sleep=1e-4, spin_for=2e-3)
        return
    except TimeoutError:
        pass
    start = time.monotonic()
    while not test():
        if not idle():
            time.sleep(1e-3)
        if time.monotonic() - start > deadline:
            from mpsync.torch._wait import CollectiveTimeout

            raise CollectiveTimeout(what, deadline, [])


class _Op:
    """A started collective: ``test()`` progresses it, ``wait()`` finishes it (deadline),
    ``result`` is what ``synchronize(handle)`` returns."""

    def __init__(self, test, finish, what: str, deadline: float, idle=None):
        self._test, self._finish, self.what, self.deadline = test, finish, what, deadline
        self.idle = idle
        self.done = False
        self.result = None

    def test(self) -> bool:
        if not self.done and self._test():
            self.result = self._finish()
            self.done = True
        return self.done

    def wait(self):
        if not self.done:
            wait_while_stepping(self._test, deadline=self.deadline, what=self.what,
                                idle=self.idle)
            self.result = self._finish()
            self.done = True
        return self.result


def _done(result, what: str) -> _Op:
    op = _Op(lambda: True, lambda: result, what, 0.0)
    op.test()
    return op


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (the staging buffer for a CUDA tensor; a fresh buffer for CPU)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor of any dtype (bfloat16 and bool too)."""
    return t.reshape(-1).view(torch.uint8).numpy()


_MPI_OPS = {Sum: "SUM", Average: "SUM", Min: "MIN", Max: "MAX", Product: "PROD"}
_REDUCIBLE = (torch.float64, torch.float32, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8)


class UserOps:
    """The script's collectives over one communicator of the workers (a ``Dup()`` reserved
    for them); ``hvd``: Horovod initialised on the same workers, used for allreduce."""

    def __init__(self, comm, deadline: float, hvd=None, idle=None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.deadline = float(deadline)
        self.hvd = hvd
        # Called while a collective waits (see wait_while_stepping); True if it did something.
        self.idle = idle
        self.handles: dict[int, _Op] = {}
        self._ids = itertools.count(1)

    def _wait(self, req, what: str) -> None:
        wait_while_stepping(req.Test, deadline=self.deadline, what=what, idle=self.idle)

    def _op(self, test, finish, what: str) -> _Op:
        return _Op(test, finish, what, self.deadline, self.idle)

    def keep(self, op: _Op) -> int:
        handle = next(self._ids)
        self.handles[handle] = op
        return handle

    # -- reductions ---------------------------------------------------------------------------
    def start_allreduce(self, tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                        compression, what: str, out: torch.Tensor | None = None) -> _Op:
        """Reduce ``tensor`` over the workers; the result goes to ``out`` (default: a new
        tensor of ``tensor``'s dtype and device)."""
        compression = as_compressor(compression)
        if tensor.dtype == torch.bool or tensor.is_complex():
            raise TypeError(f"allreduce of a {tensor.dtype} tensor is not supported")
        if op == Average and not tensor.is_floating_point():
            raise TypeError(f"allreduce: cannot average a {tensor.dtype} tensor (no integer "
                            f"result); pass op=Sum (or average=False) for its exact sum, or "
                            f"convert it to a floating dtype")
        source = tensor.detach()
        wire, ctx = compression.compress(source)
        if self.hvd is not None and tensor.device.type == "cpu":
            buf = wire.clone() if wire is source else wire.contiguous()
            return self._start_hvd(tensor, buf, ctx, op, prescale, postscale, compression,
                                   what, out)
        what = what or "allreduce"
        x = _host(wire)
        if x.dtype in (torch.float16, torch.bfloat16):
            self._reduce_half(x, op, prescale, what)
        else:
            if x.dtype not in _REDUCIBLE:
                raise TypeError(f"allreduce: cannot reduce {x.dtype}")
            if prescale != 1.0:
                x.mul_(prescale)
            from mpi4py import MPI

            req = self.comm.Iallreduce(MPI.IN_PLACE, x.numpy(), op=getattr(MPI, _MPI_OPS[op]))

        def finish():
            y = x
            if op == Average:
                y = y.div_(self.size)
            if postscale != 1.0:
                y = y.mul_(postscale) if y.is_floating_point() else (y * postscale).to(y.dtype)
            y = compression.decompress(y, ctx)
            return _deliver(y, tensor, out)

        if x.dtype in (torch.float16, torch.bfloat16):
            return _done(finish(), what)
        return self._op(req.Test, finish, what)

    def _start_hvd(self, tensor, buf, ctx, op, prescale, postscale, compression, what, out):
        hvd = self.hvd
        # Horovod matches in-flight collectives by name; unnamed ones get its own unique name.
        name = None if what is None else f"mpsync.user.{what}"
        handle = hvd.allreduce_async_(buf, name=name, op=op, prescale_factor=prescale,
                                      postscale_factor=postscale)
        what = what or "allreduce"

        def finish():
            hvd.synchronize(handle)
            return _deliver(compression.decompress(buf, ctx), tensor, out)

        return self._op(lambda: hvd.poll(handle), finish, what)

    def _reduce_half(self, x: torch.Tensor, op: int, prescale: float, what: str) -> None:
        """float16/bfloat16 in place: MPI has no such datatype to reduce, so Sum/Average move
        the 2-byte values themselves (:meth:`sum_half_`) and add in float32; Min/Max/Product
        reduce a float32 copy."""
        if prescale != 1.0:
            x.mul_(prescale)
        if op in (Sum, Average):
            self.sum_half_(x, what)
            return
        from mpi4py import MPI

        y = x.to(torch.float32)
        req = self.comm.Iallreduce(MPI.IN_PLACE, y.numpy(), op=getattr(MPI, _MPI_OPS[op]))
        self._wait(req, what)
        x.copy_(y)

    def sum_half_(self, x: torch.Tensor, what: str = "half sum") -> torch.Tensor:
        """In place, the sum over the workers of a contiguous CPU float16/bfloat16 tensor.

        The bandwidth-optimal allreduce as two exchanges of 2-byte values: each worker
        receives everyone's copy of its own 1/N of the tensor (alltoall), adds them in
        float32, and the sums are gathered back (allgather).  Bytes moved per worker:
        2(N-1)/N x the tensor's bytes, half of what a float32 allreduce moves."""

        n, size = x.numel(), self.size
        if size == 1 or n == 0:
            return x
        chunk = -(-n // size)
        padded = torch.zeros(chunk * size, dtype=x.dtype)
        padded[:n] = x.reshape(-1)
        send = padded.view(torch.int16).numpy()
        recv = np.empty_like(send)
        self._wait(self.comm.Ialltoall(send, recv), what + " (exchange)")
        parts = torch.from_numpy(recv).view(x.dtype).reshape(size, chunk)
        mine = parts.to(torch.float32).sum(dim=0).to(x.dtype).contiguous()
        gathered = np.empty_like(send)
        self._wait(self.comm.Iallgather(mine.view(torch.int16).numpy(), gathered),
                   what + " (gather)")
        x.reshape(-1).copy_(torch.from_numpy(gathered).view(x.dtype)[:n])
        return x

    # -- data movement ------------------------------------------------------------------------
    def allgather(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        from mpi4py import MPI

        x = _host(tensor)
        if x.dim() == 0:
            raise ValueError("allgather needs a tensor with at least one dimension")
        shapes = np.empty((self.size, x.dim()), dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array(x.shape, dtype=np.int64), shapes),
                   what + " (shapes)")
        if np.any(shapes[:, 1:] != shapes[self.rank, 1:]):
            raise ValueError(f"allgather {what!r}: tensors differ beyond the first dimension: "
                             f"{[tuple(s) for s in shapes.tolist()]}")
        row = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
        counts = shapes[:, 0] * row
        out = torch.empty((int(shapes[:, 0].sum()), *x.shape[1:]), dtype=x.dtype)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self._wait(self.comm.Iallgatherv(_bytes_view(x),
                                         [_bytes_view(out), counts, displs, MPI.BYTE]), what)
        return out.to(tensor.device)

    def broadcast_(self, tensor: torch.Tensor, root: int, what: str) -> torch.Tensor:
        _check_root(root, self.size)
        x = _host(tensor)
        self._wait(self.comm.Ibcast(_bytes_view(x), root=root), what)
        with torch.no_grad():
            tensor.copy_(x)
        return tensor

    def alltoall(self, tensor: torch.Tensor, splits, what: str):
        from mpi4py import MPI

        x = _host(tensor)
        rows = x.shape[0] if x.dim() else 0
        if splits is None:
            if rows % self.size:
                raise ValueError(f"alltoall {what!r}: first dimension {rows} does not split "
                                 f"evenly over {self.size} workers; pass splits=")
            send_rows = np.full(self.size, rows // self.size, dtype=np.int64)
        else:
            send_rows = np.asarray(torch.as_tensor(splits).cpu(), dtype=np.int64).reshape(-1)
            if send_rows.size != self.size or np.any(send_rows < 0) or send_rows.sum() != rows:
                raise ValueError(f"alltoall {what!r}: splits {send_rows.tolist()} must be "
                                 f"{self.size} non-negative counts summing to {rows}")
        recv_rows = np.empty(self.size, dtype=np.int64)
        self._wait(self.comm.Ialltoall(send_rows, recv_rows), what + " (splits)")
        row = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
        out = torch.empty((int(recv_rows.sum()), *x.shape[1:]), dtype=x.dtype)
        sc, rc = send_rows * row, recv_rows * row
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        self._wait(self.comm.Ialltoallv([_bytes_view(x), sc, sd, MPI.BYTE],
                                        [_bytes_view(out), rc, rd, MPI.BYTE]), what)
        out = out.to(tensor.device)
        if splits is None:
            return out
        return out, torch.from_numpy(recv_rows.astype(np.int32))

    def barrier(self, what: str = "barrier") -> None:
        self._wait(self.comm.Ibarrier(), what)

    def allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        from mpi4py import MPI

        sizes = np.empty(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array([len(data)], dtype=np.int64), sizes),
                   what + " (sizes)")
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self._wait(self.comm.Iallgatherv(np.frombuffer(data, dtype=np.uint8),
                                         [out, sizes, displs, MPI.BYTE]), what)
        return [out[a:a + n].tobytes() for a, n in zip(displs, sizes)]


def _deliver(y: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y.to(device=like.device, dtype=like.dtype)
    with torch.no_grad():
        out.copy_(y)
    return out


def _check_root(root: int, size: int) -> None:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root_rank must be a worker rank in 0..{size - 1}, got {root!r}")


def user_ops(what: str) -> UserOps:
    """This run's :class:`UserOps`, made on first use (the first collective a script calls
    is called by every worker, so the ``Dup()`` is too)."""
    ctx = _runtime.worker_context(what)
    if ctx.user_ops is None:
        hvd = ctx.hvd if ctx.config.backend == "horovod" else None

        def idle() -> bool:
            stepped = False
            for opt in ctx.optimizers:
                stepped = opt.strategy.idle_step() or stepped
            return stepped

        ctx.user_ops = UserOps(ctx.workers.Dup(), ctx.config.deadline, hvd, idle)
    return ctx.user_ops


def _name(name, default: str) -> str:
    return str(name) if name is not None else default


def _opt_name(name) -> str | None:
    return None if name is None else str(name)
