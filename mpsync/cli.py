"""The ``mpsync`` command: one entry point, subcommands registered by module name.

Subcommand modules are imported only when used, so ``mpsync doctor`` works even when torch or
Horovod are broken, and ``mpsync --help`` is instant.  Each module exposes
``add_arguments(parser)`` and ``main(args) -> int``.

Errors: a user's mistake (a bad flag, setting, path or combination) is one line, ``mpsync
COMMAND: error: ...``, and exit status 2; anything else is a bug in mpsync and keeps its
traceback, followed by a line that says so.  ``--debug`` (or ``MPSYNC_DEBUG=1``, which every
rank inherits) shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from mpsync import __version__
from mpsync.bench import BENCHMARKS
from mpsync.job_end import USER_ERRORS, end_job, end_job_for, is_user_error, rank_label, \
    running_world

__all__ = ["main", "SUBCOMMANDS", "USER_ERRORS", "is_user_error", "OneLineParser"]

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mpsync.apps.train", "train a model under one synchronization policy "
                                   "(--np N starts N workers here; or run under mpirun)"),
    "run": ("mpsync.launch.command", "start your training script on N workers and the state "
                                     "server: mpsync run --np 4 python train.py"),
    "compare": ("mpsync.apps.compare", "run every policy and compare time-to-accuracy"),
    "simulate": ("mpsync.apps.simulate", "simulate the policies on a virtual cluster of N workers"),
    "advise": ("mpsync.apps.advise", "rank the policies for a cluster before a long job: from a "
                                     "run's metrics.json or stated speeds and link"),
    "bench": ("mpsync.bench.__main__", "benchmarks: " + ", ".join(BENCHMARKS)),
    "jobs": ("mpsync.launch.jobs", "render Slurm / PBS / horovodrun job scripts"),
    "cluster": ("mpsync.cluster.cli", "a virtual cluster of network-namespace nodes on this "
                                      "machine (root)"),
    "doctor": ("mpsync.doctor", "check the installation: versions, MPI, Numba, Horovod build"),
}

class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line naming it and where the flags are listed (not the whole usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already or has none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.help is argparse.SUPPRESS or "default" in text.lower() or \
                action.default is None or action.default is False or \
                action.default in ("", argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default {action.default})".strip()


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = OneLineParser(
        prog="mpsync",
        description="Decide when data-parallel workers synchronize: BSP, ASP, SSP, DSSP, "
                    "ElasticBSP (ZipLine), ESync, OSP over MPI.")
    parser.add_argument("--version", action="version", version=f"mpsync {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of every error, on every rank (as "
                             "MPSYNC_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=DefaultsFormatter)
        if name == chosen:  # import only the module that will run
            importlib.import_module(module).add_arguments(p)
    return parser, chosen


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, chosen = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.debug:
        os.environ["MPSYNC_DEBUG"] = "1"   # inherited by the ranks mpsync starts
    prog = f"mpsync {args.command}"
    try:
        module = importlib.import_module(SUBCOMMANDS[args.command][0])
        code = int(module.main(args) or 0)
    except Exception as e:  # noqa: BLE001 - sorted into user error / bug just below
        if in_running_job():
            # One rank of several: its error ends every rank, said in one line unless a bug.
            end_job_for(e, rank_label(), prog=prog)
        code = report_error(prog, e)
    if code and in_running_job():
        end_job(code)   # not returning: MPI_Finalize would wait for the ranks still running
    return code


def in_running_job() -> bool:
    """This process is one rank of several, with MPI started.  Its failure must end the job
    at once: returning would run the exit handlers, MPI_Finalize among them, which waits for
    every other rank, some of them waiting for this one.  (Before MPI starts, a non-zero
    exit status is enough: Open MPI ends a job on one.)"""
    world = running_world()
    return world is not None and world.Get_size() > 1


def report_error(prog: str, exc: BaseException) -> int:
    """Print ``exc`` as a user error (one line, 2) or as a bug (traceback and a line, 1)."""
    from mpsync.config import print_user_error

    if is_user_error(exc):
        print_user_error(prog, exc)
        return 2
    traceback.print_exception(exc)
    print(f"{prog}: internal error: {type(exc).__name__} is a bug in mpsync, not in your "
          f"settings; please report it with the traceback above", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
