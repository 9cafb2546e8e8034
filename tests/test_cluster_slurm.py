"""The Slurm job templates on a multi-node Slurm across the virtual cluster.

The fixture builds a 2-node virtual cluster of its own (``mpsync cluster up``: network
namespaces, 1 Gbit/s links), starts munged and slurmctld on the host and one slurmd inside each
node's namespace under the node's hostname (``mpsync cluster slurm up``), and at the end
``mpsync cluster down`` cancels the jobs, stops every daemon and removes the cluster, also when
a test fails; the fixture then checks that no daemon and no namespace is left.  The template is submitted as a
user would submit it to a real cluster (``sbatch -N 2``); Open MPI's ``mpirun`` inside the job
reads the allocation from Slurm and starts its daemon on the second node through ``srun``.

Skips only where the machine cannot do it, with the reason: no network namespaces (not root,
or the kernel forbids them), or Slurm cannot be installed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_slurm import JOBS, assert_completed, job_log, submit_and_wait

REPO = Path(__file__).resolve().parent.parent
CLUSTER_NAME = "slurmtest"

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.cluster]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mpsync(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpsync.cli", "cluster", "--name", CLUSTER_NAME,
                           *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


@pytest.fixture(scope="module")
def cluster_slurm():
    from mpsync import cluster
    from mpsync.cluster import slurm as cs

    ok, why = cluster.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    res = subprocess.run(["bash", str(REPO / ".ci" / "slurm.sh"), "install"],
                         capture_output=True, text=True, timeout=900)
    if res.returncode == 3:
        pytest.skip(f"this machine cannot run Slurm: {res.stderr.strip()}")
    assert res.returncode == 0, f".ci/slurm.sh install failed:\n{res.stderr}"
    directory = cs.directory_of(CLUSTER_NAME)
    pids: dict = {}
    try:
        # As a user would: the commands, not the Python API.
        res = _mpsync("up", "--nodes", "2", "--bandwidth", "1gbit", "--slots", "4")
        assert res.returncode == 0, res.stderr
        # A free port for slurmctld: another Slurm (the single-node one) may run here.
        res = _mpsync("slurm", "up", "--port", str(_free_port()))
        assert res.returncode == 0, res.stdout + res.stderr
        conf = res.stdout.strip().splitlines()[-1]
        assert conf == f"export SLURM_CONF={directory / 'etc' / 'slurm.conf'}", res.stdout
        pids = cs.status(directory)["daemons"]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PBS_"))}
        env = cs.client_env(directory, env)
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        yield env
    finally:
        # `cluster down` stops the cluster's Slurm first; the direct calls are the safety net
        # when the command itself failed.
        res = _mpsync("down")
        cs.stop(directory)
        cluster.down(CLUSTER_NAME)
    assert res.returncode == 0 and "stopped the cluster's Slurm" in res.stdout, (
        res.stdout + res.stderr)
    alive = [f"{name} (pid {pid})" for name, pid in pids.items() if pid and _alive(pid)]
    assert not alive, f"still running after `mpsync cluster down`: {alive}"
    assert not directory.exists()
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout.split()
                if ns.startswith(f"{CLUSTER_NAME}-")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of ours counts as gone.
    stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_cluster_slurm_has_both_nodes_idle_and_srun_reaches_each(cluster_slurm):
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=cluster_slurm,
                         capture_output=True, text=True, timeout=30).stdout
    assert dict(line.split() for line in out.splitlines()) == {"node1": "idle", "node2": "idle"}
    # Each task runs on its node's own network stack under its hostname.
    res = subprocess.run(["srun", "-N", "2", "--ntasks-per-node=1", "--time=1", "sh", "-c",
                          "echo $(hostname) $(ip -4 -o addr show eth0 | awk '{print $4}')"],
                         env=cluster_slurm, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    seen = sorted(res.stdout.split("\n")[:2])
    assert [s.split()[0] for s in seen] == ["node1", "node2"], res.stdout
    assert len({s.split()[1] for s in seen}) == 2, res.stdout


def test_train_template_with_two_nodes_runs_ranks_on_both(cluster_slurm, tmp_path):
    # sbatch -N 2 as on a real cluster: 2 tasks per node = the state server and 3 workers.
    job_id, record = submit_and_wait(
        cluster_slurm, JOBS / "train.sbatch", tmp_path,
        ("-N", "2", "--ntasks-per-node=2", "--time=10"), POLICY="bsp", EPOCHS="1",
        # The first cross-node allreduce (TCP connections, Horovod's start) took 16 s in one
        # run on a loaded machine, past the server's default 10 s for a silent worker.
        TRAIN_ARGS="--silent-timeout 60")
    log = job_log(tmp_path, "mpsync-train", job_id)
    assert_completed(record, log)
    assert record.get("NodeList") == "node[1-2]", record
    metrics = json.loads((tmp_path / f"mpsync-train-{job_id}" / "metrics.json").read_text())
    workers = metrics["workers"]
    assert metrics["config"]["workers"] == 3 and len(workers) == 3
    # The ranks ran on both nodes, and the ring kept every replica identical across the link.
    assert {w["host"] for w in workers.values()} == {"node1", "node2"}, workers
    assert len({w["param_sha256"] for w in workers.values()}) == 1
    assert metrics["total_samples"] > 0
