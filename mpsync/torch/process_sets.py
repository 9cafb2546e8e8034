"""Horovod's process sets: collectives over a subset of the workers.

``ps = mps.add_process_set([0, 2])`` (called by every worker, as in Horovod) gives the
members a sub-communicator of the workers' communicator (``Split``), with its own record
exchange and data communicators; ``process_set=ps`` then limits a collective to them.  Ranks
are worker ranks (``mps.rank()``); ``ps.rank()`` is the rank inside the set, the order of
``allgather`` results; a broadcast's ``root_rank`` stays a worker rank, as in Horovod.  The
state server stays global: it never sees process sets.

``DistributedOptimizer(process_set=ps)`` accepts only a set of every worker: each policy's
server decides rounds for the whole world (a BSP round, an ESync round, a ZipLine barrier),
so an optimizer aggregating over a subset would leave those rounds unmatched.
"""

from __future__ import annotations

from mpsync.torch import _runtime

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "ops_of", "user_ops", "every_ops", "is_whole_world"]


class ProcessSet:
    """A set of workers, from a list of worker ranks or an mpi4py communicator whose members
    are all workers.  Usable once registered (``add_process_set`` or ``init(process_sets=)``);
    ``process_set_id`` is then set."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, (list, tuple, range, set)):
            ranks = sorted(ranks_or_comm)
            if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of worker ranks "
                                 "or an mpi4py Comm object")
            self.ranks = ranks
        else:
            from mpi4py import MPI

            if not isinstance(ranks_or_comm, MPI.Comm):
                raise ValueError("ProcessSet should be initialized with a list of worker ranks "
                                 "or an mpi4py Comm object")
            self.mpi_comm = ranks_or_comm

    def _ops(self):
        return _registry().get(self.process_set_id)

    def size(self) -> int | None:
        """Members, or None before registration."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This worker's rank inside the set (None before registration or if not a member)."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(_runtime.context().worker_rank)

    def included(self) -> bool | None:
        if self.ranks is None:
            return None
        return _runtime.context().worker_rank in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _registry() -> dict:
    return _runtime.worker_context("process sets").process_sets


def _ranks_of_comm(ctx, comm) -> list[int]:
    from mpi4py import MPI

    group, workers = comm.Get_group(), ctx.workers.Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), workers)
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("ProcessSet: the communicator has members that are not workers (the "
                         "state-server rank?)")
    return sorted(ranks)


def add_process_set(process_set) -> ProcessSet:
    """Register ``process_set`` (a :class:`ProcessSet` or a list of worker ranks) and return
    it.  Every worker calls it, in the same order (it is collective over all workers)."""
    from mpi4py import MPI

    from mpsync.torch._collectives import UserOps

    ctx = _runtime.worker_context("add_process_set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        ps.ranks = _ranks_of_comm(ctx, ps.mpi_comm)
    n = ctx.size
    if not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) or \
            not all(0 <= r < n for r in ps.ranks):
        raise ValueError(f"add_process_set: ranks must be distinct worker ranks in 0..{n - 1}, "
                         f"got {ps.ranks}")
    registry = ctx.process_sets
    if ps.ranks == list(range(n)) or any(o[0].ranks == ps.ranks for o in registry.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    member = ctx.worker_rank in ps.ranks
    sub = ctx.workers.Split(color=0 if member else MPI.UNDEFINED, key=ctx.worker_rank)
    ctx.next_process_set_id += 1
    ps.process_set_id = ctx.next_process_set_id
    ops = None
    if member:
        from mpsync.torch.dataplane.backends import MPIAggregator

        ops = UserOps(sub, ctx.config.deadline, None, ctx.user_ops.idle, ranks=ps.ranks,
                      world_ranks=[ctx.world_ranks[w] for w in ps.ranks],
                      heartbeat=ctx.user_ops.heartbeat, negotiation=ctx.negotiation)
        # A DistributedOptimizer over this set aggregates here (BSP; see optimizer).
        ops.aggregator = MPIAggregator(sub.Dup(), deadline=ctx.config.deadline,
                                       thread_min_bytes=None)
    registry[ps.process_set_id] = (ps, ops)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every worker calls it); False for the global set or one
    not registered."""
    pid = process_set.process_set_id
    if pid is None or pid == 0:
        return False
    entry = _registry().pop(pid, None)
    process_set._invalidate()
    if entry is None:
        return False
    ops = entry[1]
    if ops is not None:
        ops.aggregator.comm.Free()
        ops.free()
    return True


def ops_of(process_set, what: str):
    """The collectives of ``process_set`` on this worker; a clear error when it is not
    registered or this worker is not a member."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{what}: process_set must be a ProcessSet (a process set from mps.add_process_set), got "
                         f"{type(process_set).__name__}")
    entry = _registry().get(process_set.process_set_id)
    if entry is None:
        raise ValueError(f"{what}: {process_set} is not registered (mps.add_process_set)")
    if entry[1] is None:
        raise ValueError(f"{what}: worker {_runtime.context().worker_rank} is not a member of "
                         f"the process set of workers {process_set.ranks}")
    return entry[1]


def user_ops(what: str, process_set=None):
    """The :class:`~mpsync.torch._collectives.UserOps` of ``process_set`` (default: all
    workers), made at ``init``."""
    ctx = _runtime.worker_context(what)
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return ctx.user_ops
    return ops_of(process_set, what)


def every_ops(ctx) -> list:
    return [ctx.user_ops] + [ops for _, ops in ctx.process_sets.values() if ops is not None]


def is_whole_world(process_set) -> bool:
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return True
    ranks = getattr(process_set, "ranks", None)
    return ranks is not None and ranks == list(range(_runtime.context().size))
