"""mpsync starting its own ``mpirun``, as horovodrun and torchrun do: ``mpsync train --np 4``,
``mpsync compare --np 2``, ``mpsync run --np 4 python train.py``.

Two parts: :func:`build_job` is pure (flags in, a :class:`Job` with its ``mpirun`` argv out) and
:func:`run_job` runs one job and returns its :class:`JobOutcome`: the exit status and, when it
failed, which rank, on which host, and why.  ``run_job`` has no other effect than the job's own
output, so a supervisor that restarts a failed job calls it again (with a new ``Job`` when the
hosts changed).

While the job runs, its output passes through unchanged except Open MPI's own boxed notices
about a failed process (``mpirun noticed that process rank 3 ... exited on signal 9``, the
``MPI_ABORT was invoked`` box): ``run_job`` reads them to fill the outcome and prints, in their
place, one mpsync block that names the rank (worker or state server), its host and what
happened.  A rank that already said why it failed (mpsync's fault block, a user error's one
line) is not repeated.  ``MPSYNC_DEBUG=1`` (``--debug``) passes every line through.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TextIO

from mpsync.cluster.agent import descendants
from mpsync.commits import HOSTS_CHANGED, RESTART_EXIT_CODE
from mpsync.config import debug_enabled
from mpsync.launch.hosts import Placement, placement_of
from mpsync.launch.mpirun import clean_launch_env, forwarded_env, kill_group, mpirun_argv

__all__ = ["Job", "JobOutcome", "build_job", "run_job", "mpsync_roles", "USER_ERROR",
           "OutputFilter", "REPORTED_MARKERS"]

# The exit status of a job whose ranks refused its settings (one line each said why).
USER_ERROR = 2

# Lines by which an mpsync rank says itself why it failed: the launcher then adds no block.
REPORTED_MARKERS = ("MPSYNC-RANK-FAILED", "mpsync: fault")


def mpsync_roles(dedicated_server: bool = True, server_rank: int = 0) -> Callable[[int], str]:
    """rank -> what it is in an mpsync job: ``state server`` or ``worker k``."""
    def role(rank: int) -> str:
        if dedicated_server:
            if rank == server_rank:
                return "state server"
            return f"worker {rank - (1 if rank > server_rank else 0)}"
        return f"worker {rank}" + (" and state server" if rank == server_rank else "")
    return role


@dataclass(frozen=True)
class Job:
    """One ``mpirun`` to start: its argv, where its ranks go, what each rank is."""

    argv: list[str]
    placement: Placement
    role: Callable[[int], str] = field(default=lambda rank: f"rank {rank}")
    name: str = "mpsync"

    def describe(self) -> str:
        return f"{self.placement.ranks} ranks {self.placement.where}"


def build_job(command: Sequence[str], workers: int, *, dedicated_server: bool = True,
              hosts: str | None = None, hostfile: str | None = None,
              mpirun_args: Sequence[str] = (), cores: int | None = None,
              environ=None, allow_run_as_root: bool | None = None,
              mpirun: str = "mpirun", name: str = "mpsync") -> Job:
    """The job that runs ``command`` on ``workers`` worker ranks (plus the dedicated state
    server's rank): placed by :func:`~mpsync.launch.hosts.placement_of`, root allowed when we
    are root, ``MPSYNC_*`` (and the rest of ``FORWARDED_ENV``) passed to every node,
    ``mpirun_args`` last so that they can override the rest."""
    placement = placement_of(workers, 1 if dedicated_server else 0, hosts=hosts,
                             hostfile=hostfile, cores=cores, environ=environ)
    argv = mpirun_argv(placement.ranks, list(command), mpirun=mpirun,
                       oversubscribe=placement.oversubscribe,
                       allow_run_as_root=allow_run_as_root,
                       forward_env=forwarded_env(environ),
                       extra=[*placement.host_argv(), *mpirun_args])
    return Job(argv, placement, mpsync_roles(dedicated_server), name)


@dataclass
class JobOutcome:
    """How a job ended.  ``returncode``: mpirun's (None when mpsync stopped it: deadline or
    interrupt); ``rank`` / ``host`` / ``reason``: the rank that failed, where known: the one
    killed, else the one that went silent (``silent``: named by mpsync's deadline messages, not
    the rank that gave up waiting for it), else the first that exited or aborted;
    ``reported``: a rank printed mpsync's own account of a failure (a fault or a bug)."""

    returncode: int | None
    elapsed: float
    rank: int | None = None
    role: str | None = None
    host: str | None = None
    reason: str | None = None
    signal: int | None = None
    reported: bool = False
    silent: bool = False
    timed_out: bool = False
    interrupted: bool = False
    restart_asked: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def exit_code(self) -> int:
        """The status for the launcher to exit with: the job's; 124 at the deadline, 130 on
        an interrupt (as ``timeout`` and shells use)."""
        if self.timed_out:
            return 124
        if self.interrupted:
            return 130
        return self.returncode if self.returncode is not None else 1

    def block(self, name: str = "mpsync") -> str:
        """The lines that say what failed (empty when nothing did, or the ranks refused
        their settings, each in one line)."""
        if self.ok or self.interrupted:
            return ""
        if self.returncode == USER_ERROR and self.signal is None and not self.timed_out:
            return ""   # each rank refused a setting in one line already
        if self.restart_asked and self.returncode == RESTART_EXIT_CODE:
            return ""   # hvd.elastic's worker 0 said why: new hosts, not a failure
        if self.timed_out:
            return (f"{name}: the job did not end within its time limit "
                    f"({self.elapsed:.0f} s); it was stopped\n")
        who = "a rank" if self.rank is None else f"rank {self.rank} ({self.role})"
        where = f" on {self.host}" if self.host else ""
        lines = [f"{name}: the job failed: {who}{where} {self.reason or 'failed'}, "
                 f"{self.elapsed:.1f} s into the job"]
        if self.signal == signal.SIGKILL:
            lines.append("  it said nothing: it was killed from outside (out of memory, a "
                         "scheduler's limit, kill -9); every other rank was stopped")
        elif self.signal is not None or self.silent:
            lines.append("  every other rank was stopped")
        elif self.rank is not None:
            lines.append("  its own output above says why; every other rank was stopped")
        lines.append(f"  exit status {self.exit_code}")
        return "\n".join(lines) + "\n"


_DASHES = re.compile(r"^-{20,}\s*$")
_PIECES = re.compile(r"(?<=[\r\n])")
# Open MPI's boxed notices about a failed process, and its help-aggregation lines.
_NOTICES = ("mpirun noticed that process", "Primary job  terminated normally",
            "MPI_ABORT was invoked", "mpirun detected that one or more processes exited",
            "mpirun has exited due to process rank")
_AGGREGATION = re.compile(r"^\[[^\]]*\] (\d+ more process(es)? ha(s|ve) sent help message|"
                          r"Set MCA parameter \"orte_base_help_aggregate\"|"
                          r"\[\[\d+,\d+\],\d+\] ORTE_ERROR_LOG: .*show_help\.c)")
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal "
                        r"(\d+)(?: \(([^)]*)\))?")
_ABORTED = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator .*? with "
                      r"errorcode (\d+)")
_EXITED = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]\s+Exit code:\s+(\d+)")
_EXITED_HOST = re.compile(r"mpirun has exited due to process rank (\d+) with PID \d+ on\s+node "
                          r"(\S+) exiting improperly")


# mpsync's own messages about a silent worker, most precise first: a collective's deadline
# ("no word from worker 1 (world rank 2)"), the stall warning's missing workers, the state
# server's silence (which on the ring may also name workers waiting for the silent one).
_NO_WORD = re.compile(r"([^\s:][^:\n]*?) not complete after ([\d.]+)s deadline: no word from "
                      r"worker (\d+) \(world rank (\d+)\)")
_MISSING = re.compile(r"^  worker (\d+): \[(.*)\]\s*$")
_STALL = "mpsync: one or more collectives were submitted by a subset of the workers"
_NO_REPLY = re.compile(r"mpsync: fault: rank \d+ \(([^)]*)\) on \S+: (?:\w+: )?no reply from "
                       r"the state server \(rank (\d+)\) to (.*?) within the ([\d.]+)s "
                       r"deadline")
_NO_ANSWER = re.compile(r"mpsync: fault: rank \d+ \(([^)]*)\) on \S+: (?:\w+: )?no answer from "
                        r"PS shard (\d+) \(world rank (\d+) on ([^)\s]+)\).*? to (.+?) within "
                        r"the ([\d.]+)s deadline")
_SERVER_SILENT = re.compile(r"mpsync server: worker rank\(s\) \[([\d, ]+)\] silent for more "
                            r"than ([\d.]+)s")
# mpsync ending the job itself because a peer is lost: the state server's or a shard's "aborting
# (ending) the job", a worker's fault line.  mpirun may then wait for a lost node's daemon until
# its own timeouts pass; the launcher gives it ``ABORT_GRACE_S`` to end by itself, then stops it.
_ENDING = re.compile(r"^mpsync(?: server)?: .*(?:aborting|ending) the job\s*$|^mpsync: fault: ")
ABORT_GRACE_S = 0.5


class OutputFilter:
    """Passes a job's stderr through to ``sink``, holding back Open MPI's boxed notices about
    failed processes (kept, not printed, unless ``keep_all``) and noting mpsync's own reports.
    Text without a newline yet (a progress bar) passes at once."""

    def __init__(self, sink: TextIO, keep_all: bool = False):
        self.sink, self.keep_all = sink, keep_all
        self.notices: list[str] = []
        self.faults: list[str] = []   # mpsync's lines naming a silent worker
        self.reported = False
        self.ending_at: float | None = None   # when a rank said mpsync is ending the job
        self.restart_asked = False   # hvd.elastic ends the job to start on new hosts
        self._stall = False
        self._partial = ""
        self._passed = ""   # the start of the current line, already passed on
        self._box: list[str] | None = None

    def feed(self, text: str) -> None:
        # "\r" ends a piece too: a progress bar redraws its line without a newline.
        pieces = _PIECES.split(self._partial + text)
        self._partial = pieces.pop()
        for piece in pieces:
            self._line(piece)
        # The start of a dashed box or of an Open MPI "[host:pid] ..." line waits for its end.
        if self._partial and self._box is None and not self._partial.startswith(("-", "[")):
            self.sink.write(self._partial)
            self._passed += self._partial
            self._partial = ""
        self.sink.flush()

    def close(self) -> None:
        if self._partial:
            self._line(self._partial)
            self._partial = ""
        if self._box is not None:
            self._flush_box(closed=False)
        self.sink.flush()

    def _line(self, line: str) -> None:
        whole = self._passed + line
        if whole.lstrip().startswith(REPORTED_MARKERS):
            self.reported = True
        if _NO_WORD.search(whole) or _SERVER_SILENT.match(whole) or _NO_REPLY.match(whole) or \
                _NO_ANSWER.match(whole) or \
                (self._stall and _MISSING.match(whole)):
            self.faults.append(whole)
        if whole.startswith(HOSTS_CHANGED):
            self.restart_asked = True
        if self.ending_at is None and _ENDING.match(whole):
            self.ending_at = time.monotonic()
        self._stall = whole.startswith(_STALL) or (self._stall and bool(_MISSING.match(whole)))
        if self._passed:    # the rest of a line whose start was passed on
            self._passed = ""
            self.sink.write(line)
            return
        if self._box is not None:
            self._box.append(line)
            if _DASHES.match(line):
                self._flush_box(closed=True)
            return
        if _DASHES.match(line):
            self._box = [line]
            return
        if _AGGREGATION.match(line) and not self.keep_all:
            return
        self.sink.write(line)

    def _flush_box(self, closed: bool) -> None:
        box, self._box = self._box or [], None
        text = "".join(box)
        if any(n in text for n in _NOTICES):
            self.notices.append(text)
            if not self.keep_all:
                return
        elif closed and len(box) == 2:  # two dashed lines in a row: the second opens a box
            self.sink.write(box[0])
            self._box = [box[1]]
            return
        self.sink.write(text)


def _read_notices(outcome: JobOutcome, notices: Sequence[str], job: Job) -> None:
    """Fill in the failed rank, host and reason from Open MPI's notices."""
    text = " ".join(" ".join(n.split()) for n in notices)
    m = _SIGNALLED.search(text)
    if m:
        outcome.rank, outcome.host = int(m.group(1)), m.group(2)
        outcome.signal = int(m.group(3))
        outcome.reason = f"was killed by signal {m.group(3)}" + \
            (f" ({m.group(4)})" if m.group(4) else "")
    elif (m := _ABORTED.search(text)):
        outcome.rank = int(m.group(1))
        outcome.reason = f"aborted the job (MPI_Abort, error code {m.group(2)})"
    elif (m := _EXITED.search(text)):
        outcome.rank = int(m.group(1))
        outcome.reason = f"exited with status {m.group(2)}"
    elif (m := _EXITED_HOST.search(text)):
        outcome.rank, outcome.host = int(m.group(1)), m.group(2)
        outcome.reason = "exited without finalizing MPI"
    if outcome.rank is not None:
        outcome.role = job.role(outcome.rank)
        if outcome.host is None:
            outcome.host = _host_of(job, outcome.rank)


def _read_faults(outcome: JobOutcome, faults: Sequence[str], job: Job) -> None:
    """Name the worker that went silent from mpsync's messages (``_NO_WORD`` and the others
    above), unless Open MPI saw a rank killed: that rank is the cause."""
    if outcome.signal is not None or not faults:
        return
    worker_rank = {job.role(r): r for r in range(job.placement.ranks)}
    found = None
    host = None
    for pattern in ("no word", "missing", "no reply", "no answer", "server"):
        for line in faults:
            if pattern == "no word" and (m := _NO_WORD.search(line)):
                found = (int(m.group(4)), f"went silent: the other workers waited for it in "
                                          f"{m.group(1)} past the {m.group(2)} s deadline")
            elif pattern == "missing" and (m := _MISSING.match(line)):
                rank = worker_rank.get(f"worker {m.group(1)}")
                if rank is not None:
                    found = (rank, f"went silent: the other workers waited for it in "
                                   f"{m.group(2).replace(chr(39), '')}")
            elif pattern == "no reply" and (m := _NO_REPLY.match(line)):
                found = (int(m.group(2)), f"went silent: {m.group(1)} had no reply from it "
                                          f"to {m.group(3)} within the {m.group(4)} s deadline")
            elif pattern == "no answer" and (m := _NO_ANSWER.match(line)):
                found = (int(m.group(3)), f"went silent: {m.group(1)} had no answer from it "
                                          f"(PS shard {m.group(2)}) to {m.group(5)} within "
                                          f"the {m.group(6)} s deadline")
                host = m.group(4)
            elif pattern == "server" and (m := _SERVER_SILENT.match(line)):
                found = (int(m.group(1).split(",")[0]), f"went silent: the state server heard "
                                                        f"nothing from it for {m.group(2)} s")
            if found:
                break
        if found:
            break
    if found is None:
        return
    outcome.rank, outcome.reason, outcome.silent = found[0], found[1], True
    outcome.role = job.role(outcome.rank)
    outcome.host = host or _host_of(job, outcome.rank)


def _host_of(job: Job, rank: int) -> str | None:
    """Where ``rank`` ran: from the job's hosts, this host, or not known (an allocation)."""
    if job.placement.hosts:
        return job.placement.host_of(rank)
    return socket.gethostname() if job.placement.local else None


def run_job(job: Job, *, timeout: float | None = None, env=None, cwd: str | None = None,
            stderr: TextIO | None = None, debug: bool | None = None) -> JobOutcome:
    """Run ``job`` to its end and say how it ended; stdout is the job's own, stderr passes
    through :class:`OutputFilter` (to ``stderr``, default ours).  ``timeout``: stop the whole
    process group after that many seconds.  Ctrl-C (or SIGTERM to us) stops the job's ranks
    and returns an interrupted outcome.  The failure block is printed here, once."""
    sink = sys.stderr if stderr is None else stderr
    if debug is None:
        debug = debug_enabled(os.environ if env is None else env)
    filt = OutputFilter(sink, keep_all=debug)
    start = time.monotonic()
    proc = subprocess.Popen(job.argv, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=clean_launch_env(os.environ if env is None else env), cwd=cwd,
                            start_new_session=True)
    reader = threading.Thread(target=_pump, args=(proc.stderr, filt), daemon=True)
    reader.start()
    outcome = JobOutcome(None, 0.0)
    restore = _stop_on_term(proc)
    stopped = False
    try:
        outcome.returncode, outcome.timed_out, stopped = _wait(
            proc, filt, start, timeout, remote=not job.placement.local)
        if outcome.timed_out:
            kill_group(proc, term_grace=5.0)
    except KeyboardInterrupt:
        outcome.interrupted = True
        kill_group(proc, term_grace=5.0)
    finally:
        restore()
    # A stopped mpirun's remote sessions (a lost node's) may hold the pipe open until their
    # own timeouts: what they would still say is teardown, not worth waiting for.
    reader.join(timeout=0.5 if stopped else 10)
    filt.close()
    outcome.elapsed = time.monotonic() - start
    outcome.reported, outcome.restart_asked = filt.reported, filt.restart_asked
    _read_notices(outcome, filt.notices, job)
    if not outcome.ok:
        _read_faults(outcome, filt.faults, job)
    if outcome.returncode is not None and outcome.returncode < 0:   # mpirun itself signalled
        outcome.signal = outcome.signal or -outcome.returncode
        outcome.returncode = 128 - outcome.returncode
    sink.write(outcome.block(job.name))
    sink.flush()
    return outcome


def _wait(proc: subprocess.Popen, filt: OutputFilter, start: float,
          timeout: float | None, remote: bool) -> tuple[int | None, bool, bool]:
    """(mpirun's exit status, timed out, stopped after mpsync's abort).  Once a rank has said
    that mpsync is ending the job (a lost peer named), mpirun gets ``ABORT_GRACE_S`` to end by
    itself: after an abort it waits for every node's daemon, a lost node's until its own
    timeouts pass (3 s more on the virtual cluster).  Past that a job on ``remote`` hosts is
    killed, mpirun and every process under it here (its ranks, its ssh sessions), and the
    job's status is the abort's, 1.  SIGKILL, not SIGTERM: mpirun takes a SIGTERM during an
    abort as "hit ctrl-c again" and, in Open MPI 4.1, crashes in its PMIx teardown, printing a
    backtrace; the daemons on other nodes end their ranks when mpirun's connection closes.
    A job on this host alone has no daemon to wait for: mpirun ends it by itself."""
    while True:
        try:
            return proc.wait(timeout=0.1), False, False
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if timeout is not None and now - start >= timeout:
            return None, True, False
        if remote and filt.ending_at is not None and now - filt.ending_at >= ABORT_GRACE_S:
            for pid in [proc.pid, *descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            return 1, False, True


def _pump(pipe, filt: OutputFilter) -> None:
    while True:
        chunk = os.read(pipe.fileno(), 65536)
        if not chunk:
            return
        filt.feed(chunk.decode("utf-8", errors="replace"))


def _stop_on_term(proc: subprocess.Popen):
    """SIGTERM to us stops the job like Ctrl-C does (a scheduler ending our step)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, on_term)
    return lambda: signal.signal(signal.SIGTERM, old)
