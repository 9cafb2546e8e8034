"""``mpsync run``: start a user's training script on N workers, as ``horovodrun -np N python
train.py`` and ``torchrun --nproc-per-node N train.py`` do, plus the state server's rank::

    mpsync run --np 4 python train.py --epochs 3          # this host
    mpsync run --np 8 -H node1:4,node2:4 python train.py  # two hosts (horovodrun's -H)
    mpsync run --np 8 --hostfile hosts python train.py    # 'host slots=N' lines
    mpsync run --np 8 python train.py                     # inside a Slurm allocation

Also the launch flags of ``mpsync train`` and ``mpsync compare`` (:func:`add_launch_arguments`)
and the step they share: start ``mpirun`` for a job and exit with its outcome
(:func:`launch_and_wait`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

from mpsync.config import DEFAULTS, SERVER_PLACEMENTS, ConfigError, debug_enabled
from mpsync.launch.elastic_run import add_elastic_arguments, run_elastic, wants_elastic
from mpsync.launch.hosts import launched_rank
from mpsync.launch.runner import Job, build_job, run_job
from mpsync.launch.target import LaunchError

__all__ = ["add_arguments", "main", "add_launch_arguments", "launch_and_wait", "job_from_args"]


def add_launch_arguments(g, *, np_help: str, np_default: int | None = None) -> None:
    """``--np``, ``-H/--hosts``, ``--hostfile``, ``--mpirun-args`` (a parser or a group)."""
    g.add_argument("--np", "-np", type=int, default=np_default, metavar="N", help=np_help)
    g.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,..",
                   help="hosts to run on, as horovodrun's -H (default: this host, or the "
                        "Slurm/PBS allocation mpsync runs in)")
    g.add_argument("--hostfile", default=None, metavar="FILE",
                   help="a file of 'host slots=N' lines instead of -H")
    g.add_argument("--mpirun-args", default="", metavar="'ARGS'",
                   help="more mpirun options, last (e.g. \"--mca btl tcp,self\")")


def job_from_args(args, command: list[str], workers: int, dedicated: bool,
                  name: str) -> Job:
    """The job ``args``' launch flags describe (LaunchError for bad hosts or counts)."""
    if shutil.which("mpirun") is None:
        raise LaunchError("mpirun is not on PATH: install Open MPI (apt-get install "
                          "openmpi-bin, or `make setup`), or start the ranks yourself")
    try:
        extra = shlex.split(args.mpirun_args or "")
    except ValueError as e:
        raise LaunchError(f"--mpirun-args {args.mpirun_args!r}: {e}") from None
    return build_job(command, workers, dedicated_server=dedicated, hosts=args.hosts,
                     hostfile=args.hostfile, mpirun_args=extra, name=name)


def launch_and_wait(job: Job, *, timeout: float | None = None) -> int:
    """Run ``job`` (its mpirun line first with ``--debug``), print its block on failure;
    return the exit code."""
    if debug_enabled():
        print(f"{job.name}: starting {job.describe()}: {shlex.join(job.argv)}",
              file=sys.stderr, flush=True)
    return run_job(job, timeout=timeout).exit_code


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_launch_arguments(p, np_help="workers to start (required); the state server's rank "
                                    "is added with --server dedicated")
    p.add_argument("--server", default=None, choices=SERVER_PLACEMENTS,
                   help=f"where the script's state server runs, as its init(server=...) "
                        f"(default: $MPSYNC_SERVER or {DEFAULTS.server}: one more rank)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop the job after S seconds (default: none)")
    add_elastic_arguments(p.add_argument_group("elastic runs (hvd.elastic; restarts)"))
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="PROGRAM ...",
                   help="the program and its arguments, e.g. python train.py --epochs 3")


def main(args) -> int:
    command = list(args.program)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("give the program to run after the flags, e.g. mpsync run --np 4 "
                          "python train.py")
    if launched_rank():
        raise ConfigError("mpsync run starts mpirun itself; under mpirun or srun run the "
                          "script directly")
    if args.np is None:
        raise ConfigError("--np is required: how many workers to start (e.g. --np 4)")
    server = args.server or os.environ.get("MPSYNC_SERVER", DEFAULTS.server)
    if server not in SERVER_PLACEMENTS:
        raise ConfigError(f"MPSYNC_SERVER={server!r} is not one of "
                          f"{', '.join(SERVER_PLACEMENTS)}; unset it or pick one")
    # As torchrun: a script runs with this interpreter (the one mpsync is installed in), and
    # so does a plain "python", which on PATH may be another one without mpsync.
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    elif command[0].endswith(".py"):
        command.insert(0, sys.executable)
    # The ranks' init() takes the placement from the environment, so it matches the rank count.
    os.environ["MPSYNC_SERVER"] = server
    if wants_elastic(args):
        return run_elastic(args, command, server == "dedicated")
    job = job_from_args(args, command, args.np, server == "dedicated", "mpsync run")
    return launch_and_wait(job, timeout=args.timeout)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="mpsync run")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
