"""``python -m mpsync.bench NAME ...`` and ``mpsync bench NAME ...``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from mpsync.bench import BENCHMARKS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="NAME", required=True)
    for name, (module, help_) in BENCHMARKS.items():
        if importlib.util.find_spec(module) is None:
            continue  # a benchmark whose module is not installed in this build
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_bench_module=module)
        # Benchmark modules keep mpi4py/torch/horovod imports inside run(), so configuring
        # all of them here is cheap and cannot fail on a partly broken install.
        importlib.import_module(module).add_arguments(p)


def main(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).run(args) or 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m mpsync.bench")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
