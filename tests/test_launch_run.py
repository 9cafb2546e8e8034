"""``mpsync run`` / ``mpsync train --np N`` start their own mpirun (real Open MPI), under a hard
timeout that kills the whole process group; a rank killed from outside ends the job with one
mpsync block that names it."""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import pytest

from mpsync.launch import run_with_deadline

pytestmark = pytest.mark.mpi

REPO = Path(__file__).resolve().parent.parent

# A user's script: mpi4py only, so the test measures the launcher, not torch's start-up.
SCRIPT = r"""
import os, signal, sys
from mpi4py import MPI
world = MPI.COMM_WORLD
# one write per line: unbuffered, print's text and newline would be two, interleaved by mpirun
sys.stdout.write(f"RANK {world.Get_rank()} OF {world.Get_size()} "
                 f"SERVER={os.environ.get('MPSYNC_SERVER')}\n")
sys.stdout.flush()
world.Barrier()
if len(sys.argv) > 1 and world.Get_rank() == int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
world.Barrier()
"""


def mpsync(*args, cwd, timeout=90):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("MPSYNC_DEBUG", None)
    return run_with_deadline([sys.executable, "-m", "mpsync.cli", *args], timeout, env=env,
                             cwd=str(cwd))


def test_mpsync_run_starts_the_workers_and_the_server_rank(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    res = mpsync("run", "--np", "2", "python", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = sorted(re.findall(r"^RANK .*$", res.stdout, flags=re.M))
    assert lines == [f"RANK {r} OF 3 SERVER=dedicated" for r in range(3)], res.stdout
    assert res.stderr == "", res.stderr


def test_a_worker_killed_with_sigkill_is_named_in_one_block(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    res = mpsync("run", "--np", "2", "--server", "colocated", "train.py", "1", cwd=tmp_path)
    assert res.returncode == 137, res.stderr
    blocks = re.findall(r"^mpsync run: the job failed: .*$", res.stderr, flags=re.M)
    assert blocks == [f"mpsync run: the job failed: rank 1 (worker 1) on "
                      f"{socket.gethostname()} was killed by signal 9 (Killed), "
                      + blocks[0].rsplit(", ", 1)[1]], res.stderr
    assert "mpirun noticed" not in res.stderr and "-----" not in res.stderr, res.stderr


def test_mpsync_train_np_runs_from_any_directory_and_prints_its_summary(tmp_path):
    # --deadline: a loaded CI machine can take longer than the default to start the server
    res = mpsync("train", "--np", "2", "--time-budget", "3", "--no-progress", "--deadline", "60",
                 cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr
    assert "final accuracy" in res.stdout + res.stderr
    assert not any(tmp_path.iterdir())   # nothing written without --out


# Every policy on each topology it runs on: the fault is noticed by the topology's own machinery
# (the state server's silence check on the ring; on the PS the server lets the others go on and
# the end-of-run gather's deadline names the worker), and each policy waits in its own places.
@pytest.mark.parametrize("policy, topology", [
    ("bsp", "ring"), ("ebsp", "ring"), ("esync", "ring"), ("osp", "ring"), ("auto", "ring"),
    ("bsp", "ps"), ("asp", "ps"), ("ssp", "ps"), ("dssp", "ps"), ("ebsp", "ps"),
    ("esync", "ps"),
])
def test_a_stopped_worker_ends_the_job_with_one_block_naming_it(policy, topology, tmp_path):
    res = mpsync("train", "--np", "2", "--policy", policy, "--topology", topology,
                 "--time-budget", "5", "--no-progress", "--stop-at-step", "10",
                 "--silent-timeout", "5", "--deadline", "30", cwd=tmp_path, timeout=400)
    assert res.returncode not in (0, None), res.stderr
    blocks = re.findall(r"^mpsync train: the job failed: .*$", res.stderr, flags=re.M)
    assert len(blocks) == 1 and blocks[0].startswith(
        f"mpsync train: the job failed: rank 2 (worker 1) on {socket.gethostname()} went "
        f"silent"), res.stderr
    assert "Traceback" not in res.stderr and "-----" not in res.stderr, res.stderr
