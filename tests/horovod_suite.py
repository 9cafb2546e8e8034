"""Run a Horovod PyTorch test file (Horovod's own ``test/parallel/test_torch.py``, from where
it lives) as Horovod's CI does -- the whole file in one process per rank -- twice in one
go: on real Horovod, and with its import line changed to ``import mpsync.torch as hvd``
(a temporary copy, removed afterwards), 2 ranks, ``MPSYNC_SERVER=colocated``, bsp on the
ring.  Prints each run's outcome per test and how many of the tests Horovod passes mpsync
passes too::

    python tests/horovod_suite.py /path/to/horovod/test/parallel/test_torch.py [--np 2]

The file's own helpers (``test/utils/common.py``) are found beside it as Horovod lays them
out.  Nothing of Horovod's is kept in this repository.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mpsync.launch import mpirun_argv, run_with_deadline  # noqa: E402

HOROVOD_IMPORT = "import horovod.torch as hvd"


def outcomes(report_dir: Path) -> dict[str, str]:
    """test name -> passed | failed | skipped, over every rank's junit report (a test
    passes only if it passed on every rank)."""
    worst = {"passed": 0, "skipped": 1, "failed": 2}
    out: dict[str, str] = {}
    for xml in sorted(report_dir.glob("rank*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            kids = {c.tag for c in case}
            state = "failed" if kids & {"failure", "error"} else \
                "skipped" if "skipped" in kids else "passed"
            name = case.get("name")
            if worst[state] >= worst[out.get(name, "passed")]:
                out[name] = state
    return out


def run_suite(test_file: Path, source: Path, np: int, timeout: float,
              env_extra: dict) -> dict[str, str]:
    """``test_file`` on ``np`` ranks, with ``source`` (the original's folder) and Horovod's
    ``test/utils`` on the path for its helpers."""
    with tempfile.TemporaryDirectory(prefix="hvd-suite-") as tmp:
        reports = Path(tmp)
        # Each rank writes its own junit report (Open MPI's rank variable names it) and, as
        # it goes, the test it is in and the last one that failed: a run that ends without
        # a report (killed, aborted, timed out) still says where each rank was.
        runner = reports / "rank_pytest.py"
        runner.write_text(
            "import os, sys, pytest\n"
            "rank = os.environ.get('OMPI_COMM_WORLD_RANK', '0')\n"
            f"where = os.path.join({str(reports)!r}, f'rank{{rank}}.where')\n"
            "class Where:\n"
            "    def pytest_runtest_logstart(self, nodeid, location):\n"
            "        open(where, 'a').write('in ' + nodeid + '\\n')\n"
            "    def pytest_runtest_logreport(self, report):\n"
            "        if report.failed:\n"
            "            open(where, 'a').write(report.when + ' failed ' + report.nodeid + '\\n')\n"
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--junitxml',"
            f" os.path.join({str(reports)!r}, f'rank{{rank}}.xml'), {str(test_file)!r}],"
            f" plugins=[Where()]))\n")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_extra)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(source), str(source.parent / "utils"), str(REPO), env.get("PYTHONPATH", "")])
        argv = mpirun_argv(np, [sys.executable, str(runner)],
                           forward_env=tuple(["PYTHONPATH", "OMP_NUM_THREADS",
                                              "PYTHONUNBUFFERED", *env_extra]))
        res = run_with_deadline(argv, timeout, env=env)
        if "MPI_ABORT" in res.stderr or res.timed_out or res.returncode not in (0, 1):
            print(f"  ended abnormally (exit {res.returncode}, timed out: {res.timed_out}): "
                  f"{res.stderr[-2000:]}", file=sys.stderr)
        for r in range(np):
            if not (reports / f"rank{r}.xml").exists():
                print(f"  rank {r} wrote no report; {where(reports, r)}", file=sys.stderr)
        return outcomes(reports)


def where(reports: Path, rank: int) -> str:
    """Where ``rank`` was: the test it started last and the last failures before it."""
    path = reports / f"rank{rank}.where"
    lines = path.read_text().splitlines() if path.exists() else []
    started = [ln[3:] for ln in lines if ln.startswith("in ")]
    failed = [ln for ln in lines if " failed " in ln][-3:]
    return (f"last test started: {started[-1] if started else 'none'}; "
            f"last failures: {failed or 'none'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("test_file", type=Path)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3000.0)
    args = p.parse_args(argv)
    original = args.test_file.resolve()
    text = original.read_text()
    if text.count(HOROVOD_IMPORT) != 1:
        raise SystemExit(f"{original}: expected one line {HOROVOD_IMPORT!r}")
    horovod = run_suite(original, original.parent, args.np, args.timeout, {})
    with tempfile.TemporaryDirectory(prefix="hvd-suite-") as tmp:
        changed = Path(tmp) / original.name
        changed.write_text(text.replace(HOROVOD_IMPORT, "import mpsync.torch as hvd"))
        mine = run_suite(changed, original.parent, args.np, args.timeout,
                         {"MPSYNC_SERVER": "colocated", "MPSYNC_POLICY": "bsp",
                          "MPSYNC_TOPOLOGY": "ring"})
    passed_hvd = [t for t, s in horovod.items() if s == "passed"]
    both = [t for t in passed_hvd if mine.get(t) == "passed"]
    for t in sorted(set(horovod) | set(mine)):
        print(f"{t:60s} horovod={horovod.get(t, '-'):8s} mpsync={mine.get(t, '-')}")
    share = len(both) / len(passed_hvd) if passed_hvd else 0.0
    print(f"SUITE horovod_passed={len(passed_hvd)} mpsync_passed_of_those={len(both)} "
          f"share={share:.3f} mpsync_ran={len(mine)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
