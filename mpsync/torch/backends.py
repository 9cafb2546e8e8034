"""Aggregation backends for the ring topology: average a flat buffer over the workers.

Both implement one small interface, :class:`Aggregator`:

* ``allreduce_average_(flat, what)``: in place, blocking, with the deadline;
* ``start_allreduce_average(flat, what)`` -> :class:`Pending` (``test()``, ``wait()``): the
  non-blocking form OSP's In-Computation Sync overlaps with the next iteration (OSP §3.1);
* ``broadcast_(flat, root)`` and ``broadcast_bytes(data, root)``.

``mpi`` uses mpi4py ``Iallreduce`` on the tensor's memory (no copy); ``horovod`` uses Horovod's
async ops, initialised on the workers' communicator so a dedicated server rank never joins a
Horovod collective.  Every wait polls with the deadline of :mod:`mpsync.torch._wait`.
The parameter-server exchange is not an allreduce and lives in :mod:`mpsync.torch.strategies`.
"""

from __future__ import annotations

import numpy as np
import torch

from mpsync.torch._wait import PeerWatch, poll_until_done

__all__ = ["Aggregator", "MPIAggregator", "HorovodAggregator", "EmulatedLink", "Pending",
           "mpi_dtype_ok"]

_MPI_DTYPES = (torch.float64, torch.float32, torch.int64, torch.int32, torch.float16)


def mpi_dtype_ok(dtype: torch.dtype) -> bool:
    return dtype in _MPI_DTYPES


class Pending:
    """An in-flight collective: ``test()`` makes progress and says whether it is done,
    ``wait()`` blocks (with the deadline) and finishes it."""

    def __init__(self, test, finish, what: str, seq: int, aggregator: "Aggregator"):
        self._test = test
        self._finish = finish
        self.what = what
        self.seq = seq
        self._agg = aggregator
        self.done = False

    def test(self) -> bool:
        if not self.done and self._test():
            self._finish()
            self.done = True
        return self.done

    def wait(self) -> None:
        if self.done:
            return
        poll_until_done(self._test, deadline=self._agg.deadline, what=self.what,
                        watch=self._agg.watch, seq=self.seq, sleep=self._agg.poll_sleep,
                        spin_for=self._agg.poll_spin)
        self._finish()
        self.done = True


class Aggregator:
    """Averages flat buffers over ``size`` workers; ``rank`` is this worker's index."""

    name = "?"
    poll_sleep = 0.0   # see poll_until_done: sleep between polls after spin_for seconds
    poll_spin = 0.0

    def __init__(self, rank: int, size: int, deadline: float, watch: PeerWatch | None):
        self.rank = rank
        self.size = size
        self.deadline = float(deadline)
        self.watch = watch
        self.seq = 0  # collectives started; equal on every worker, names them in errors

    def _next(self, what: str) -> tuple[str, int]:
        self.seq += 1
        if self.watch is not None:
            self.watch.drain()
        return f"{self.name} {what} (collective #{self.seq})", self.seq

    def allreduce_average_(self, flat: torch.Tensor, what: str = "allreduce") -> torch.Tensor:
        self.start_allreduce_average(flat, what).wait()
        return flat

    def start_allreduce_average(self, flat: torch.Tensor, what: str = "allreduce") -> Pending:
        raise NotImplementedError

    def broadcast_(self, flat: torch.Tensor, root: int, what: str = "broadcast") -> torch.Tensor:
        raise NotImplementedError

    def broadcast_bytes(self, data: bytes | None, root: int, what: str = "broadcast") -> bytes:
        """Broadcast a byte string (pickled optimizer state); ``data`` is ignored off root."""
        n = torch.zeros(1, dtype=torch.int64)
        if self.rank == root:
            n[0] = len(data)
        self.broadcast_(n, root, what + " size")
        buf = torch.zeros(int(n[0]), dtype=torch.uint8)
        if self.rank == root:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast_(buf, root, what)
        return buf.numpy().tobytes()

    def barrier(self, what: str = "barrier") -> None:
        raise NotImplementedError


class MPIAggregator(Aggregator):
    """mpi4py on a communicator of the workers (pass a ``Dup()`` reserved for this use)."""

    name = "mpi"

    def __init__(self, comm, *, deadline: float, watch: PeerWatch | None = None):
        super().__init__(comm.Get_rank(), comm.Get_size(), deadline, watch)
        self.comm = comm

    def _array(self, flat: torch.Tensor) -> np.ndarray:
        if not flat.is_contiguous() or flat.device.type != "cpu":
            raise ValueError("the mpi backend needs a contiguous CPU tensor")
        if flat.dtype == torch.uint8:
            return flat.numpy()
        if not mpi_dtype_ok(flat.dtype):
            raise TypeError(f"the mpi backend cannot reduce {flat.dtype}; use backend='horovod' "
                            f"or one of {', '.join(map(str, _MPI_DTYPES))}")
        return flat.numpy()

    def start_allreduce_average(self, flat, what="allreduce"):
        from mpi4py import MPI

        label, seq = self._next(what)
        arr = self._array(flat)
        req = self.comm.Iallreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
        inv = 1.0 / self.size

        def finish():
            if self.size > 1:
                flat.mul_(inv)

        return Pending(req.Test, finish, label, seq, self)

    def broadcast_(self, flat, root, what="broadcast"):
        label, seq = self._next(what)
        req = self.comm.Ibcast(self._array(flat), root=root)
        Pending(req.Test, lambda: None, label, seq, self).wait()
        return flat

    def barrier(self, what="barrier"):
        label, seq = self._next(what)
        req = self.comm.Ibarrier()
        Pending(req.Test, lambda: None, label, seq, self).wait()


class HorovodAggregator(Aggregator):
    """Horovod's ops; Horovod must already be initialised on the workers' communicator.

    Horovod's background thread does the communication; a wait spins (yielding) for a few
    milliseconds, then sleeps between polls so the core goes to that thread.
    """

    name = "horovod"
    poll_sleep = 2e-4
    poll_spin = 5e-3

    def __init__(self, hvd, *, deadline: float, watch: PeerWatch | None = None):
        super().__init__(hvd.rank(), hvd.size(), deadline, watch)
        self.hvd = hvd

    def start_allreduce_average(self, flat, what="allreduce"):
        label, seq = self._next(what)
        handle = self.hvd.allreduce_async_(flat, op=self.hvd.Average, name=f"mpsync.{what}")
        return self._pending(handle, label, seq)

    def _pending(self, handle, label, seq) -> Pending:
        def finish():
            self.hvd.synchronize(handle)

        return Pending(lambda: self.hvd.poll(handle), finish, label, seq, self)

    def broadcast_(self, flat, root, what="broadcast"):
        label, seq = self._next(what)
        if flat.dtype == torch.uint8 and flat.numel() == 0:
            return flat
        handle = self.hvd.broadcast_async_(flat, root_rank=root, name=f"mpsync.{what}")
        self._pending(handle, label, seq).wait()
        return flat

    def barrier(self, what="barrier"):
        label, seq = self._next(what)
        t = torch.zeros(1)
        handle = self.hvd.allreduce_async_(t, op=self.hvd.Sum, name=f"mpsync.{what}")
        self._pending(handle, label, seq).wait()


class EmulatedLink(Aggregator):
    """Wraps an aggregator so each allreduce takes at least as long as a ring allreduce over a
    slower network: 2(N-1)/N · bytes / bandwidth + 2(N-1) · latency (the bandwidth-optimal ring
    algorithm's cost).  For experiments on one machine, where shared memory hides what overlap
    buys on a real cluster (OSP's In-Computation Sync); never on by default.
    """

    def __init__(self, inner: Aggregator, *, latency: float = 0.0, bandwidth: float = 0.0):
        super().__init__(inner.rank, inner.size, inner.deadline, inner.watch)
        if latency < 0 or bandwidth < 0:
            raise ValueError(f"emulated link: latency ({latency}) and bandwidth ({bandwidth}) "
                             f"must be >= 0 (bandwidth 0 = unlimited)")
        self.inner = inner
        self.name = f"{inner.name}+link"
        self.latency = latency
        self.bandwidth = bandwidth
        self.poll_sleep, self.poll_spin = 1e-4, 0.0

    def link_time(self, nbytes: int) -> float:
        n = self.size
        t = 2 * (n - 1) * self.latency
        if self.bandwidth > 0:
            t += 2 * (n - 1) / n * nbytes / self.bandwidth
        return t

    def start_allreduce_average(self, flat, what="allreduce"):
        import time

        inner = self.inner.start_allreduce_average(flat, what)
        ready_at = time.monotonic() + self.link_time(flat.numel() * flat.element_size())
        return Pending(lambda: inner.test() and time.monotonic() >= ready_at, lambda: None,
                       inner.what, inner.seq, self)

    def broadcast_(self, flat, root, what="broadcast"):
        return self.inner.broadcast_(flat, root, what)

    def barrier(self, what="barrier"):
        self.inner.barrier(what)
