"""Building and running ``mpirun`` command lines.

Launch commands are built by pure functions as argv lists (never one formatted shell string) so
that they can be tested against expected output and reused by ``mpsync compare``, the
benchmarks, the job templates and the test harness alike.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

from mpsync.launch.settings import JobSettings
from mpsync.launch.target import LaunchTarget, Variable

__all__ = ["mpirun_argv", "mpirun_options", "python_argv", "run_with_deadline", "LaunchResult",
           "is_root", "forwarded_env", "clean_launch_env", "FORWARDED_ENV", "FORWARDED_PREFIXES",
           "YIELD_WHEN_IDLE", "MPIRUN_LAUNCH", "script_variables", "TARGET", "kill_group"]

# Environment variables an mpsync rank needs to see on every node.  Open MPI forwards nothing by
# default to remote nodes, so launchers pass these with ``-x``, which takes names, not patterns:
# ``forwarded_env`` expands the prefixes into the names set in an environment (the job scripts
# do the same in bash, from these same lists).
FORWARDED_ENV = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
FORWARDED_PREFIXES = ("MPSYNC_", "HOROVOD_", "NCCL_")

# An oversubscribed rank that busy-polls for a message steals the core from the rank that would
# send it; yielding keeps 2-core runs fast and fair.  (Also given to horovodrun's mpirun.)
YIELD_WHEN_IDLE = ("--mca", "mpi_yield_when_idle", "1")


def forwarded_env(environ=None) -> tuple[str, ...]:
    """Names to pass with ``-x``: those of ``FORWARDED_ENV`` that are set, then every variable
    with a ``FORWARDED_PREFIXES`` prefix (``-x`` of an unset name is an error in Open MPI)."""
    environ = os.environ if environ is None else environ
    fixed = tuple(k for k in FORWARDED_ENV if k in environ)
    extra = sorted(k for k in environ if k.startswith(FORWARDED_PREFIXES))
    return fixed + tuple(extra)


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def python_argv(module: str, *args: str, python: str | None = None) -> list[str]:
    """``python -m module args...`` with the interpreter that runs us (the venv's)."""
    return [python or sys.executable, "-m", module, *args]


def mpirun_options(
    *,
    oversubscribe: bool = True,
    allow_run_as_root: bool | None = None,
    hostfile: str | None = None,
    hosts: Sequence[str] = (),
    forward_env: Sequence[str] = (),
    output_dir: str | None = None,
    tag_output: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """The options of an Open MPI ``mpirun`` (what goes between ``-np N`` and the command).

    - ``--bind-to none``: ranks of a data-parallel job are few and multi-threaded (torch); Open
      MPI's default core binding would pin several ranks onto one core when oversubscribed.
    - ``YIELD_WHEN_IDLE`` (see there).
    - ``allow_run_as_root`` defaults to "only when we are root" (Open MPI refuses root otherwise).
    - ``hosts``: ``--host a:2,b:2``; ``extra``: any further options (placement, agents), last,
      so they can override the ones above.
    """
    argv = ["--bind-to", "none", *YIELD_WHEN_IDLE]
    if tag_output:
        argv.append("--tag-output")
    if allow_run_as_root is None:
        allow_run_as_root = is_root()
    if allow_run_as_root:
        argv.append("--allow-run-as-root")
    if oversubscribe:
        argv.append("--oversubscribe")
    if hostfile:
        argv += ["--hostfile", hostfile]
    if hosts:
        argv += ["--host", ",".join(hosts)]
    for name in forward_env:
        argv += ["-x", name]
    if output_dir:
        argv += ["--output-filename", output_dir]
    return argv + list(extra)


def mpirun_argv(nprocs: int, command: Sequence[str], *, mpirun: str = "mpirun",
                **options) -> list[str]:
    """Return the argv of an Open MPI ``mpirun`` that starts ``command`` on ``nprocs`` ranks;
    ``options`` are those of :func:`mpirun_options`."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if not command:
        raise ValueError("command must not be empty")
    return [mpirun, "-np", str(nprocs), *mpirun_options(**options), *command]


# The job scripts' launch (Slurm, PBS): the fixed options are mpirun_options' (the same builder
# as mpsync compare, the benchmarks and the tests); root, the hostfile and the forwarded names
# are known only when the job runs, so the script adds them, from the same lists.
MPIRUN_LAUNCH = """
# Ranks are placed by slot: rank 0 (the dedicated server) is the first task of the first node.
launch=(mpirun -np "$NP" """ + shlex.join(mpirun_options(
    oversubscribe=False, allow_run_as_root=False, tag_output=True)) + """ "${tuning[@]}")
[ "$(id -u)" != 0 ] || launch+=(--allow-run-as-root)  # Open MPI refuses root without it
[ -z "$HOSTFILE" ] || launch+=(--hostfile "$HOSTFILE")
# Open MPI passes no environment to remote nodes unless named with -x (names, not patterns).
for name in """ + " ".join(FORWARDED_ENV) + """ \\
            $(compgen -e | grep -E '^(""" + "|".join(p.rstrip("_") for p in FORWARDED_PREFIXES) + """)_' || true); do
  [ -z "${!name+set}" ] || launch+=(-x "$name")
done
read -r -a more <<<"$MPIRUN_ARGS"
launch+=("${more[@]}")
command=("${launch[@]}" "${train[@]}")
"""


def script_variables(template: str, s: JobSettings) -> list[Variable]:
    """The settings of a script whose ranks MPIRUN_LAUNCH starts."""
    if template != "train":
        return []
    return [("MPIRUN_ARGS", "", "more mpirun options, e.g. \"--map-by ppr:4:node\"")]


TARGET = LaunchTarget(name="mpirun", description="Open MPI's mpirun on this machine",
                      argv=mpirun_argv)


@dataclass
class LaunchResult:
    argv: list[str]
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    elapsed: float
    timed_out: bool = False
    extra: dict = field(default_factory=dict)


def run_with_deadline(argv: list[str], timeout: float, *, env: dict | None = None,
                      cwd: str | None = None, stdin=subprocess.DEVNULL) -> LaunchResult:
    """Run ``argv`` in its own process group; kill the whole group when ``timeout`` passes.

    ``mpirun`` forks one process per rank; killing only ``mpirun`` can leave ranks behind that
    hold the terminal or a port, so the group is killed (SIGTERM, then SIGKILL).
    """
    if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
        raise FileNotFoundError(f"{argv[0]!r} not found on PATH (is Open MPI installed? run `make setup`)")
    env = clean_launch_env(os.environ if env is None else env)
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin,
                            env=env, cwd=cwd, start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return LaunchResult(argv, proc.returncode, out, err, time.monotonic() - start)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return LaunchResult(argv, None, out, err, time.monotonic() - start, timed_out=True)
    except BaseException:
        kill_group(proc)
        raise


# Variables Open MPI / PMIx set in a process that called MPI_Init (as a singleton or as a rank).
# A nested ``mpirun`` that inherits them tries to join that process's runtime and fails at once
# ("exit 1", no output); user settings such as OMPI_MCA_btl are kept.
_RUNTIME_PREFIXES = ("PMIX_", "OMPI_MCA_ess", "OMPI_MCA_orte_", "OMPI_MCA_pmix", "OMPI_APP_CTX",
                     "OMPI_COMM_WORLD", "OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS",
                     "OMPI_NUM_APP_CTX", "OMPI_FILE_LOCATION", "OMPI_MCA_initial_wdir",
                     "ORTE_", "HFI_NO_BACKTRACE", "IPATH_NO_BACKTRACE")


def clean_launch_env(env) -> dict:
    """A copy of ``env`` without the MPI runtime's own variables (see _RUNTIME_PREFIXES).

    Python's ``os.environ`` is passed explicitly even when unchanged: after MPI_Init in this
    process the C environment (what a child inherits by default) holds the singleton's
    variables, which ``os.environ`` does not see.
    """
    return {k: v for k, v in env.items() if not k.startswith(_RUNTIME_PREFIXES)}


def kill_group(proc: subprocess.Popen, term_grace: float = 2.0) -> None:
    """SIGTERM to ``proc``'s process group (mpirun stops its ranks), SIGKILL after
    ``term_grace`` seconds."""
    for sig, grace in ((signal.SIGTERM, term_grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
