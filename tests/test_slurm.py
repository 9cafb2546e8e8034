"""The Slurm job templates submitted to a real single-node Slurm cluster on this machine.

The fixture runs ``.ci/slurm.sh start`` (installs slurm-wlm + munge from Debian's packages when
absent, starts munged, slurmctld and slurmd with a private configuration, waits for the node to
be idle) and at the end stops only the daemons it started.  Each test ``sbatch``es a script,
waits for the job with a deadline (``scancel`` at expiry), reads its final state from
``scontrol show job`` (there is no accounting database, so ``sacct`` has no data) and checks
what the job wrote beside its log.

The only skip: the machine cannot run Slurm (not root and Slurm not usable); the reason is
printed.  Any other failure to start the cluster fails the tests with the daemons' logs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_harness import tagged_pids

REPO = Path(__file__).resolve().parent.parent
SLURM_SH = REPO / ".ci" / "slurm.sh"
JOBS = REPO / "jobs" / "slurm"
START_TIMEOUT = 900   # includes apt-get install on a fresh machine
JOB_TIMEOUT = 300     # one tiny job on 2 shared cores
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]


def _slurm_dir() -> Path:
    return Path(os.environ.get("MPSYNC_SLURM_DIR", "/var/lib/mpsync-slurm"))


def _logs() -> str:
    out = []
    for name in ("slurmctld.log", "slurmd.log", "munged.log"):
        path = _slurm_dir() / "log" / name
        if path.exists():
            out.append(f"--- {path} (tail) ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
    return "\n".join(out)


@pytest.fixture(scope="module")
def slurm_env():
    """Environment for sbatch/scontrol against the test cluster; starts it if needed."""
    try:
        res = subprocess.run(["bash", str(SLURM_SH), "start"], capture_output=True, text=True,
                             timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f".ci/slurm.sh start did not finish in {START_TIMEOUT}s:\n{e.stderr}\n{_logs()}")
    if res.returncode == 3:
        pytest.skip(f"this machine cannot run Slurm: {res.stderr.strip()}")
    if res.returncode != 0:
        pytest.fail(f".ci/slurm.sh start failed (exit {res.returncode}):\n{res.stderr}\n{_logs()}")
    started = re.search(r"^MPSYNC_SLURM_STARTED=(.*)$", res.stdout, re.M)
    assert started, f"no MPSYNC_SLURM_STARTED line in: {res.stdout!r}"
    daemons = [d for d in started.group(1).split(",") if d]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MPSYNC_", "OMPI_", "PMIX_", "PBS_"))}
    env.update(SLURM_CONF=str(_slurm_dir() / "etc" / "slurm.conf"), OMP_NUM_THREADS="1")
    yield env
    if daemons:  # leave a cluster that was already running (e.g. by `make slurm`) alone
        subprocess.run(["bash", str(SLURM_SH), "stop", *daemons], timeout=120, check=False)


def job_state(env: dict, job_id: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                         text=True, env=env, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def submit_and_wait(env: dict, script: Path, workdir: Path, sbatch_args=(), **variables) -> tuple[str, dict]:
    """sbatch ``script`` from ``workdir`` with ``variables`` in its environment; wait until the
    job ends (scancel and fail at JOB_TIMEOUT); return (job id, scontrol record)."""
    job_env = dict(env, **variables)
    res = subprocess.run(["sbatch", "--parsable", *sbatch_args, str(script)], cwd=workdir,
                         env=job_env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    job_id = res.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    while time.monotonic() < deadline:
        record = job_state(env, job_id)
        if record.get("JobState") in TERMINAL:
            return job_id, record
        time.sleep(1.0)
    subprocess.run(["scancel", job_id], env=env, timeout=30)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in workdir.glob("*.out"))
    pytest.fail(f"job {job_id} ({script.name}) not finished after {JOB_TIMEOUT}s; cancelled.\n"
                f"state: {job_state(env, job_id)}\njob log:\n{logs}\n{_logs()}")


def job_log(workdir: Path, prefix: str, job_id: str) -> str:
    path = workdir / f"{prefix}-{job_id}.out"
    assert path.exists(), f"no job log {path}: {sorted(p.name for p in workdir.iterdir())}"
    return path.read_text(errors="replace")


def assert_completed(record: dict, log: str) -> None:
    assert (record.get("JobState"), record.get("ExitCode")) == ("COMPLETED", "0:0"), (
        f"job state {record.get('JobState')} exit {record.get('ExitCode')}\njob log:\n{log[-6000:]}")


def run_template(env: dict, name: str, workdir: Path, sbatch_args=(), **variables):
    """Submit ``jobs/slurm/<name>.sbatch``, wait, check it completed; returns the job's log and
    its run folder (``mpsync-<name>-<jobid>`` beside the log)."""
    job_id, record = submit_and_wait(env, JOBS / f"{name}.sbatch", workdir, sbatch_args,
                                     **variables)
    log = job_log(workdir, f"mpsync-{name}", job_id)
    assert_completed(record, log)
    return log, workdir / f"mpsync-{name}-{job_id}"


def test_cluster_runs_an_mpirun_job_across_its_tasks(slurm_env, tmp_path):
    script = tmp_path / "hello.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --output=hello-%j.out\n"
        "mpirun --allow-run-as-root -np \"$SLURM_NTASKS\" --bind-to none "
        f"{sys.executable} -c 'from mpi4py import MPI; c = MPI.COMM_WORLD; "
        "r = c.gather(c.Get_rank()); c.Get_rank() or print(\"ranks\", r)'\n")
    job_id, record = submit_and_wait(slurm_env, script, tmp_path, ("--ntasks=3",))
    log = job_log(tmp_path, "hello", job_id)
    assert_completed(record, log)
    assert "ranks [0, 1, 2]" in log, log


def test_bench_kernels_job_writes_csv_and_plot_beside_its_log(slurm_env, tmp_path):
    _, out_dir = run_template(
        slurm_env, "bench-kernels", tmp_path,
        BENCH_SIZES="4,10", BENCH_RS="15", BENCH_SAMPLES="3",
        BENCH_ARGS="--no-startup --miss-trials 5 --max-call-s 0.5")
    rows = (out_dir / "zipline.csv").read_text().splitlines()
    assert len(rows) >= 3, rows  # header + n=4 + n=10
    assert (out_dir / "zipline.png").stat().st_size > 1000
    assert (out_dir / "command.sh").read_text().split()[1:4] == ["-m", "mpsync.bench", "zipline"]


def test_compare_job_builds_its_command_from_the_allocation(slurm_env, tmp_path):
    # DRY_RUN: the comparison itself (every policy trained in turn) is too long for the suite.
    log, out_dir = run_template(
        slurm_env, "compare", tmp_path, ("--ntasks-per-node=4",), DRY_RUN="1",
        POLICIES="bsp,esync", SLOWDOWN="1,1,3")
    line = next(x for x in log.splitlines() if " compare --np " in x)
    assert f"{REPO}/.venv/bin/python -m mpsync.cli compare --np 3 --policies bsp\\,esync" in line
    assert f"--out {out_dir} " in line and "--slowdown 1\\,1\\,3" in line
    # No TOPOLOGY: compare runs each policy on its own topology, so none is passed.
    assert "--server dedicated" in line and "--topology" not in line


def test_compare_job_runs_a_policy_and_writes_compare_json(slurm_env, tmp_path):
    # A real comparison, kept tiny: one policy, 3 tasks = the server + 2 workers, 4 s of
    # training.  No SLOWDOWN: the script must not fall back on compare's 4-worker default.
    log, out_dir = run_template(
        slurm_env, "compare", tmp_path, ("--ntasks-per-node=3", "--time=10"),
        POLICIES="bsp", TIME_BUDGET="4", TARGET_ACC="0.3", COMPARE_ARGS="--iter-time 0.005")
    assert (out_dir / "compare.json").exists(), (
        f"no compare.json in {out_dir}; job log:\n{log[-6000:]}")
    result = json.loads((out_dir / "compare.json").read_text())
    assert result["failed"] == [], log[-6000:]
    [row] = result["rows"]
    assert row["policy"] == "bsp" and row["topology"] == "ring"
    assert 0 < row["final_acc"] <= 1 and row["samples_per_s"] > 0
    metrics = json.loads((out_dir / "bsp" / "metrics.json").read_text())
    assert metrics["config"]["workers"] == 2 and metrics["config"]["server"] == "dedicated"
    # --json: compare printed the rows into the job's log.
    printed = json.loads(next(x for x in reversed(log.splitlines()) if x.startswith('{"rows"')))
    assert [r["policy"] for r in printed["rows"]] == ["bsp"]


def test_train_job_runs_the_requested_policy_on_the_requested_workers(slurm_env, tmp_path):
    # 3 tasks = dedicated server + 2 workers.
    log, out_dir = run_template(
        slurm_env, "train", tmp_path, ("--ntasks-per-node=3", "--time=10"),
        POLICY="esync", EPOCHS="1", SLOWDOWN="1,2", DATASET="digits")
    assert (out_dir / "metrics.json").exists(), (
        f"no metrics.json in {out_dir}; job log:\n{log[-6000:]}")
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["config"]["policy"] == "esync"
    assert metrics["config"]["server"] == "dedicated"
    assert metrics["config"]["workers"] == 2
    assert len(metrics["workers"]) == 2
    assert metrics["total_samples"] > 0 and metrics["evals"]
    assert (out_dir / "command.sh").read_text().startswith("mpirun -np 3 ")


@pytest.mark.parametrize("fault, named", [
    ("raises", r"MPSYNC-RANK-FAILED rank 2 \(worker 1\) on \S+: unhandled RuntimeError"),
    ("sigstop", r"mpsync server: worker rank\(s\) \[2\] silent for more than [\d.]+s "
                r"\(no heartbeat"),
])
def test_a_fault_on_a_rank_ends_a_job_started_by_srun(slurm_env, fault, named):
    """Ranks started by ``srun --mpi=pmix`` (Slurm's PMIx, no mpirun): a worker's uncaught
    error, or a worker stopped (SIGSTOP: found by its missing heartbeats), ends the step within
    30 s, non-zero, named in one line, and no rank is left running."""
    tag = f"srun-{fault}-{os.getpid()}"
    env = dict(slurm_env, MPSYNC_TEST_TAG=tag, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    try:
        res = subprocess.run(["srun", "--mpi=pmix", "-n", "4", "--overcommit", "--time=3",
                              sys.executable, str(REPO / "tests" / "torch_programs.py"),
                              f"fail_worker_{fault}", "victim=1"],
                             capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT,
                             cwd="/tmp")
        ended = time.time()
        while tagged_pids(tag) and time.time() - ended < 5:   # slurmstepd reaping its tasks
            time.sleep(0.2)
        left = tagged_pids(tag)
    finally:
        for pid in tagged_pids(tag):
            os.kill(pid, 9)
    text = res.stdout + res.stderr
    assert res.returncode != 0 and not left, (res.returncode, left, text[-4000:])
    [fault_at] = [float(line.split()[1]) for line in res.stdout.splitlines()
                  if line.startswith("FAULT ")]
    assert ended - fault_at <= 30, (ended - fault_at, text[-4000:])
    assert len(re.findall(named, text)) == 1, text[-4000:]
