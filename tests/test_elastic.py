"""Jobs that survive a lost worker, with real ranks: a worker SIGKILLed in the middle of
``mpsync train --max-restarts 1`` (bsp, ssp, esync) and of a Horovod elastic script run with
``import mpsync.torch as hvd``; the job restarts on the remaining workers without anyone's help
and ends its run.  Under bsp on the ring the restarted run's final model equals bitwise that of
a run resumed by hand from the same checkpoint on the same workers.

Run time: 60-240 s per restarting run on this 2-core machine at load 30-45 (other jobs).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mpi_harness import REPO, TESTS_DIR, run_mpi
from mpsync.commits import newest_complete

pytestmark = pytest.mark.mpi

TRAIN = str(REPO / "mpsync" / "apps" / "train.py")
ELASTIC_SCRIPT = TESTS_DIR / "horovod_scripts" / "pytorch_digits_elastic.py"
DIGITS = REPO / "mpsync" / "data" / "digits.npz"


def test_commit_store_uses_a_commit_only_when_every_rank_wrote_it(tmp_path):
    run = run_mpi("elastic_programs:commit_store", np=3, args=[tmp_path], timeout=90)
    assert run.results()[0]["kept"] == ["commit-000000002", "commit-000000003",
                                        "commit-000000004"]


def test_elastic_run_refuses_a_crafted_commit_and_runs_nothing(tmp_path):
    from test_checkpoint import crafted_checkpoint

    marker = tmp_path / "ran"
    commit = tmp_path / "commits" / "commit-000000003"
    crafted_checkpoint(commit / "rank-00000.pt", marker)
    (commit / "MANIFEST.json").write_text(json.dumps(
        {"seq": 3, "size": 2, "info": {"seq": 3},
         "files": {str(r): {"name": f"rank-{r:05d}.pt"} for r in range(2)}}))
    run = run_mpi("elastic_programs:refused_commit", np=2, args=[tmp_path / "commits"],
                  timeout=90, check=False)
    assert run.returncode == 2, run.report()      # the launcher's no-restart status
    # What the user sees: worker 0's one line (world rank 0 serves the job's state).
    line = f"mpsync elastic: error: commit {commit / 'rank-00000.pt'}: refused"
    assert line in run.stderr and "Traceback" not in run.stderr, run.report()
    assert "TRAINING" not in run.stdout, run.report()
    assert not marker.exists(), "loading the crafted commit ran its command"


def _env(tag: str) -> dict:
    # A generous deadline: a loaded machine can take more than the default 20 s from start to
    # the first registration, which would end the job before the fault under test.
    env = dict(os.environ, MPSYNC_TEST_TAG=tag, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MPSYNC_DEADLINE="90")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _pid_of_rank(tag: str, rank: int) -> int | None:
    """The process of world rank ``rank`` of the job started with MPSYNC_TEST_TAG=tag."""
    want = {f"MPSYNC_TEST_TAG={tag}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = set((d / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env:
            return int(d.name)
    return None


def _kill_when(proc, ready, tag: str, rank: int, timeout: float) -> None:
    """SIGKILL world rank ``rank`` once ``ready()`` holds (the job must still be running)."""
    end = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the job ended before the fault could be injected"
        assert time.monotonic() < end, "no commit within the time allowed"
        time.sleep(0.1)
    pid = _pid_of_rank(tag, rank)
    assert pid is not None, f"world rank {rank} not found"
    os.kill(pid, signal.SIGKILL)


def _supervised(argv, ready, tmp_path, timeout=300, kill_rank=2):
    tag = uuid.uuid4().hex
    log = tmp_path / "supervisor.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=_env(tag), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            _kill_when(proc, ready, tag, kill_rank, timeout / 2)
            rc = proc.wait(timeout=timeout)
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    return rc, log.read_text()


@pytest.mark.slow
def test_horovod_elastic_script_survives_a_killed_worker(tmp_path):
    text = ELASTIC_SCRIPT.read_text()
    assert text.count("import horovod.torch as hvd") == 1
    script = tmp_path / "pytorch_digits_elastic_mpsync.py"
    script.write_text(text.replace("import horovod.torch as hvd", "import mpsync.torch as hvd"))
    commits = tmp_path / "commits"
    argv = [sys.executable, "-m", "mpsync.cli", "run", "--np", "3", "--min-np", "2",
            "--max-restarts", "1", "--commit-dir", str(commits), sys.executable, str(script),
            "--data", str(DIGITS), "--epochs", "4", "--batch-sleep", "0.05"]

    def ready():   # past the first epoch (four commits an epoch)
        m = newest_complete(commits)
        return m is not None and m.seq >= 5
    rc, out = _supervised(argv, ready, tmp_path)
    assert rc == 0, out[-6000:]
    assert "RESET size 2" in out, out[-6000:]
    finals = [line for line in out.splitlines() if line.startswith("FINAL")]
    assert len(finals) == 2 and all("size=2 epoch=4" in f for f in finals), out[-6000:]
    assert len({f.split("digest=")[1].split()[0] for f in finals}) == 1
    record = json.loads((commits / "restarts.json").read_text())
    assert [a["np"] for a in record] == [3, 2]
    assert record[0]["failure"]["rank"] == 2 and "signal 9" in record[0]["failure"]["cause"]
    accuracy = float(finals[0].split("accuracy=")[1])
    assert accuracy > 0.7, out[-3000:]


def _train(out, policy, *flags):
    return [sys.executable, "-m", "mpsync.cli", "train", "--policy", policy, "--batch-size",
            "16", "--seed", "5", "--out", str(out), "--no-progress", "--no-plots",
            "--deadline", "90", *flags]


def _checkpointed(out, at_least_round):
    def ready():
        ckpts = sorted((out / "checkpoints").glob("ckpt-*.mpsck"))
        return bool(ckpts) and int(ckpts[-1].name[5:14]) >= at_least_round
    return ready


@pytest.mark.slow
def test_bsp_restart_equals_a_resume_by_hand(tmp_path):
    """A fixed number of steps on the ring: the supervised restart on the two remaining
    workers computes bitwise what a resume by hand from the same checkpoint computes."""
    out, by_hand = tmp_path / "run", tmp_path / "by-hand"
    common = ["--backend", "mpi", "--epochs", "1.5", "--checkpoint-every", "5"]
    rc, log = _supervised(_train(out, "bsp", "--np", "3", "--max-restarts", "1", *common),
                          _checkpointed(out, 5), tmp_path)
    assert rc == 0, log[-6000:]
    metrics = json.loads((out / "metrics.json").read_text())
    [restart] = metrics["restarts"]
    assert restart["workers_before"] == 3 and restart["workers_after"] == 2
    assert restart["failure"]["rank"] == 2 and "signal 9" in restart["failure"]["cause"]
    assert restart["resumed_from"]["round"] >= 5 and restart["restart_s"] > 0
    assert metrics["config"]["workers"] == 2 and metrics["config"]["resumed"] is True
    start = out / "restarts" / "restart-1"
    run_mpi(TRAIN, np=3, timeout=240, args=[
        "--policy", "bsp", "--batch-size", "16", "--seed", "5", "--out", str(by_hand),
        "--no-progress", "--no-plots", "--deadline", "90", *common, "--resume", str(start)])
    manual = json.loads((by_hand / "metrics.json").read_text())
    assert manual["final_param_sha256"] == metrics["final_param_sha256"]
    assert manual["total_samples"] == metrics["total_samples"]


@pytest.mark.slow
@pytest.mark.parametrize("policy, target, flags", [
    # Parameter server: the shards from the checkpoint.  SSP's full updates on the PS at lr 0.05
    # with momentum 0.9 swing (each worker's momentum carries the other's deltas): over 3.5 s
    # its evaluations after the restart hovered between 0.58 and 0.94 (CI on 4420cfb, 3 epochs:
    # 0.71, then 0.62, never 0.85); 18 runs here first passed 0.8 at 0.4-1.7 s of 2.2-3.8 s.
    ("ssp", 0.8, ["--staleness", "2"]),
    ("esync", 0.85, []),                 # ring, time-driven rounds
])
def test_time_driven_policies_restart_and_reach_the_target(tmp_path, policy, target, flags):
    out = tmp_path / "run"
    rc, log = _supervised(_train(out, policy, "--np", "3", "--max-restarts", "1",
                                 "--epochs", "10", "--checkpoint-every", "4",
                                 "--target-acc", str(target), "--eval-every", "0.25", *flags),
                          _checkpointed(out, 8), tmp_path)
    assert rc == 0, log[-6000:]
    metrics = json.loads((out / "metrics.json").read_text())
    [restart] = metrics["restarts"]
    ckpt = restart["resumed_from"]
    assert ckpt["round"] >= 8 and ckpt["workers"] == 3
    # The evaluations go on from the committed wall time: none lost before the checkpoint.
    walls = [e["wall_s"] for e in metrics["evals"]]
    assert walls == sorted(walls) and walls[-1] > ckpt["wall_s"]
    # The restarted run reaches the target after the checkpoint (the run before it may have
    # too, if the kill came late).  Its final accuracy is not asserted: where SSP's swings
    # leave it at the end says nothing of the restart.
    reached = [e for e in metrics["evals"] if e["accuracy"] >= target]
    assert any(e["wall_s"] > ckpt["wall_s"] for e in reached), (metrics["evals"], log[-3000:])
    assert metrics["time_to_target_s"] == pytest.approx(reached[0]["wall_s"])
    # The evaluation that reached it after the restart is below chance's loss (2.30); the
    # final one is only finite: SSP's swings can end the run above it (2.58 once in CI).
    after = [e for e in reached if e["wall_s"] > ckpt["wall_s"]]
    assert 0.0 < after[0]["loss"] < 2.3, after[0]
    assert math.isfinite(metrics["final_loss"]), metrics["final_loss"]
