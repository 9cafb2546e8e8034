"""Run code under ``mpirun -np N`` from a pytest test, with a hard timeout.

Usage in a test::

    from mpi_harness import run_mpi

    def test_ring():
        run_mpi("mpi_programs:ring", np=4, timeout=60)        # fails the test on any failure

A *target* is ``"module:function"`` (a module importable from tests/, e.g. ``mpi_programs``,
or any installed module) or a path to a ``.py`` script.  Each rank runs this file as a small
runner: it imports the target, calls it (functions take no arguments; ``sys.argv[1:]`` holds
``args``) and, if it raises, prints the traceback tagged with the rank and calls
``MPI.COMM_WORLD.Abort(1)`` so the other ranks do not wait forever for it.

Each rank's stdout/stderr is captured separately (Open MPI ``--output-filename``).  When a rank
fails or the timeout passes, the test fails with the failing ranks' output; a timeout kills the
whole process group, so no multi-rank test can hang the suite.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
sys.path.insert(0, str(REPO))

from mpsync.launch import mpirun_argv, run_with_deadline  # noqa: E402

__all__ = ["run_mpi", "MPIRun", "MPIFailure"]


class MPIFailure(AssertionError):
    """A multi-rank run failed or timed out; the message holds the failing ranks' output."""


@dataclass
class MPIRun:
    np: int
    target: str
    returncode: int | None
    timed_out: bool
    elapsed: float
    stdout: str
    stderr: str
    ranks: dict[int, dict[str, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0

    def rank_out(self, rank: int) -> str:
        return self.ranks.get(rank, {}).get("stdout", "")

    def results(self) -> dict[int, dict]:
        """The ``RESULT {...}`` line of every rank that printed one, by world rank."""
        out = {}
        for rank in self.ranks:
            for line in self.rank_out(rank).splitlines():
                if line.startswith("RESULT "):
                    out[rank] = json.loads(line[len("RESULT "):])
        return out

    def rank_err(self, rank: int) -> str:
        return self.ranks.get(rank, {}).get("stderr", "")

    def failed_ranks(self) -> list[int]:
        """Ranks that reported an exception, else ranks whose stderr is non-empty."""
        marked = [r for r, o in self.ranks.items() if "MPSYNC-RANK-FAILED" in o.get("stderr", "")]
        if marked:
            return sorted(marked)
        m = re.findall(r"rank (\d+) .*?exited on signal|Process name: \[\[\d+,\d+\],(\d+)\]",
                       self.stderr)
        found = sorted({int(a or b) for a, b in m})
        return found or sorted(r for r, o in self.ranks.items() if o.get("stderr", "").strip())

    def report(self, tail: int = 4000) -> str:
        why = (f"timed out after {self.elapsed:.1f}s" if self.timed_out
               else f"exit code {self.returncode} after {self.elapsed:.1f}s")
        lines = [f"mpirun -np {self.np} {self.target}: {why}"]
        failed = self.failed_ranks()
        shown = failed or sorted(self.ranks)
        if failed:
            lines.append(f"failing rank(s): {failed}")
        for r in shown:
            o = self.ranks[r] if r in self.ranks else {}
            lines.append(f"--- rank {r} stdout ---\n{o.get('stdout', '')[-tail:]}")
            lines.append(f"--- rank {r} stderr ---\n{o.get('stderr', '')[-tail:]}")
        lines.append(f"--- mpirun stderr ---\n{self.stderr[-tail:]}")
        return "\n".join(lines)


def tagged_pids(tag: str) -> list[int]:
    """The processes started with ``MPSYNC_TEST_TAG=tag`` (ranks, mpirun, srun's tasks), this
    one aside: what a test finds still running after its job returned, and kills."""
    want = f"MPSYNC_TEST_TAG={tag}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if want in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def run_mpi(target: str, np: int = 2, *, args: tuple | list = (), timeout: float = 60.0,
            env: dict | None = None, check: bool = True, mpirun_extra: tuple = ()) -> MPIRun:
    """Run ``target`` on ``np`` ranks; with ``check`` raise MPIFailure unless every rank exits 0."""
    if target.endswith(".py"):
        command = [sys.executable, target, *map(str, args)]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--call", target,
                   *map(str, args)]
    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS_DIR), str(REPO), run_env.get("PYTHONPATH", "")) if p)
    run_env.setdefault("PYTHONUNBUFFERED", "1")
    # Each rank is one of several on 2 cores: keep torch/BLAS from starting a thread per core.
    run_env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="mpsync-mpi-") as outdir:
        argv = mpirun_argv(np, command, output_dir=outdir, extra=tuple(mpirun_extra),
                           forward_env=("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED"))
        res = run_with_deadline(argv, timeout, env=run_env)
        ranks = _collect_rank_output(outdir)
    run = MPIRun(np, target, res.returncode, res.timed_out, res.elapsed, res.stdout, res.stderr,
                 ranks)
    if check and not run.ok:
        raise MPIFailure(run.report())
    return run


def _collect_rank_output(outdir: str) -> dict[int, dict[str, str]]:
    ranks: dict[int, dict[str, str]] = {}
    for path in Path(outdir).glob("*/rank.*/std*"):
        rank = int(path.parent.name.split(".", 1)[1])
        ranks.setdefault(rank, {})[path.name] = path.read_text(errors="replace")
    return ranks


def _child_main(argv: list[str]) -> None:
    target = argv[0]
    sys.argv = [target, *argv[1:]]
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    try:
        module, _, func = target.partition(":")
        getattr(importlib.import_module(module), func)()
    except SystemExit as e:
        if e.code not in (None, 0):
            print(f"MPSYNC-RANK-FAILED rank {rank}: SystemExit({e.code})", file=sys.stderr,
                  flush=True)
            MPI.COMM_WORLD.Abort(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        print(f"MPSYNC-RANK-FAILED rank {rank}:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--call":
        _child_main(sys.argv[2:])
    else:
        sys.exit("usage: mpi_harness.py --call module:function [args...]")
