"""The GPU check (``make gpu-check``) runs here as far as a machine without a GPU allows: with
DEVICE=cpu every benchmark step on CPU tensors (a ResNet of width 4, 4 steps), and without a
device the plain command says so in one line.

Run time: about 2-3 minutes on a loaded 2-core machine (eight short mpirun jobs); the device
tests of step 1 are left out here, the suite runs them itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from mpi_harness import REPO

CHECK = REPO / ".ci" / "gpu_check.py"
pytestmark = pytest.mark.mpi


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(CHECK), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the plain "
                                                      "command runs the whole check instead")
def test_without_a_gpu_the_plain_check_says_so_in_one_line_and_exits_0():
    res = _run()
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "DEVICE=cpu" in lines[0]


def test_every_step_of_the_benchmark_runs_on_cpu_tensors(tmp_path):
    res = _run("--device", "cpu", "--no-device-tests", "--timeout", "180",
               "--trace-dir", str(tmp_path))
    out = res.stdout
    assert res.returncode == 0, out[-6000:] + res.stderr[-3000:]
    table = [line for line in out.splitlines() if line.startswith("| ")]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table[1:]}
    assert "| ok |" in rows["plain PyTorch, 1 process"]
    assert re.search(r"\| ok \| [\d,]+ \| \d+\.\d\dx \|", rows["mpsync BSP, 1 rank (overhead)"])
    for name in [f"2 ranks, {p} (ring, mpi)" for p in ("bsp", "ebsp", "esync", "osp")] + \
            ["2 ranks, asp (ps)"]:
        row = rows[name]
        assert "| ok |" in row and "weights equal on both ranks" in row, row
        assert re.search(r"\| [\d,]+ \| \d+\.\d\dx \|", row), row
    # Host tensors: nothing is staged, whatever the number of buckets.
    assert re.search(r"staged 0\.0 for [2-9]\d* bucket", rows["2 ranks, bsp (ring, mpi)"])
    assert "| ok |" in rows["gloo smoke, 1 rank"]
    # The ordering, not a timing: a bucket started before backward's end.
    overlap = rows["trace: allreduce before backward ends"]
    assert "| ok |" in overlap and re.search(r"\[0, .*'end'", overlap), overlap
    assert list(tmp_path.glob("gpu-check-bsp-ring-mpi.json"))
