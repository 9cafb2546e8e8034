"""Where a job's ranks go when mpsync starts its own ``mpirun``: this host, the hosts of ``-H``
or a hostfile, or a scheduler's allocation (pure functions, no launch).

The host syntax is horovodrun's: ``-H host1:2,host2:2`` (host:slots, slots 1 when left out) and
``--hostfile FILE`` with one ``host slots=N`` (or ``host:N``, or ``host``) per line.  Inside a
Slurm (or PBS) allocation Open MPI's ``mpirun`` reads the allocation itself, as it does under
horovodrun; mpsync only counts its slots to decide whether to oversubscribe.

A job started by ``mpsync train --np N`` has N workers plus, with the dedicated state server,
one more rank: that rank answers small control messages and computes little, so it is given a
slot of its own on the first host rather than taking one of the workers' slots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from mpsync.launch.target import LaunchError

__all__ = ["Placement", "parse_hosts", "read_hostfile", "placement_of", "launched_rank",
           "local_cores", "scheduler_slots"]

# Variables a launcher sets in the processes it starts as ranks: Open MPI's mpirun, PMIx
# (Open MPI 4/5, srun --mpi=pmix), PMI (MPICH's hydra, srun --mpi=pmi2).
_RANK_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")


def launched_rank(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process is already a rank of a job (under ``mpirun``, ``srun`` of several
    tasks, horovodrun): mpsync then runs in place instead of starting ``mpirun`` itself."""
    env = os.environ if environ is None else environ
    if env.get("OMPI_MCA_ess") == "singleton" and "OMPI_COMM_WORLD_SIZE" not in env:
        # A child of a process that called MPI_Init on its own (a singleton: a script or a
        # test runner that imported mpi4py) inherits its PMIX_RANK=0, yet is no rank of a job.
        return False
    if any(name in env for name in _RANK_VARIABLES):
        return True
    # srun starting several tasks: every task is a rank (one task is a plain process).
    return _int(env.get("SLURM_STEP_NUM_TASKS")) > 1


def scheduler_slots(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(scheduler, task slots) of the allocation this process runs in, or None outside one:
    Slurm's ``SLURM_NTASKS`` (else its nodes), PBS's ``PBS_NODEFILE`` lines."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID"):
        slots = _int(env.get("SLURM_NTASKS")) or _int(env.get("SLURM_JOB_NUM_NODES"))
        return "slurm", max(slots, 1)
    nodefile = env.get("PBS_NODEFILE")
    if nodefile and os.path.isfile(nodefile):
        with open(nodefile) as f:
            return "pbs", max(sum(1 for line in f if line.strip()), 1)
    return None


def local_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_hosts(text: str, what: str = "-H") -> tuple[tuple[str, int], ...]:
    """``"a:2,b:2,c"`` -> ((a, 2), (b, 2), (c, 1)); the error names ``what``."""
    hosts = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        if not name or not slots.isdigit() or int(slots) < 1:
            raise LaunchError(f"{what} {text!r}: {item!r} is not HOST or HOST:SLOTS with "
                              f"SLOTS >= 1 (e.g. -H node1:4,node2:4)")
        hosts.append((name, int(slots)))
    if not hosts:
        raise LaunchError(f"{what} {text!r} names no host (e.g. -H node1:4,node2:4)")
    return tuple(hosts)


def read_hostfile(path: str) -> tuple[tuple[str, int], ...]:
    """The hosts of a hostfile: ``host slots=N``, ``host:N`` or ``host`` per line, ``#``
    comments, blank lines ignored (horovodrun's and Open MPI's formats)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LaunchError(f"--hostfile {path}: cannot read it ({e.strerror}); give a file with "
                          f"one 'host slots=N' per line") from None
    items = []
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")), None)
        items.append(f"{words[0]}:{slots}" if slots is not None else words[0])
    if not items:
        raise LaunchError(f"--hostfile {path} names no host; give one 'host slots=N' per line")
    return parse_hosts(",".join(items), what=f"--hostfile {path}:")


@dataclass(frozen=True)
class Placement:
    """Where ``ranks`` ranks go: ``hosts`` ((name, slots), ...) for ``--host``, empty for this
    host or a scheduler's allocation; ``oversubscribe`` when the slots are fewer than the
    ranks; ``where`` says which, for the job's opening line."""

    ranks: int
    hosts: tuple[tuple[str, int], ...]
    oversubscribe: bool
    where: str

    @property
    def local(self) -> bool:
        """Every rank on this host (no hosts given, no scheduler's allocation)."""
        return not self.hosts and self.where.startswith("on this host")

    def host_argv(self) -> list[str]:
        """``--host a:2,b:2`` (nothing for this host or an allocation)."""
        if not self.hosts:
            return []
        return ["--host", ",".join(f"{h}:{n}" for h, n in self.hosts)]

    def host_of(self, rank: int) -> str | None:
        """The host Open MPI's default by-slot mapping puts ``rank`` on (None: not known
        here)."""
        for name, slots in self.hosts:
            if rank < slots:
                return name
            rank -= slots
        return None


def placement_of(workers: int, extra_ranks: int = 0, *, hosts: str | None = None,
                 hostfile: str | None = None, cores: int | None = None,
                 environ: Mapping[str, str] | None = None) -> Placement:
    """Where ``workers`` worker ranks and ``extra_ranks`` others (the dedicated state server)
    go.  ``-H``/``--hostfile``: those hosts, an extra rank on the first host beside its
    workers; more workers than slots is an error, as in horovodrun.  Else a scheduler's
    allocation, else this host; both oversubscribed when the cores or tasks are fewer than the
    ranks (``cores`` defaults to this process's)."""
    if workers < 1:
        raise LaunchError(f"--np must be >= 1 worker, got {workers}")
    ranks = workers + extra_ranks
    if hosts and hostfile:
        raise LaunchError("give -H/--hosts or --hostfile, not both")
    if hosts or hostfile:
        listed = parse_hosts(hosts) if hosts else read_hostfile(hostfile)
        slots = sum(n for _, n in listed)
        if workers > slots:
            raise LaunchError(f"--np {workers} asks for more workers than the {slots} slots of "
                              f"{'-H ' + hosts if hosts else '--hostfile ' + hostfile}; give "
                              f"more slots (HOST:SLOTS) or a smaller --np")
        if ranks > slots:   # the server's rank: one more slot on the first host
            (first, n), rest = listed[0], listed[1:]
            listed = ((first, n + ranks - slots),) + rest
        names = ",".join(f"{h}:{n}" for h, n in listed)
        return Placement(ranks, listed, False, f"on {names}")
    allocation = scheduler_slots(environ)
    if allocation is not None:
        name, slots = allocation
        return Placement(ranks, (), ranks > slots, f"in the {name} allocation ({slots} tasks)")
    cores = local_cores() if cores is None else cores
    return Placement(ranks, (), ranks > cores, f"on this host ({cores} cores)")


def _int(text: str | None) -> int:
    try:
        return int(str(text).split("(")[0])
    except ValueError:
        return 0
