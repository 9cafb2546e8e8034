"""The ``mpsync`` command: one entry point, subcommands registered by module name.

Subcommand modules are imported only when used, so ``mpsync doctor`` works even when torch or
Horovod are broken, and ``mpsync --help`` is instant.  Each module exposes
``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mpsync import __version__

__all__ = ["main", "SUBCOMMANDS"]

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mpsync.apps.train", "train a model under one synchronization policy (run under mpirun)"),
    "compare": ("mpsync.apps.compare", "run every policy under mpirun and compare time-to-accuracy"),
    "simulate": ("mpsync.apps.simulate", "simulate the policies on a virtual cluster of N workers"),
    "bench": ("mpsync.bench.__main__", "microbenchmarks: zipline, server, allreduce, memory"),
    "jobs": ("mpsync.launch.jobs", "render Slurm / PBS / horovodrun job scripts"),
    "cluster": ("mpsync.cluster.cli", "a virtual cluster of network-namespace nodes on this "
                                      "machine (root)"),
    "doctor": ("mpsync.doctor", "check the installation: versions, MPI, Numba, Horovod build"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = argparse.ArgumentParser(
        prog="mpsync",
        description="Decide when data-parallel workers synchronize: BSP, ASP, SSP, DSSP, "
                    "ElasticBSP (ZipLine), ESync, OSP over MPI.")
    parser.add_argument("--version", action="version", version=f"mpsync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
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
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
