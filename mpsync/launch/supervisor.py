"""Restarting a job on the hosts that remain: the supervisor above ``mpirun``.

Open MPI 4.1 ends the whole job when one rank dies (no ULFM), so a job survives a lost worker
only by starting again.  The supervisor runs the job, reads from Open MPI's last words which
rank failed and on which host, decides which hosts remain (the failed host left out; on a
single host, the failed rank's slot), sizes the next job within ``--min-np``/``--max-np`` and
starts it again -- the command it starts resumes from the newest complete commit, which is
the command's business (``mpsync train --resume``, ``hvd.elastic.run``).  It never runs inside
a rank.

Pure parts (tested without MPI): :func:`remaining_hosts`, :func:`worker_count`,
:func:`parse_hosts`.  :func:`supervise` is the loop; the caller's ``run`` starts each job,
normally through :func:`run_watched`: the launcher of ``mpsync train --np N`` and ``mpsync
run`` (:func:`mpsync.launch.runner.run_job`, which reads Open MPI's notices), plus the silent
worker named by mpsync's deadline message.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from mpsync.commits import RESTART_EXIT_CODE, USER_ERROR_EXIT_CODE
from mpsync.launch.runner import run_job

__all__ = ["Host", "Failure", "Attempt", "JobEnd", "remaining_hosts", "worker_count",
           "parse_hosts", "discover_hosts", "allocation_hosts", "supervise", "run_watched",
           "end_of", "hosts_text", "write_record", "SupervisorError", "JOB_RESTARTS",
           "NO_RESTART_CODES", "RESTART_EXIT_CODE", "LOCAL"]

# The name of this host in a host list: the launcher places the ranks here itself.
LOCAL = "localhost"
# Exit codes that are the user's mistake, not a fault: restarting would fail the same way.
NO_RESTART_CODES = (USER_ERROR_EXIT_CODE,)


class SupervisorError(RuntimeError):
    """The job cannot be restarted (too few workers left, a bad discovery script)."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class Failure:
    """Who ended the job and why, as far as Open MPI's messages tell."""
    rank: int | None
    host: str | None
    cause: str


@dataclass
class JobEnd:
    """How one job ended: mpirun's exit code (None: stopped from outside), who failed."""
    returncode: int | None
    failure: Failure | None
    elapsed: float


@dataclass
class Attempt:
    """One start of the job: what it ran on and how it ended."""
    index: int
    np: int
    hosts: list
    started_at: float
    ended_at: float | None = None
    returncode: int | None = None
    failure: dict | None = None
    extra: dict = field(default_factory=dict)


# A node that stopped answering: Open MPI's lost daemon, or the virtual cluster's ssh stand-in.
_LOST_NODE = re.compile(r"Remote daemon:\s*\[\[\d+,\d+\],\d+\] on node (\S+)|"
                        r"(\S+) \([\d.]+\) has not answered for")


def remaining_hosts(hosts: Sequence[Host], failure: Failure, world_hosts: Sequence[str] = ()
                    ) -> list[Host]:
    """The hosts for the next start: with several hosts, the failed rank's host is left out
    (a lost node takes its ranks with it); on a single host, the failed rank's slot.
    ``world_hosts``: each world rank's host in the failed job, when the failure names only a
    rank.  An unknown failure leaves the hosts as they were."""
    host = failure.host
    if host is None and failure.rank is not None and failure.rank < len(world_hosts):
        host = world_hosts[failure.rank]
    if failure.rank is None and host is None:
        return list(hosts)
    if len(hosts) == 1:
        only = hosts[0]
        return [Host(only.name, only.slots - 1)] if only.slots > 1 else []
    return [h for h in hosts if h.name != host] if host is not None else list(hosts)


def worker_count(hosts: Sequence[Host], *, min_np: int, max_np: int, extra_ranks: int = 0
                 ) -> int:
    """Workers the next start gets: all the slots allow (less ``extra_ranks``, e.g. the
    dedicated server's), at most ``max_np``; SupervisorError below ``min_np``."""
    free = sum(h.slots for h in hosts) - extra_ranks
    np = min(max_np, free)
    if np < min_np:
        raise SupervisorError(f"only {max(free, 0)} worker slots remain on "
                              f"{', '.join(h.name for h in hosts) or 'no host'}; "
                              f"--min-np is {min_np}")
    return np


def parse_hosts(text: str, default_slots: int = 1) -> list[Host]:
    """``host[:slots]`` entries, separated by commas or lines (horovodrun's -H and discovery
    script formats)."""
    hosts = []
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        name, _, slots = item.partition(":")
        try:
            n = int(slots) if slots else default_slots
        except ValueError:
            raise SupervisorError(f"host entry {item!r}: slots must be an integer "
                                  f"(host:slots)") from None
        if n < 1:
            raise SupervisorError(f"host entry {item!r}: slots must be >= 1")
        hosts.append(Host(name, n))
    return hosts


def allocation_hosts(environ=None) -> list[Host] | None:
    """The hosts and task slots of the Slurm or PBS allocation this process runs in (None
    outside one): what a restart inside the allocation chooses from."""
    env = os.environ if environ is None else environ
    nodefile = env.get("PBS_NODEFILE")
    if nodefile:
        counts: dict[str, int] = {}
        with open(nodefile) as f:
            for line in f:
                if line.strip():
                    counts[line.strip()] = counts.get(line.strip(), 0) + 1
        return [Host(h, n) for h, n in counts.items()]
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                               text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    # SLURM_TASKS_PER_NODE: "5(x2),4" -> 5, 5, 4
    per: list[int] = []
    for part in env.get("SLURM_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            per += [int(m.group(1))] * int(m.group(2) or 1)
    if len(per) != len(names):
        return None
    return [Host(h, n) for h, n in zip(names, per)]


def discover_hosts(script: str, default_slots: int = 1, timeout: float = 30.0) -> list[Host]:
    """Run a host discovery script (horovodrun's ``--host-discovery-script``): it prints one
    ``host[:slots]`` per line of the hosts available now."""
    try:
        out = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SupervisorError(f"--host-discovery-script {script}: {e}") from None
    if out.returncode != 0:
        raise SupervisorError(f"--host-discovery-script {script}: exit code "
                              f"{out.returncode}: {out.stderr.strip()[-300:]}")
    return parse_hosts(out.stdout, default_slots)


def end_of(outcome) -> JobEnd:
    """A :class:`mpsync.launch.runner.JobOutcome` (the launcher of ``mpsync train --np`` and
    ``mpsync run``) as the supervisor reads it."""
    failure = None
    if not outcome.ok:
        failure = Failure(outcome.rank, outcome.host,
                          outcome.reason or f"exit status {outcome.exit_code}")
    return JobEnd(0 if outcome.ok else outcome.exit_code, failure, outcome.elapsed)


class _Tee:
    """A text sink that passes everything on and keeps the last lines."""

    def __init__(self, sink, lines: int = 400):
        self.sink, self.tail = sink, deque(maxlen=lines)

    def write(self, text: str) -> int:
        self.tail.append(text)
        return self.sink.write(text)

    def flush(self) -> None:
        self.sink.flush()


def run_watched(job, **run_kw) -> JobEnd:
    """Run ``job`` with :func:`mpsync.launch.runner.run_job` and read how it ended; a worker
    that went silent (stopped, cut off) is named by mpsync's deadline message ("no word from
    worker W (world rank R)"), not by the rank that gave up waiting on it and aborted."""
    tee = _Tee(run_kw.pop("stderr", None) or sys.stderr)
    end = end_of(run_job(job, stderr=tee, **run_kw))
    lost = _LOST_NODE.search("".join(tee.tail))
    if end.failure is not None and lost and end.failure.host is None:
        end.failure = Failure(None, lost.group(1) or lost.group(2),
                              "node lost (stopped answering)")
    return end


def hosts_text(hosts) -> str | None:
    """``host:slots,...`` for ``-H`` (None for this host alone: the launcher's own placement,
    oversubscribed as needed)."""
    names = [(h["name"], h["slots"]) if isinstance(h, dict) else (h.name, h.slots)
             for h in hosts]
    if len(names) == 1 and names[0][0] == LOCAL:
        return None
    return ",".join(f"{n}:{s}" for n, s in names)


def supervise(run: Callable[[Attempt], JobEnd], hosts: Sequence[Host], *, min_np: int,
              max_np: int, max_restarts: int, extra_ranks: int = 0,
              discover: Callable[[], list[Host]] | None = None,
              on_end: Callable[[Attempt, list], None] | None = None,
              log: Callable[[str], None] | None = None) -> tuple[int, list[Attempt]]:
    """Run the job (``run(attempt)`` starts it with ``attempt.np`` workers on
    ``attempt.hosts`` and waits for its end) and restart it after a failure, up to
    ``max_restarts`` times, on the hosts that remain (or, with ``discover``, those it lists,
    the failed ones excluded).  ``on_end(attempt, attempts)`` is called after every job with
    the record so far (to write it somewhere).  Returns the last job's exit code and every
    attempt."""
    log = log or (lambda msg: print(f"mpsync supervisor: {msg}", file=sys.stderr, flush=True))
    hosts, excluded = list(hosts), set()
    attempts: list[Attempt] = []
    restarts = 0
    while True:
        if discover is not None and attempts:
            hosts = [h for h in discover() if h.name not in excluded]
        np = worker_count(hosts, min_np=min_np, max_np=max_np, extra_ranks=extra_ranks)
        attempt = Attempt(len(attempts), np, [asdict(h) for h in hosts], time.time())
        attempts.append(attempt)
        end = run(attempt)
        attempt.ended_at, attempt.returncode = time.time(), end.returncode
        if end.returncode == 0:
            if on_end:
                on_end(attempt, attempts)
            return 0, attempts
        failure = end.failure or Failure(None, None, f"exit code {end.returncode}")
        attempt.failure = asdict(failure)
        if on_end:
            on_end(attempt, attempts)
        if end.returncode in NO_RESTART_CODES:
            return end.returncode, attempts
        if end.returncode == RESTART_EXIT_CODE:
            log(f"job {attempt.index} asked for a restart (hosts changed); starting again")
            continue
        if restarts >= max_restarts:
            if max_restarts:
                log(f"job {attempt.index} failed ({_describe(failure)}); no restarts left "
                    f"(--max-restarts {max_restarts})")
            return end.returncode if end.returncode is not None else 1, attempts
        restarts += 1
        if failure.host is not None and len(hosts) > 1:
            excluded.add(failure.host)
        hosts = remaining_hosts(hosts, failure)
        try:
            worker_count(hosts, min_np=min_np, max_np=max_np, extra_ranks=extra_ranks)
        except SupervisorError as e:
            if discover is None:
                log(f"job {attempt.index} failed ({_describe(failure)}); cannot restart: {e}")
                return end.returncode if end.returncode is not None else 1, attempts
        log(f"job {attempt.index} failed ({_describe(failure)}) after {end.elapsed:.1f}s; "
            f"restart {restarts} of {max_restarts} on "
            f"{', '.join(f'{h.name}:{h.slots}' for h in hosts)}")


def _describe(f: Failure) -> str:
    who = f"rank {f.rank}" if f.rank is not None else "unknown rank"
    return f"{who}{f' on {f.host}' if f.host else ''}: {f.cause}"


# The job scripts' restarts (Slurm, PBS): with MAX_RESTARTS > 0 the script runs mpsync train as
# the supervisor of its own mpirun (the same launcher), which restarts inside the allocation on
# the nodes that remain (allocation_hosts).
JOB_RESTARTS = """
# A lost rank ends mpirun.  MAX_RESTARTS > 0: mpsync train starts mpirun itself and starts it
# again on the nodes of this allocation that remain, from the newest checkpoint in OUT_DIR.
[[ $MAX_RESTARTS =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be an integer >= 0, got '$MAX_RESTARTS'"
if ((MAX_RESTARTS > 0)); then
  workers=$NP
  [ "$SERVER" = colocated ] || workers=$((NP - 1))
  command=("${train[@]}" --np "$workers" --max-restarts "$MAX_RESTARTS"
           --checkpoint-every "$CHECKPOINT_EVERY" --mpirun-args "${tuning[*]} $MPIRUN_ARGS")
fi
"""


def write_record(path, attempts: Sequence[Attempt]) -> None:
    """The attempts as JSON, written atomically (a reader never sees half a record)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump([asdict(a) for a in attempts], f, indent=1)
    os.replace(tmp, path)
