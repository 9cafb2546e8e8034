"""The ring over ``torch.distributed``: gloo (host tensors) and NCCL (CUDA tensors).

:class:`ProcessGroupAggregator` implements :class:`~mpsync.torch.dataplane.backends.Aggregator`
over a process group of the *worker* ranks only (a dedicated state-server rank never joins).
The process group is mpsync's own: it is built directly (``ProcessGroupGloo`` /
``ProcessGroupNCCL`` on a ``TCPStore`` of its own, keys under the prefix ``mpsync.ring/``)
and never registered as ``torch.distributed``'s default group, so a script that calls
``init_process_group`` itself neither collides with it nor sees it.

Rendezvous needs no MASTER_ADDR/PORT: worker 0 starts the store on a free port the kernel
picks, and the workers' MPI communicator tells every worker where it is (DDP's launchers
need the user to agree on an address beforehand; here MPI already connects the ranks).
Across nodes "where" is not a host name: a node's name may resolve nowhere, or to an
address the others cannot reach (the virtual cluster's nodes have names and no DNS).  So
worker 0 offers every address of its own (its resolved name's first, then each interface's),
every other worker connects to the first that answers and learns its own address from that
connection, and gloo binds each worker to the address it reached worker 0 from; worker 0
takes the address most workers reached.  A worker that reaches none of them makes every
worker raise, naming it and the addresses it tried, before any of them blocks on the store.

Every collective is started with the process group's non-blocking form and waited for by
the same bounded wait as the other aggregators (:mod:`mpsync.torch.dataplane.waiting`): a
peer that stops makes a :class:`~mpsync.torch.dataplane.waiting.CollectiveTimeout` at the
deadline naming it, not a hang.  The process group's own timeout is set past the longest
deadline mpsync uses, so it is mpsync's wait that fires first.

CUDA-aware MPI
(:func:`cuda_aware_mpi`) is also here; the transport checks are :func:`mpsync.config.transport_unavailable`: ``mpsync.torch.init`` refuses an unusable transport
before any communication, and ``mpsync doctor`` lists what the machine has.
"""

from __future__ import annotations

import datetime
import functools
import socket
import threading

import torch

from mpsync.config import PROCESS_GROUP_BACKENDS, transport_unavailable
from mpsync.transport import ompi_built_with_cuda
from mpsync.torch.dataplane.backends import Aggregator, Pending
from mpsync.torch.dataplane.waiting import PeerWatch

__all__ = ["ProcessGroupAggregator",
           "cuda_aware_mpi", "start_process_group", "nccl_device", "host_addresses", "reach"]

STORE_PREFIX = "mpsync.ring"


@functools.lru_cache(maxsize=1)
def cuda_aware_mpi() -> bool | None:
    """Whether the MPI library takes CUDA device buffers (Open MPI built with CUDA support):
    True, False, or None when it cannot be told.

    Open MPI answers ``MPIX_Query_cuda_support()`` (its mpi-ext.h) at run time when the CUDA
    extension was built; otherwise ``ompi_info`` reports the build flag
    ``mpi_built_with_cuda_support``.  Read once per process.
    """
    import ctypes

    try:
        from mpi4py import MPI  # noqa: F401 - loads libmpi into the process (RTLD_GLOBAL)

        query = getattr(ctypes.CDLL(None), "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    except (ImportError, OSError):
        pass
    return ompi_built_with_cuda()


def nccl_device(local_rank: int) -> torch.device:
    """The GPU of a worker: its rank among the workers of its node, modulo the GPUs there."""
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def host_addresses() -> list[str]:
    """This node's IPv4 addresses other nodes may reach it at, best first: its name's as the
    resolver gives it (where it resolves), then each interface's; loopback left out."""
    found = []
    try:
        found.append(socket.gethostbyname(socket.getfqdn()))
    except OSError:   # a name without DNS or /etc/hosts entry: the interfaces still answer
        pass
    found += _interface_addresses()
    return list(dict.fromkeys(a for a in found if not a.startswith("127.")))


def _interface_addresses() -> list[str]:
    """Each network interface's IPv4 address (Linux ``SIOCGIFADDR``), in interface order."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:   # no IPv4 address on it (down, or IPv6 only)
                continue
            out.append(socket.inet_ntoa(packed[20:24]))
    return out


def reach(addresses: list[str], port: int, timeout: float = 5.0) -> tuple[str, str] | None:
    """The first of ``addresses`` that accepts a connection on ``port``, and this node's own
    address on that connection (the one the other end sees); None if none does."""
    for address in addresses:
        try:
            with socket.create_connection((address, port), timeout=timeout) as conn:
                return address, conn.getsockname()[0]
        except OSError:
            continue
    return None


def start_process_group(comm, backend: str, *, one_host: bool, timeout: float):
    """A process group of ``backend`` over the ranks of ``comm`` (an mpi4py communicator of
    the workers), rendezvous over ``comm`` itself; collective over ``comm``.

    ``one_host``: every rank of ``comm`` runs on this node, so the store and gloo use the
    loopback interface; otherwise the addresses the workers reach worker 0 at (module doc).
    ``timeout``: seconds, the process group's own limit on any operation.
    """
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    limit = datetime.timedelta(seconds=timeout)
    store, offered, failure = None, None, None
    if rank == 0:
        try:
            offered = ["127.0.0.1"] if one_host else host_addresses()
            if not offered:
                raise OSError("this node has no IPv4 address but loopback")
            # Port 0: the kernel picks a free one; the store keeps it open, so no other
            # process can take it between the pick and the others' connect.  It listens on
            # every interface, so worker 0's own client goes through loopback.
            store = dist.TCPStore("127.0.0.1", 0, size, True, limit, wait_for_workers=False)
            port = store.port
        except Exception as e:  # handed to every worker, so they all fail with it
            port, failure = None, f"{type(e).__name__}: {e}"
    else:
        port = None
    offered, port, failure = comm.bcast((offered, port, failure), root=0)
    if failure is not None:
        raise RuntimeError(f"backend={backend!r}: worker 0 could not start the rendezvous "
                           f"store: {failure}")
    # Every worker learns whether every other reached worker 0 before any of them blocks.
    reached = comm.allgather(None if rank == 0 else reach(offered, port))
    lost = [r for r in range(1, size) if reached[r] is None]
    if lost:
        raise RuntimeError(f"backend={backend!r}: worker(s) {lost} reached none of worker 0's "
                           f"addresses {offered} on port {port} (the rendezvous store); "
                           f"a firewall or a route between the nodes is missing")
    if rank != 0:
        store = dist.TCPStore(reached[rank][0], port, size, False, limit)
        own = reached[rank][1]
    else:   # the address most workers reached worker 0 at (the first offered, if alone)
        targets = [r[0] for r in reached[1:]]
        own = max(offered, key=targets.count) if targets else offered[0]
    store = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = limit
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
        group = dist.ProcessGroupGloo(store, rank, size, options)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        # The communicator binds to the device of the first collective's tensors (lazy
        # init): nothing here changes the script's current CUDA device.
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        raise ValueError(f"no process group for backend={backend!r}; one of "
                         f"{', '.join(PROCESS_GROUP_BACKENDS)}")
    return group


class ProcessGroupAggregator(Aggregator):
    """Averages over a ``torch.distributed`` process group of the workers (gloo or NCCL).

    ``device``: where the collectives run (CPU for gloo, the worker's GPU for NCCL).  A
    buffer elsewhere (today's host-side fusion buffers under NCCL, or the host tensors of
    ``broadcast_bytes``) is copied there and back around the collective: correct on any
    buffer, and no copy at all once the buffers live on the device.

    Gloo has no average: the sum is scaled by 1/N afterwards, as the mpi backend does, so
    both give bitwise the same result with 2 workers.  Gloo completes a collective on its own
    threads and its future's callback sets an event the wait sleeps on; NCCL's future
    completes when the kernel is enqueued, so its wait polls ``is_completed`` (the CUDA
    event) instead.
    """

    poll_sleep = 2e-4
    poll_spin = 5e-3

    def __init__(self, group, backend: str, *, rank: int, size: int, deadline: float,
                 watch: PeerWatch | None = None, device: torch.device | None = None):
        super().__init__(rank, size, deadline, watch)
        self.group = group
        self.name = backend
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._events = backend == "gloo"

    @classmethod
    def start(cls, comm, backend: str, *, deadline: float, longest_wait: float,
              one_host: bool, watch: PeerWatch | None = None,
              device: torch.device | None = None) -> "ProcessGroupAggregator":
        """Rendezvous over ``comm`` (the workers), then the aggregator; ``longest_wait``:
        the longest deadline any of its waits will be given (start-up broadcasts)."""
        if backend == "nccl" and device is None:
            raise ValueError("backend='nccl' needs the worker's CUDA device")
        group = start_process_group(comm, backend, one_host=one_host,
                                    timeout=max(deadline, longest_wait) + 60.0)
        return cls(group, backend, rank=comm.Get_rank(), size=comm.Get_size(),
                   deadline=deadline, watch=watch, device=device if backend == "nccl" else None)

    # -- the collectives ---------------------------------------------------------------------
    def _staged(self, flat: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The tensor the collective runs on, and what copies the result back (or None)."""
        if flat.device == self.device and flat.is_contiguous():
            return flat, None
        work = flat.to(self.device, copy=True).contiguous()
        return work, lambda: flat.copy_(work)

    def _pending(self, work, label: str, seq: int, after=None) -> Pending:
        event = None
        if self._events:
            event = threading.Event()
            work.get_future().add_done_callback(lambda _f: event.set())

        def finish():
            work.wait()   # re-raises a failed collective's error; orders NCCL's stream
            if after is not None:
                after()

        test = event.is_set if event is not None else work.is_completed
        return Pending(test, finish, label, seq, self, event=event)

    def _allreduce(self, flat, what, scale: float | None) -> Pending:
        import torch.distributed as dist

        label, seq = self._next(what)
        work_tensor, copy_back = self._staged(flat)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        work = self.group.allreduce([work_tensor], opts)

        def after():
            if scale is not None:
                work_tensor.mul_(scale)
            if copy_back is not None:
                copy_back()

        return self._pending(work, label, seq, after)

    def start_allreduce_average(self, flat, what="allreduce"):
        return self._allreduce(flat, what, 1.0 / self.size if self.size > 1 else None)

    def allreduce_sum_(self, flat, what="allreduce"):
        self._allreduce(flat, what, None).wait()
        return flat

    def broadcast_(self, flat, root, what="broadcast", deadline=None):
        import torch.distributed as dist

        label, seq = self._next(what)
        if flat.numel() == 0:
            return flat
        work_tensor, copy_back = self._staged(flat)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self._pending(self.group.broadcast([work_tensor], opts), label, seq,
                      copy_back).wait(deadline)
        return flat

    def barrier(self, what="barrier", deadline=None):
        import torch.distributed as dist

        # An allreduce of one value, not the group's barrier: NCCL's guesses a device, and
        # this keeps the barrier inside the same bounded wait as every other collective.
        label, seq = self._next(what)
        one = torch.zeros(1, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._pending(self.group.allreduce([one], opts), label, seq).wait(deadline)

    def close(self) -> None:
        """Ends the process group's threads and connections (idempotent)."""
        group, self.group = self.group, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()
