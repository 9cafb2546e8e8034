"""The GPU check (``make gpu-check``) runs here as far as a machine without a GPU allows: with
DEVICE=cpu every step on CPU tensors, and without a device the plain command says so in one line.

Run time: about 60-90 s (the device tests, three 2-rank runs of the example, plain PyTorch).
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


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
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


def test_every_step_of_the_check_runs_on_cpu_tensors():
    res = _run("--device", "cpu", "--epochs", "3", "--timeout", "180")
    out = res.stdout
    assert res.returncode == 0, out[-6000:] + res.stderr[-3000:]
    table = [line for line in out.splitlines() if line.startswith("| ")]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table[1:]}
    assert re.search(r"device tests \(pytest -m gpu\) \| ok \|.*\d+ passed", out), out[-4000:]
    for policy in ("bsp", "ebsp", "esync"):
        row = rows[f"example, 2 ranks, {policy} (ring, mpi)"]
        assert "| ok |" in row and "weights equal on both ranks" in row, row
        assert re.search(r"\| [\d,]+ \| \d+\.\d\dx \|", row), row
    assert "| plain PyTorch, 1 process | ok |" in out
