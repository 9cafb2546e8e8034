"""How a job's ranks join mpsync, and a dedicated state server's whole life: the part of
``mpsync.torch.init`` that needs no torch.

A dedicated server rank only serves; importing torch there would cost seconds of CPU that, on
a node it shares with the workers, they wait for at start-up.  So the world-side steps of
``init`` live here, once: ``mpsync.torch.init`` calls :func:`join` on every rank, and a
launcher that knows its rank is the dedicated server (``mpsync train``) calls
:func:`serve_dedicated` without importing ``mpsync.torch``.  Both run the same collectives in
the same order, which is what keeps the ranks in step.
"""

from __future__ import annotations

import sys

from mpsync.config import ConfigError, SyncConfig
from mpsync.job_end import end_job, end_job_for, install_abort_hooks, rank_label, refuse, \
    running_world

__all__ = ["config_of", "raise_user_error", "join", "serve_dedicated", "write_outputs",
           "install_abort_hooks", "check_same_config", "Joined", "refuse", "end_job",
           "end_job_for", "running_world", "rank_label"]


def config_of(policy=None, topology=None, backend=None, server=None,
              **policy_options) -> SyncConfig:
    """``init``'s settings: every one left as ``None`` comes from ``MPSYNC_*`` or else the
    default of :class:`SyncConfig` (explicit > environment > default)."""
    given = {k: v for k, v in (("policy", policy), ("topology", topology),
                               ("backend", backend), ("server", server)) if v is not None}
    try:
        return SyncConfig.from_options(**given, **policy_options)
    except ConfigError as e:
        raise_user_error(e)


def raise_user_error(exc: ConfigError):
    """Raise ``exc`` from ``init``: uncaught by the script, it ends the job as one line on
    rank 0 and exit status 2 (a script may catch it)."""
    sys.excepthook = _user_error_hook(sys.excepthook)
    raise exc


def _user_error_hook(previous):
    def hook(exc_type, exc, tb):
        if isinstance(exc, ConfigError):
            refuse(exc)
        previous(exc_type, exc, tb)
    return hook


class Joined:
    """What :func:`join` returns: the control communicator (a ``Dup`` of the world), the
    workers' communicator (None on a dedicated server rank), the world ranks that train, and
    whether the server is a rank of its own."""

    def __init__(self, control, workers, world_ranks, dedicated):
        self.control, self.workers = control, workers
        self.world_ranks, self.dedicated = world_ranks, dedicated



def join(world, config: SyncConfig, server_rank: int = 0) -> Joined:
    """Collective over ``world``: check the placement, that every rank runs the same
    settings, then make the control and workers' communicators."""
    from mpi4py import MPI

    size, rank = world.Get_size(), world.Get_rank()
    dedicated = config.server == "dedicated"
    if dedicated and size < 2:
        raise ConfigError(f"server='dedicated' needs at least 2 ranks (1 server + workers), "
                          f"launched with {size}; use server='colocated' or more ranks")
    if not 0 <= server_rank < size:
        raise ConfigError(f"server_rank={server_rank} is outside 0..{size - 1}")
    if config.server == "colocated" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ConfigError("server='colocated' runs the state server as a thread and needs "
                          "MPI_THREAD_MULTIPLE; this MPI provides level "
                          f"{MPI.Query_thread()}; use server='dedicated'")
    world_ranks = [r for r in range(size) if not (dedicated and r == server_rank)]
    label = (f"rank {rank} (state server)" if dedicated and rank == server_rank
             else f"rank {rank} (worker {world_ranks.index(rank)})")
    install_abort_hooks(world, label)
    check_same_config(world, config, server_rank)
    control = world.Dup()
    is_worker = rank in world_ranks
    workers = world.Split(color=1 if is_worker else MPI.UNDEFINED, key=rank)
    return Joined(control, workers if is_worker else None, world_ranks, dedicated)


def serve_dedicated(joined: Joined, config: SyncConfig, server_rank: int = 0, *,
                    stats_path: str | None = None, trace_path: str | None = None) -> dict:
    """Serve until every worker has shut down (this rank is the dedicated server); write the
    server's stats and trace where asked; return the stats."""
    from mpsync.server import StateServer

    stats = StateServer(joined.control, config, server_rank=server_rank,
                        workers=joined.world_ranks).serve()
    write_outputs(stats, stats_path, trace_path)
    return stats


def write_outputs(stats: dict, stats_path: str | None, trace_path: str | None) -> None:
    """The server's stats as JSON and its events as a Chrome trace, where asked."""
    from mpsync.server import write_chrome_trace, write_stats_json

    if stats_path:
        write_stats_json(stats, stats_path)
    if trace_path:
        write_chrome_trace(stats, trace_path)


def check_same_config(world, config: SyncConfig, server_rank: int) -> None:
    """Every rank must run the same settings (a per-rank environment variable or argument
    would otherwise surface as a deadlock or a silently wrong policy)."""
    import json

    mine = json.dumps(config.to_dict(), sort_keys=True, default=str)
    every = world.allgather(mine)
    if any(c != every[server_rank] for c in every):
        differ = [r for r, c in enumerate(every) if c != every[server_rank]]
        raise ConfigError(f"ranks {differ} were given other mpsync settings than rank "
                          f"{server_rank}: {mine if world.Get_rank() in differ else every[server_rank]}")
