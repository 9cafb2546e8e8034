"""``import mpsync.torch as mps``: Horovod's PyTorch API, with a state server deciding when
workers synchronize.

A Horovod script changes its import and its ``init`` line::

    import mpsync.torch as mps
    mps.init(policy="esync", topology="ring", backend="mpi", server="dedicated")
    model = Net(); opt = torch.optim.SGD(model.parameters(), lr=0.1 * mps.size())
    opt = mps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in loader: opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    mps.shutdown()

With ``server="dedicated"`` the rank ``server_rank`` (0) serves inside ``init`` until every
worker has shut down and then exits, so the rest of the script runs on workers only; ranks,
sizes and broadcast roots count workers.  ``server="colocated"`` runs the server as a thread
on rank 0, which trains too.
"""

from __future__ import annotations

from mpsync.torch import _runtime, elastic
from mpsync.torch.dataplane.waiting import CollectiveTimeout
from mpsync.torch.broadcast import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    gather_object,
)
from mpsync.torch.dataplane.compression import Compression
from mpsync.torch.differentiable import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from mpsync.torch.dataplane.exceptions import (
    HorovodInternalError,
    HorovodVersionMismatchError,
    HostsUpdatedInterrupt,
)
from mpsync.torch.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather_async,
    allgather_object,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    is_initialized,
    join,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    reducescatter_async,
    rocm_built,
    sparse_allreduce_async,
    synchronize,
)
from mpsync.torch.optimizer import DistributedOptimizer
from mpsync.torch.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from mpsync.torch.sync_batch_norm import SyncBatchNorm
from mpsync.torch.timeline import start_timeline, stop_timeline

__all__ = [
    # set-up and topology
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_server", "worker_comm", "config", "stats",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    # training
    "DistributedOptimizer", "Compression", "broadcast_parameters", "broadcast_optimizer_state",
    # collectives
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "poll",
    "synchronize", "allgather", "allgather_object", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "alltoall", "reducescatter",
    "barrier", "join", "gather_object", "CollectiveTimeout",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "alltoall_async",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async",
    # errors and process sets
    "HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "SyncBatchNorm", "start_timeline", "stop_timeline",
    # elastic training (a restart from the last commit, with Open MPI)
    "elastic",
]


def init(policy: str | None = None, topology: str | None = None, backend: str | None = None,
         server: str | None = None, comm=None, process_sets=None, **policy_options) -> None:
    """Set up the workers, the aggregation backend and the state server (see module doc).

    A setting not passed comes from its ``MPSYNC_*`` variable (``MPSYNC_POLICY``,
    ``MPSYNC_TOPOLOGY``, ``MPSYNC_BACKEND``, ``MPSYNC_SERVER``, ``MPSYNC_STALENESS``, ...), else
    from the defaults of :class:`mpsync.config.SyncConfig` (bsp, the policy's own topology, the
    mpi backend, a dedicated server): a Horovod script keeps ``hvd.init()`` and picks the policy
    (and ``MPSYNC_BACKEND=horovod``) from the environment.

    ``policy_options`` are :class:`mpsync.config.SyncConfig` fields (``staleness``,
    ``lookahead``, ``epsilon``, ``deadline``, ...) plus ``stats_path`` / ``trace_path`` (where
    the server writes its stats JSON and Chrome trace) and ``server_rank``.  Invalid settings
    raise :class:`mpsync.config.ConfigError` on every rank before any communication.
    ``process_sets``: :class:`ProcessSet` s to register (Horovod's ``init(process_sets=)``).
    Calling ``init`` again while initialised does nothing more (Horovod's idempotent init).
    """
    was_running = _runtime.is_initialized()
    ctx = _runtime.init(policy, topology, backend, server, comm, **policy_options)
    if was_running and ctx.is_server:
        return
    for ps in process_sets or ():
        if ps.process_set_id is None:
            add_process_set(ps)


def shutdown() -> None:
    """Final aggregation so every worker holds the same model; tells the server we are done.
    Called at interpreter exit if the script does not."""
    _runtime.shutdown()


def rank() -> int:
    """This worker's rank among the workers (0..size()-1)."""
    return _runtime.context().worker_rank


def size() -> int:
    """Number of workers (the dedicated server rank does not count)."""
    return _runtime.context().size


def local_rank() -> int:
    """Rank among the workers on this node."""
    return _runtime.context().local_rank


def is_server() -> bool:
    """True on a dedicated state-server rank (which never returns from ``init``)."""
    return _runtime.context().is_server


def worker_comm():
    """The mpi4py communicator of the workers only."""
    return _runtime.worker_context("worker_comm").workers


def config():
    """The validated :class:`mpsync.config.SyncConfig` of this run."""
    return _runtime.context().config


def stats(server: bool = True) -> dict:
    """``{"server": <state-server stats>, "local": <this worker's counters>}``.

    Asking for the server's stats is a round trip to the state server; ``server=False`` skips
    it (``"server"`` is then None unless the run has ended), e.g. for a progress display.
    """
    ctx = _runtime.context()
    want_server = server
    server = ctx.server_stats
    if want_server and server is None and ctx.client is not None and not ctx.closed:
        server = ctx.client.stats()
    return {"server": server, "local": _local_counters(ctx)}


def _local_counters(ctx) -> dict:
    """This worker's counters, with the bytes its control-plane and shard clients counted,
    the traffic of the shard server it hosts (``shard_sent``/``shard_received``) and the
    training-loss reports it sent to the state server (``loss_reports``)."""
    local = ctx.counters.as_dict()
    local["loss_reports"] = 0
    if ctx.client is not None:
        local["control_sent"] += ctx.client.control_sent
        local["control_received"] += ctx.client.control_received
        local["loss_reports"] = ctx.client.loss_reports
    if ctx.shards is not None:
        local["data_sent"] += ctx.shards.bytes_sent
        local["data_received"] += ctx.shards.bytes_received
    server = getattr(getattr(ctx, "shard_thread", None), "server", None)
    local["shard_sent"] = server.bytes_sent if server is not None else 0
    local["shard_received"] = server.bytes_received if server is not None else 0
    return local
