"""Process-wide state of ``mpsync.torch``: communicators, backend, control-plane client.

Communicators (all derived from the one passed to ``init``, never COMM_WORLD behind the
user's back):

* ``control``: a ``Dup()`` shared by the state server and its clients (the contract);
* ``workers``: the training ranks only (``Split`` without the dedicated server rank);
  Horovod is initialised on it, and the gloo/NCCL process group's rendezvous runs over it,
  so the server never joins a Horovod or ``torch.distributed`` collective;
* more ``Dup()`` s of ``workers``: the mpi backend's collectives, the notices of
  :class:`~mpsync.torch.dataplane.waiting.PeerWatch`, and ``gather_object``'s messages (kept apart so a
  probe never matches anything else).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import importlib.util
import sys
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from mpsync import job_end, policies
from mpsync.config import ConfigError, Negotiation, SyncConfig, refuse_ps_plan
from mpsync.server import job
from mpsync.server.job import install_abort_hooks
from mpsync.server.shard_plan import shards_unavailable
from mpsync.server.weights import BFLOAT16
from mpsync.torch.strategies.counters import LocalCounters

__all__ = ["Context", "init", "shutdown", "context", "worker_context", "install_abort_hooks"]

# An error nothing catches between this import (MPI has started) and init() ends the job too;
# init() puts hooks of its own in place that name the worker.
job_end.install_unless_the_script_has(job_end.rank_label())


class LiveOptimizers:
    """The process's DistributedOptimizers in the order they were made.  The one that talks
    to the state server (the leader: the server numbers this worker's iterations and rounds
    by its steps) is held for the whole run; every other one (a follower, one over a process
    set) is held weakly: once the script drops it (a model trained and thrown away, a test
    that ended, a step that raised) it takes part in nothing after -- its leader runs no more
    rounds for it, ``join()`` and ``shutdown()`` do not run it; in Horovod too an optimizer is
    nothing but its hooks.  An optimizer and its strategy reference each other, so only the
    cycle collector frees them: :meth:`live` collects first, at the points where every
    worker must see the same set (a new optimizer, join, shutdown)."""

    def __init__(self):
        self._refs: list = []

    def append(self, opt, *, hold: bool = False) -> None:
        self._refs.append((lambda: opt) if hold else weakref.ref(opt))

    def __iter__(self):
        """The ones not freed yet (no collection: cheap, for idle polls)."""
        return iter([o for o in (r() for r in self._refs) if o is not None])

    def live(self) -> list:
        """The ones the script still holds, and the leaders (collects garbage first)."""
        if self._refs:
            gc.collect()
            self._refs = [r for r in self._refs if r() is not None]
        return list(iter(self))


@dataclass
class Context:
    config: SyncConfig
    world: object
    control: object
    workers: object | None
    server_rank: int
    dedicated: bool
    worker_rank: int
    world_ranks: list
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    user_ops: object | None = None  # _collectives.UserOps: the script's own collectives
    peers: object | None = None     # a UserOps of DistributedOptimizer's own (fp16 sums, barriers)
    process_sets: dict = field(default_factory=dict)  # id -> (ProcessSet, UserOps | None)
    next_process_set_id: int = 0
    timeline: tuple | None = None   # (path, first event) from start_timeline
    # Fusion threshold, cycle time, response cache capacity of the script's collectives
    # (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME, HOROVOD_CACHE_CAPACITY), read at init.
    negotiation: Negotiation = field(default_factory=Negotiation)
    backend: object | None = None
    # What DistributedOptimizer aggregates with: ``backend``, or ``backend`` behind an
    # EmulatedLink when ``comm_delay`` or ``comm_bandwidth`` > 0 (metrics and broadcasts are
    # not delayed).
    data_backend: object | None = None
    objects: object | None = None   # communicator for gather_object
    client: object | None = None
    colocated: object | None = None
    # The sharded parameter server (topology='ps'): this worker's client of every shard,
    # the shard thread it hosts (or None) and the layout (mpsync.server.shards).
    shards: object | None = None
    shard_thread: object | None = None
    shard_layout: object | None = None
    hvd: object | None = None
    # Whether MPI takes this worker's CUDA buffers (Open MPI built with CUDA): True, False, or
    # None when it cannot be told; False without CUDA.  Read at init for the transports.
    cuda_aware_mpi: bool | None = False
    counters: LocalCounters = field(default_factory=LocalCounters)
    optimizers: LiveOptimizers = field(default_factory=LiveOptimizers)
    stats_path: str | None = None
    trace_path: str | None = None
    server_stats: dict | None = None
    closed: bool = False

    @property
    def is_server(self) -> bool:
        return self.worker_rank < 0

    @property
    def size(self) -> int:
        return len(self.world_ranks)


_CONTEXT: Context | None = None


def is_initialized() -> bool:
    return _CONTEXT is not None and not _CONTEXT.closed


def context() -> Context:
    if _CONTEXT is None:
        raise RuntimeError("mpsync.torch is not initialised: call mps.init(...) first")
    return _CONTEXT


def worker_context(what: str) -> Context:
    ctx = context()
    if ctx.is_server:
        raise RuntimeError(f"{what} is for worker ranks; this is the state-server rank")
    if ctx.closed:
        raise RuntimeError(f"{what}: mps.shutdown() was already called")
    return ctx


def init(policy: str | None = None, topology: str | None = None, backend: str | None = None,
         server: str | None = None, comm=None, *, stats_path: str | None = None,
         trace_path: str | None = None, server_rank: int = 0,
         **policy_options) -> Context:
    """Every setting left as ``None`` comes from ``MPSYNC_*`` or else the default of
    :class:`SyncConfig` (explicit > environment > default), so ``init()`` alone runs the policy
    of the environment.  A second call while initialised returns the running context (Horovod's
    ``init()`` is idempotent: libraries and notebooks call it again); ``mpsync.torch.init``
    registers the process sets, above this module."""
    global _CONTEXT
    if _CONTEXT is not None and not _CONTEXT.closed:
        return _CONTEXT
    # Validation needs no communicator: a bad setting fails identically on every rank.
    config = job.config_of(policy, topology, backend, server, **policy_options)
    try:
        negotiation = Negotiation.from_env()
    except ConfigError as e:
        job.raise_user_error(e)
    # Horovod is imported for backend='horovod' on every topology (on the PS it runs the
    # workers' barriers and broadcasts), so its absence is checked whatever the topology.
    if config.backend == "horovod" and importlib.util.find_spec("horovod") is None:
        job.raise_user_error(ConfigError(
            "backend='horovod' but Horovod is not installed; install it (make setup) or use "
            "backend='mpi'"))
    from mpsync.config import transport_unavailable

    # Before any communication, on every rank alike (the server's too): one line, no hang.
    reason = transport_unavailable(config.backend)
    if reason is not None:
        job.raise_user_error(ConfigError(reason))
    from mpi4py import MPI

    world = MPI.COMM_WORLD if comm is None else comm
    config = ring_only_without_threads(config, MPI.Query_thread())
    joined = job.join(world, config, server_rank)
    control, workers, world_ranks = joined.control, joined.workers, joined.world_ranks
    dedicated, rank = joined.dedicated, world.Get_rank()
    is_worker = workers is not None
    ctx = Context(config=config, world=world, control=control,
                  workers=workers if is_worker else None, server_rank=server_rank,
                  dedicated=dedicated,
                  worker_rank=world_ranks.index(rank) if is_worker else -1,
                  world_ranks=world_ranks, stats_path=stats_path, trace_path=trace_path,
                  negotiation=negotiation)
    _CONTEXT = ctx
    if not is_worker:
        _serve_and_exit(ctx)  # never returns
    node = workers.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    ctx.local_rank, ctx.local_size = node.Get_rank(), node.Get_size()
    # Horovod's cross communicator: the workers with this local rank, one per node.
    cross = workers.Split(color=ctx.local_rank, key=rank)
    ctx.cross_rank, ctx.cross_size = cross.Get_rank(), cross.Get_size()
    one_host = node.Get_size() == workers.Get_size()
    node.Free()
    cross.Free()
    _start_backend(ctx, one_host)
    if policies.hosts_shards(config):
        from mpsync.server.shards import start_shards
        from mpsync.torch.dataplane.progress import engine

        ctx.shards, ctx.shard_thread, ctx.shard_layout = start_shards(
            workers, config, world_ranks, cast=torch_cast)
        ctx.shards.waiter = engine().wait   # the one way a worker waits on bytes in flight
    _start_control_plane(ctx)
    if ctx.shards is not None:
        _await_warm_shards(ctx, config.startup_timeout)
    atexit.register(_shutdown_at_exit)
    return ctx


def _await_warm_shards(ctx, timeout: float) -> None:
    """Every worker leaves ``init`` once every shard's compiled loop is loaded
    (``ShardServer.warm_up``, on its thread since ``start_shards``, beside the control
    plane's start): where that load is a compile, it comes before any trainer's clock starts
    and not inside its first pushes.  The wait sleeps: a polling barrier would take the cores
    the compile needs."""
    if ctx.shard_thread is not None:
        ctx.shard_thread.server.warmed.wait(timeout)
    request = ctx.workers.Ibarrier()
    while not request.Test():
        time.sleep(1e-3)


def ring_only_without_threads(config: SyncConfig, thread_level: int) -> SyncConfig:
    """``auto`` with ``auto_ps`` where MPI lacks MPI_THREAD_MULTIPLE: no shards are hosted and
    auto switches on the ring only (``auto_ps`` off) instead of failing the job; the state
    server, which decides the same on its rank (every rank of a job gets the same thread
    level from the same MPI), says so once (``AutoPolicy``).  Anything else as it is."""
    reason = shards_unavailable(thread_level)
    if config.policy != policies.AUTO or not config.auto_ps or reason is None:
        return config
    refuse_ps_plan(config.auto_plan, reason)
    return dataclasses.replace(config, auto_ps=False).validate()


def torch_cast(dst, src) -> None:
    """``dst[:] = src`` (numpy arrays of float dtypes, ``weights.BFLOAT16`` included) by
    torch: the shard client's and its shard's conversion to and from a float16 or bfloat16
    wire, 100-3000x faster than numpy's own for float16 (``mpsync.server.weights.numpy_cast``)
    on a million values here."""
    if dst.dtype == BFLOAT16:
        torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16).copy_(torch.from_numpy(src))
    elif src.dtype == BFLOAT16:
        torch.from_numpy(dst).copy_(torch.from_numpy(src.view(np.int16)).view(torch.bfloat16))
    else:
        torch.from_numpy(dst).copy_(torch.from_numpy(src))


def _serve_and_exit(ctx: Context) -> None:
    joined = job.Joined(ctx.control, None, ctx.world_ranks, ctx.dedicated)
    ctx.server_stats = job.serve_dedicated(joined, ctx.config, ctx.server_rank,
                                           stats_path=ctx.stats_path, trace_path=ctx.trace_path)
    ctx.closed = True
    # The script body after init() is for workers only: the dedicated server rank ends here.
    sys.exit(0)


def _start_backend(ctx: Context, one_host: bool) -> None:
    """``one_host``: every worker runs on this node (a process group's rendezvous and gloo
    then stay on the loopback interface)."""
    from mpsync.torch.dataplane.waiting import PeerWatch
    from mpsync.torch.dataplane.backends import EmulatedLink, HorovodAggregator, MPIAggregator
    from mpsync.torch.dataplane.process_group import (
        PROCESS_GROUP_BACKENDS, ProcessGroupAggregator, cuda_aware_mpi, nccl_device)

    watch = PeerWatch(ctx.workers.Dup(), ctx.world_ranks)
    ctx.objects = ctx.workers.Dup()
    if ctx.config.backend == "horovod":
        import horovod.torch as hvd

        hvd.init(comm=ctx.workers)
        if hvd.size() != ctx.workers.Get_size() or hvd.rank() != ctx.worker_rank:
            raise RuntimeError(f"Horovod initialised as rank {hvd.rank()} of {hvd.size()}, "
                               f"expected {ctx.worker_rank} of {ctx.workers.Get_size()}")
        ctx.hvd = hvd
        ctx.backend = HorovodAggregator(hvd, deadline=ctx.config.deadline, watch=watch)
    elif ctx.config.backend in PROCESS_GROUP_BACKENDS:
        nccl = ctx.config.backend == "nccl"
        ctx.backend = ProcessGroupAggregator.start(
            ctx.workers, ctx.config.backend, deadline=ctx.config.deadline,
            longest_wait=ctx.config.startup_timeout, one_host=one_host, watch=watch,
            device=nccl_device(ctx.local_rank) if nccl else None)
    else:
        ctx.backend = MPIAggregator(ctx.workers.Dup(), deadline=ctx.config.deadline, watch=watch)
    if torch.cuda.is_available():
        ctx.cuda_aware_mpi = cuda_aware_mpi()
        if isinstance(ctx.backend, MPIAggregator):
            ctx.backend.device_buffers = bool(ctx.cuda_aware_mpi)
    emulated = ctx.config.comm_delay > 0 or ctx.config.comm_bandwidth > 0
    ctx.data_backend = (EmulatedLink(ctx.backend, delay=ctx.config.comm_delay,
                                     bandwidth=ctx.config.comm_bandwidth)
                        if emulated else ctx.backend)
    from mpsync.torch._collectives import UserOps, make_user_ops

    ctx.user_ops = make_user_ops(ctx)
    ctx.peers = UserOps(ctx.workers.Dup(), ctx.config.deadline, negotiation=ctx.negotiation)


def _start_control_plane(ctx: Context) -> None:
    from mpsync.server import SyncClient, start_colocated

    if not ctx.dedicated and ctx.world.Get_rank() == ctx.server_rank:
        ctx.colocated = start_colocated(ctx.control, ctx.config, server_rank=ctx.server_rank)
    ctx.client = SyncClient(ctx.control, ctx.config, server_rank=ctx.server_rank,
                            shards=ctx.shards)
    from mpsync.torch.dataplane.progress import engine

    # A worker waiting in a collective (a bucket, the script's own) for a peer that stopped
    # still speaks to the server, which then names the silent one within silent_timeout.
    engine().set_heartbeat(ctx.client.alive)
    # And a thread beats whatever the training thread does, so that a stopped process, a dead
    # node or a cut link is suspected within seconds (mpsync.server.heartbeat).
    hosted = -1
    if ctx.shard_thread is not None:
        hosted = ctx.shard_layout.hosts.index(ctx.worker_rank)
    ctx.client.start_heartbeat(ctx.config.heartbeat_s, hosted)


def shutdown() -> None:
    """Final aggregation (every worker ends with the same model), then tell the server."""
    ctx = _CONTEXT
    if ctx is None or ctx.closed or ctx.is_server:
        return
    for opt in ctx.optimizers.live():
        # Joins the others (uneven step counts) and ends with the same model everywhere.
        opt.synchronize_model()
        opt.close()
    if ctx.shards is not None:
        if ctx.config.topology != "ps":
            # Shards hosted beside the ring (auto): the workers may not have spoken to them
            # for longer than the deadline.  Each tells every shard it is here (a liveness
            # check is a message), and waits for all to have, before the goodbyes.
            ctx.shards.silent_workers()
            ctx.backend.barrier("the PS shards' shutdown")
        ctx.shards.close()
        if ctx.shard_thread is not None:
            # Until every worker is done with this shard; one silent for longer than the
            # deadline without its goodbye is named instead of waited for.
            ctx.shard_thread.finish()
    if ctx.client is not None:
        from mpsync.torch.dataplane.progress import engine

        engine().set_heartbeat(None)
        server_stats = ctx.client.stats()
        ctx.client.shutdown()
        ctx.server_stats = server_stats
    if ctx.colocated is not None:
        final = ctx.colocated.join()
        ctx.server_stats = final
        job.write_outputs(final, ctx.stats_path, ctx.trace_path)
    if hasattr(ctx.backend, "close"):
        ctx.backend.close()  # a process group's threads and connections
    ctx.closed = True


def _shutdown_at_exit() -> None:
    # A script that never calls mps.shutdown() still ends: the dedicated server waits for
    # every worker's shutdown message.  Not reached after an unhandled exception (the abort
    # hook ends the process first).  Its own waits are bounded by the deadline; should one
    # fail, the error must end the job: atexit would print it and go on to MPI_Finalize,
    # which waits forever for the rank that could not be reached.
    try:
        shutdown()
    except BaseException as e:  # noqa: BLE001 - any error here ends the job, named
        label = (f"rank {_CONTEXT.world.Get_rank()} (worker {_CONTEXT.worker_rank})"
                 if _CONTEXT is not None else job.rank_label())
        job.end_job_for(e, f"{label} at exit, in mpsync.torch.shutdown()",
                        _CONTEXT.world if _CONTEXT is not None else None)
