"""Aggregation backends for the ring topology: average a flat buffer over the workers.

Both implement one small interface, :class:`Aggregator`:

* ``allreduce_average_(flat, what)``: in place, blocking, with the deadline;
* ``allreduce_sum_(flat, what)``: the same, summing (exact for integers: counts, flags);
* ``start_allreduce_average(flat, what)`` -> :class:`Pending` (``test()``, ``wait()``): the
  non-blocking form OSP's In-Computation Sync overlaps with the next iteration (OSP §3.1);
* ``broadcast_(flat, root)`` and ``broadcast_bytes(data, root)``.

``mpi`` uses mpi4py ``Iallreduce`` on the tensor's memory (no copy); ``horovod`` uses Horovod's
async ops, initialised on the workers' communicator so a dedicated server rank never joins a
Horovod collective; ``gloo`` and ``nccl`` are in :mod:`mpsync.torch.dataplane.process_group`.
Every wait goes through the progress engine (:mod:`mpsync.torch.dataplane.progress`) with the
deadline of :mod:`mpsync.torch.dataplane.waiting`.
The parameter-server exchange is not an allreduce and lives in :mod:`mpsync.torch.strategies`.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from mpsync.torch.dataplane.progress import engine, poll_until_done
from mpsync.torch.dataplane.waiting import PeerWatch

__all__ = ["Aggregator", "MPIAggregator", "HorovodAggregator", "EmulatedLink", "Pending",
           "mpi_dtype_ok", "gather_bytes"]

_MPI_DTYPES = (torch.float64, torch.float32, torch.int64, torch.int32, torch.float16)


def mpi_dtype_ok(dtype: torch.dtype) -> bool:
    return dtype in _MPI_DTYPES


class Pending:
    """An in-flight collective: ``test()`` makes progress and says whether it is done,
    ``wait()`` blocks (with the deadline) and finishes it, through the progress engine
    (:mod:`mpsync.torch.dataplane.progress`).  ``event``: the collective runs on a lane (a
    communication thread) that sets it when done; the wait blocks on it instead of polling."""

    def __init__(self, test, finish, what: str, seq: int, aggregator: "Aggregator",
                 event: threading.Event | None = None):
        self._test = test
        self._finish = finish
        self.what = what
        self.seq = seq
        self._agg = aggregator
        self._event = event
        self.done = False

    def test(self) -> bool:
        if not self.done and self._test():
            self._finish()
            self.done = True
        return self.done

    def wait(self, deadline: float | None = None) -> None:
        """``deadline``: seconds, default the aggregator's."""
        if self.done:
            return
        agg = self._agg
        deadline = agg.deadline if deadline is None else deadline
        hook = agg.while_waiting
        if hook is not None:
            # A joined worker answers the script's collectives while it waits here.
            def test() -> bool:
                return self._test() or (hook(), self._test())[1]

            engine().wait(test, deadline=deadline, what=self.what, watch=agg.watch,
                          seq=self.seq, event=self._event, poll_every=1e-3)
        elif self._event is not None or agg.poll_sleep == 0:
            engine().wait(self._test, deadline=deadline, what=self.what, watch=agg.watch,
                          seq=self.seq, event=self._event)
        else:
            poll_until_done(self._test, deadline=deadline, what=self.what, watch=agg.watch,
                            seq=self.seq, sleep=agg.poll_sleep, spin_for=agg.poll_spin)
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
        # Called between polls while a collective waits (mpsync.torch.joining), or None.
        self.while_waiting = None

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

    def allreduce_sum_(self, flat: torch.Tensor, what: str = "allreduce") -> torch.Tensor:
        """In place: the element-wise sum over the workers (a real SUM, exact for integers,
        not the average times N)."""
        raise NotImplementedError

    def broadcast_(self, flat: torch.Tensor, root: int, what: str = "broadcast",
                   deadline: float | None = None) -> torch.Tensor:
        """``deadline``: seconds, default the aggregator's (start-up broadcasts pass more)."""
        raise NotImplementedError

    def broadcast_bytes(self, data: bytes | None, root: int, what: str = "broadcast",
                        deadline: float | None = None) -> bytes:
        """Broadcast a byte string (pickled optimizer state); ``data`` is ignored off root."""
        n = torch.zeros(1, dtype=torch.int64)
        if self.rank == root:
            n[0] = len(data)
        self.broadcast_(n, root, what + " size", deadline)
        buf = torch.zeros(int(n[0]), dtype=torch.uint8)
        if self.rank == root:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast_(buf, root, what, deadline)
        return buf.numpy().tobytes()

    def barrier(self, what: str = "barrier", deadline: float | None = None) -> None:
        """Every worker reaches it; ``deadline``: seconds, default the aggregator's."""
        raise NotImplementedError


class MPIAggregator(Aggregator):
    """mpi4py on a communicator of the workers (pass a ``Dup()`` reserved for this use).

    Buffers of ``thread_min_bytes`` or more are reduced by a blocking ``Allreduce`` (Open
    MPI's tuned algorithms, about twice as fast as the ``libnbc`` non-blocking ones for large
    buffers here, and progressing on their own, so a collective submitted before the next
    forward pass really overlaps with it) on the progress engine's lane of a ``Dup()`` of its
    own; smaller ones by ``Iallreduce`` tested on the caller's thread without sleeping, whose
    latency is lower than a thread hand-off.  Each path keeps program order on its own
    communicator.  Without MPI_THREAD_MULTIPLE everything takes the ``Iallreduce`` path.
    """

    name = "mpi"

    def __init__(self, comm, *, deadline: float, watch: PeerWatch | None = None,
                 thread_min_bytes: int | None = 256 * 1024):
        from mpi4py import MPI

        super().__init__(comm.Get_rank(), comm.Get_size(), deadline, watch)
        self.comm = comm
        if thread_min_bytes is not None and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            thread_min_bytes = None
        self.thread_min_bytes = thread_min_bytes
        self._thread_comm = comm.Dup() if thread_min_bytes is not None else None

    # Set at init where MPI takes CUDA buffers (Open MPI built with CUDA): device tensors are
    # then handed to MPI as they are (mpi4py reads ``__cuda_array_interface__``).
    device_buffers = False

    def _array(self, flat: torch.Tensor):
        if flat.is_cuda and self.device_buffers and flat.is_contiguous():
            if not mpi_dtype_ok(flat.dtype):
                raise TypeError(f"the mpi backend cannot reduce {flat.dtype}")
            # MPI reads the memory now, outside any CUDA stream: what made it must be done.
            torch.cuda.current_stream(flat.device).synchronize()
            return flat
        if not flat.is_contiguous() or flat.device.type != "cpu":
            raise ValueError("the mpi backend needs a contiguous CPU tensor (a CUDA tensor "
                             "only with a CUDA-aware MPI; mpsync stages it otherwise)")
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
        inv = 1.0 / self.size

        def finish():
            if self.size > 1:
                flat.mul_(inv)

        if self.thread_min_bytes is not None and arr.nbytes >= self.thread_min_bytes:
            comm = self._thread_comm
            flight = engine().run_on_lane(comm, lambda: comm.Allreduce(MPI.IN_PLACE, arr,
                                                                       op=MPI.SUM))
            return Pending(flight.test, finish, label, seq, self, event=flight.event)
        req = self.comm.Iallreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
        return Pending(req.Test, finish, label, seq, self)

    def allreduce_sum_(self, flat, what="allreduce"):
        from mpi4py import MPI

        label, seq = self._next(what)
        req = self.comm.Iallreduce(MPI.IN_PLACE, self._array(flat), op=MPI.SUM)
        Pending(req.Test, lambda: None, label, seq, self).wait()
        return flat

    def broadcast_(self, flat, root, what="broadcast", deadline=None):
        label, seq = self._next(what)
        if not mpi_dtype_ok(flat.dtype) and flat.is_contiguous() and flat.device.type == "cpu":
            flat = flat.view(-1).view(torch.uint8)   # a copy moves bytes: any dtype (bfloat16)
        req = self.comm.Ibcast(self._array(flat), root=root)
        Pending(req.Test, lambda: None, label, seq, self).wait(deadline)
        return flat

    def barrier(self, what="barrier", deadline=None):
        label, seq = self._next(what)
        req = self.comm.Ibarrier()
        Pending(req.Test, lambda: None, label, seq, self).wait(deadline)


class HorovodAggregator(Aggregator):
    """Horovod's ops; Horovod must already be initialised on the workers' communicator.

    Horovod's background thread does the communication; a wait spins (yielding) for 5 ms, then
    sleeps 0.2 ms between polls so a long wait leaves the core to that thread.  Of the
    variants measured (sleep only, 0.1-0.5 ms), this one stayed within 1.07x of raw
    ``hvd.allreduce_`` from 1 to 16 MB (bench/allreduce/README.md).
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

    def allreduce_sum_(self, flat, what="allreduce"):
        label, seq = self._next(what)
        handle = self.hvd.allreduce_async_(flat, op=self.hvd.Sum, name=f"mpsync.{what}")
        self._pending(handle, label, seq).wait()
        return flat

    def broadcast_(self, flat, root, what="broadcast", deadline=None):
        label, seq = self._next(what)
        if flat.dtype == torch.uint8 and flat.numel() == 0:
            return flat
        handle = self.hvd.broadcast_async_(flat, root_rank=root, name=f"mpsync.{what}")
        self._pending(handle, label, seq).wait(deadline)
        return flat

    def barrier(self, what="barrier", deadline=None):
        label, seq = self._next(what)
        t = torch.zeros(1)
        handle = self.hvd.allreduce_async_(t, op=self.hvd.Sum, name=f"mpsync.{what}")
        self._pending(handle, label, seq).wait(deadline)


class EmulatedLink(Aggregator):
    """Wraps an aggregator so each allreduce takes at least as long as a ring allreduce over a
    slower network: 2(N-1)/N · bytes / bandwidth + 2(N-1) · latency (the bandwidth-optimal ring
    algorithm's cost), plus ``delay`` seconds after the real collective has completed (the
    ``comm_delay`` setting: a fixed extra latency per aggregation).  For experiments on one
    machine, where shared memory hides what overlap buys on a real cluster (OSP's
    In-Computation Sync); never on by default.  The delay is part of the collective, so a
    strategy books it as aggregation time, and a non-blocking collective (OSP's ICS) hides it
    behind computation the way it would hide a real network's latency.  Sums
    (``allreduce_sum_``: stop flags, sample counts) and broadcasts are not delayed: they are
    bookkeeping, not the aggregation being emulated.
    """

    def __init__(self, inner: Aggregator, *, latency: float = 0.0, bandwidth: float = 0.0,
                 delay: float = 0.0):
        super().__init__(inner.rank, inner.size, inner.deadline, inner.watch)
        if latency < 0 or bandwidth < 0 or delay < 0:
            raise ValueError(f"emulated link: latency ({latency}), bandwidth ({bandwidth}) and "
                             f"delay ({delay}) must be >= 0 (bandwidth 0 = unlimited)")
        self.inner = inner
        self.name = f"{inner.name}+link"
        self.latency = latency
        self.bandwidth = bandwidth
        self.delay = delay
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
        delay = self.delay
        landed: list[float] = []

        def test() -> bool:
            if not landed:
                if not inner.test():
                    return False
                landed.append(time.monotonic())
            return time.monotonic() >= max(ready_at, landed[0] + delay)

        return Pending(test, lambda: None, inner.what, inner.seq, self)

    def allreduce_sum_(self, flat, what="allreduce"):
        return self.inner.allreduce_sum_(flat, what)

    def broadcast_(self, flat, root, what="broadcast", deadline=None):
        return self.inner.broadcast_(flat, root, what, deadline)

    def barrier(self, what="barrier", deadline=None):
        self.inner.barrier(what, deadline)


def gather_bytes(comm, data: bytes, root: int, *, deadline: float, what: str,
                 world_ranks: list[int] | None = None, tag: int = 7302) -> list[bytes] | None:
    """Each rank's ``data`` to ``root`` (a list in rank order there, None elsewhere), every
    wait bounded by ``deadline``.

    A blocking ``MPI_Gather`` waits forever for a stopped rank.  Here the senders' ``Isend``
    and the root's matched probes (``Improbe``: sizes differ per rank, and the matched message
    cannot be taken by another receive) are polled, and when the deadline passes
    :class:`CollectiveTimeout` names the ranks whose part never arrived (on the root) or the
    root (on a sender whose message was not taken).  ``comm`` should be reserved for this use.
    """
    from mpi4py import MPI

    from mpsync.torch.dataplane.waiting import CollectiveTimeout

    rank, size = comm.Get_rank(), comm.Get_size()
    world = list(world_ranks) if world_ranks is not None else list(range(size))

    def timeout(missing: list[int]) -> CollectiveTimeout:
        return CollectiveTimeout(what, deadline, missing, [world[r] for r in missing])

    if rank != root:
        req = comm.Isend([data, MPI.BYTE], dest=root, tag=tag)
        try:
            poll_until_done(req.Test, deadline=deadline, what=what, watch=None, seq=0,
                            sleep=1e-3, spin_for=1e-2)
        except CollectiveTimeout:
            raise timeout([root]) from None
        return None
    parts: list[bytes | None] = [None] * size
    parts[root] = data
    missing = [r for r in range(size) if r != root]

    def test() -> bool:
        for r in list(missing):
            msg = comm.Improbe(source=r, tag=tag, status=(status := MPI.Status()))
            if msg is not None:
                buf = bytearray(status.Get_count(MPI.BYTE))
                msg.Recv([buf, MPI.BYTE])
                parts[r] = bytes(buf)
                missing.remove(r)
        return not missing

    try:
        poll_until_done(test, deadline=deadline, what=what, watch=None, seq=0,
                        sleep=1e-3, spin_for=1e-2)
    except CollectiveTimeout:
        raise timeout(list(missing)) from None
    return parts
