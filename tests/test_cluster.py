"""The virtual cluster (``mpsync cluster``) for real: namespaces, links and mpirun across them
(root; skipped with the reason where namespaces are unavailable).  Its layout and command
lines, pure, are in tests/test_cluster_layout.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_harness import run_mpi
from mpsync import cluster

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- real namespaces (root)

AVAILABLE, WHY = cluster.available()
needs_namespaces = pytest.mark.skipif(not AVAILABLE,
                                      reason=f"network namespaces unavailable: {WHY}")
PROGRAMS = str(Path(__file__).resolve().parent / "cluster_programs.py")
FAULT_LIMIT = 30.0  # seconds from a cut link to the end of the job


def _name(tag: str) -> str:
    """A cluster name of this test process (several suites may run at once on one host)."""
    return f"{tag}{os.getpid() % 100000}"


def cli(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    res = subprocess.run([sys.executable, "-m", "mpsync.cli", "cluster", "--name", name, *args],
                         capture_output=True, text=True, env=env, timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(f"mpsync cluster {' '.join(args)}: exit {res.returncode}\n"
                             f"{res.stdout}\n{res.stderr}")
    return res


def leftovers(name: str) -> list[str]:
    """Every kernel object or process of cluster ``name`` still on this host."""
    found = [f"netns {ns}" for ns in
             subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
             .stdout.split() if ns.startswith(f"{name}-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += [f"link {ln.split(':')[1].strip()}" for ln in links.splitlines()
              if f" {name}-" in ln]
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    found += [f"qdisc {ln}" for ln in qdiscs.splitlines() if f"{name}-" in ln]
    if Path(cluster.RUN_ROOT, name).exists():
        found.append(f"state {cluster.RUN_ROOT / name}")
    return found


class Cluster:
    """``mpsync cluster up`` on entry; ``down`` on exit, even when the test failed, then a check
    that nothing of it is left."""

    def __init__(self, tag: str, *up_args: str):
        self.name, self.up_args = _name(tag), up_args

    def __enter__(self):
        cli(self.name, "down", check=False)  # a previous run killed before its cleanup
        cli(self.name, "up", *self.up_args)
        return self

    def __exit__(self, *exc):
        res = cli(self.name, "down", check=False)
        left = leftovers(self.name)
        if exc[0] is None:
            assert res.returncode == 0, res.stderr
            assert not left, left

    def mpirun_args(self, *args: str) -> list[str]:
        return shlex.split(cli(self.name, "mpirun-args", *args).stdout)

    def status(self) -> dict:
        return json.loads(cli(self.name, "status", "--json").stdout)


def hosts_of(run) -> dict[int, str]:
    out = {}
    for r in run.ranks:
        for m in re.finditer(r"^HOST (\d+) (\S+)$", run.rank_out(r), flags=re.M):
            out[int(m.group(1))] = m.group(2)
    return out


@pytest.fixture(scope="module")
def four_nodes():
    if not AVAILABLE:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    with Cluster("acc", "--nodes", "4", "--bandwidth", "1gbit") as c:
        yield c


@needs_namespaces
@pytest.mark.mpi
@pytest.mark.parametrize("policy,topology,backend", [
    ("esync", "ring", "mpi"), ("bsp", "ring", "mpi"), ("ssp", "ps", "mpi"),
    # gloo across nodes whose names resolve nowhere: its rendezvous finds worker 0 by address
    ("bsp", "ring", "gloo")])
def test_a_horovod_style_script_trains_across_four_nodes(four_nodes, policy, topology, backend):
    # Exactly the line a user pastes: mpirun $(mpsync cluster mpirun-args) -np 5 python x.py
    run = run_mpi(PROGRAMS, np=5, args=["train", f"policy={policy}", f"topology={topology}",
                                        f"backend={backend}"],
                  timeout=150, mpirun_extra=four_nodes.mpirun_args())
    hosts = hosts_of(run)
    assert sorted(hosts) == [0, 1, 2, 3, 4], run.report()
    assert len(set(hosts.values())) >= 2, hosts
    assert set(hosts.values()) <= {"node1", "node2", "node3", "node4"}, hosts
    res = run.results()
    assert sorted(res) == [1, 2, 3, 4], run.report()
    if topology == "ring":
        assert all(r["rounds"] == 10 for r in res.values()), res
        if policy == "esync":  # the fast workers took local steps between rounds
            assert res[1]["iterations"] > res[4]["iterations"] >= 10, res
    else:
        assert all(r["iterations"] == 20 for r in res.values()), res
    assert len({r["digest"] for r in res.values()}) == 1, res  # identical parameters


@needs_namespaces
def test_status_link_faults_and_down_leave_nothing_behind():
    with Cluster("st", "--nodes", "2", "--bandwidth", "1gbit", "--slots", "3") as c:
        st = c.status()
        assert [n["name"] for n in st["nodes"]] == ["node1", "node2"]
        for n in st["nodes"]:
            assert n["present"] and n["slots"] == 3
            for end in ("switch_port", "eth0"):
                assert n["link"][end]["tbf_rate_bps"] == 10**9, n
            assert n["link"]["eth0"]["state"] == "UP"
        # Same settings: nothing to do; other settings: refused, saying what differs.
        assert cli(c.name, "up", "--nodes", "2", "--bandwidth", "1gbit", "--slots", "3")\
            .returncode == 0
        other = cli(c.name, "up", "--nodes", "3", check=False)
        assert other.returncode == 1
        assert "nodes: 2 running, 3 asked" in other.stderr
        assert "bandwidth: 1gbit running, unlimited asked" in other.stderr
        cli(c.name, "link", "node2", "--down")
        n2 = c.status()["nodes"][1]
        assert n2["cut"] and not n2["link"]["switch_port"]["admin_up"]
        assert n2["link"]["eth0"]["state"] in ("DOWN", "LOWERLAYERDOWN")  # carrier lost
        cli(c.name, "link", "node2", "--up")
        cli(c.name, "link", "node2", "--bandwidth", "100mbit")
        n2 = c.status()["nodes"][1]
        assert not n2["cut"] and n2["link"]["switch_port"]["admin_up"]
        assert n2["link"]["eth0"]["tbf_rate_bps"] == 10**8
        assert n2["link"]["switch_port"]["tbf_rate_bps"] == 10**8
        cli(c.name, "link", "node2", "--unlimited")
        assert c.status()["nodes"][1]["link"]["eth0"]["tbf_rate_bps"] is None
        # A process left running on a node goes when the cluster goes down.
        sleeper = subprocess.Popen(["ip", "netns", "exec", f"{c.name}-node1", "sleep", "300"])
    assert sleeper.wait(timeout=10) != 0
    assert leftovers(c.name) == []
    assert cli(c.name, "status", check=False).returncode == 1


def test_without_root_the_command_says_why_and_exits_3():
    if os.geteuid() != 0:
        res = cli("nr", "up", "--nodes", "2", check=False)
    else:  # drop root for this one command, as a user without sudo would run it
        env = dict(os.environ, PYTHONPATH=str(REPO), HOME="/tmp")
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              sys.executable, "-m", "mpsync.cli", "cluster", "--name", "nr",
                              "up", "--nodes", "2"], capture_output=True, text=True, env=env,
                             cwd="/tmp", timeout=60)
    assert res.returncode == 3, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "network namespaces unavailable" in lines[0], res.stderr


def _all_output(run) -> str:
    return run.stderr + run.stdout + "".join(
        o.get("stderr", "") + o.get("stdout", "") for o in run.ranks.values())


@needs_namespaces
@pytest.mark.mpi
@pytest.mark.parametrize("policy,topology", [("bsp", "ring"), ("ssp", "ps")])
def test_a_cut_link_ends_the_job_within_30s_naming_the_ranks_on_that_node(policy, topology):
    # Rank 0 (the server) alone on node1, workers round-robin over node2..node4: node3 holds
    # world rank 2 only.  Worker 0 (node2) cuts node3's cable after 5 steps.  Nothing is set
    # but the defaults: what ends the job is the server's heartbeat suspicion (3 s) and the
    # launcher losing the node (the agent's 6 s), not a test timeout.
    with Cluster("cut", "--nodes", "4", "--bandwidth", "1gbit") as c:
        mpirun_extra = [a for a in c.mpirun_args("--np", "5")
                        if a not in ("--allow-run-as-root", "--oversubscribe")]
        start = time.time()
        run = run_mpi(PROGRAMS, np=5, args=["cut_link", f"cluster={c.name}", "victim=node3",
                                            f"policy={policy}", f"topology={topology}"],
                      timeout=150, check=False, mpirun_extra=mpirun_extra)
        end = start + run.elapsed
    assert hosts_of(run).get(2) == "node3", run.report()
    faults = [float(m) for r in run.ranks
              for m in re.findall(r"^FAULT (\S+)$", run.rank_out(r), flags=re.M)]
    assert len(faults) == 1, run.report()
    assert not run.timed_out and run.returncode not in (0, None), run.report()
    to_end = end - faults[0]
    print(f"\n{policy}/{topology}: job ended {to_end:.1f} s after the cut "
          f"(exit {run.returncode})")
    assert to_end < FAULT_LIMIT, run.report()
    text = _all_output(run)
    named = re.search(r"worker rank\(s\) \[([\d, ]+)\] silent", text)
    assert named, run.report()
    print(named.group(0))
    assert 2 in [int(x) for x in named.group(1).split(",")], named.group(0)


def _aggregation_times(events, rank: int) -> dict[int, float]:
    """Round k's aggregation for ``rank`` as the server saw it: from the SYNC it sent to the
    reset the worker sent after the collective (the server's own timestamps)."""
    out, told = {}, None
    for t, r, kind, value in events:
        if r != rank:
            continue
        if kind == "sync":
            told = t
        elif kind == "reset" and told is not None:
            out[value] = t - told
            told = None
    return out


@needs_namespaces
@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["esync", "ebsp"])
def test_a_link_slowed_mid_run_hangs_nothing_and_the_server_sees_longer_aggregations(policy):
    # 10gbit -> 100mbit on node3 (world rank 2) at round 8 of 16; the model is 1.3 MB, so each
    # ring aggregation crossing that link takes >= 2 x 1.3 MB x 3/4 / 12.5 MB/s = 0.16 s more.
    with Cluster("slow", "--nodes", "4", "--bandwidth", "10gbit") as c:
        mpirun_extra = [a for a in c.mpirun_args("--np", "5")
                        if a not in ("--allow-run-as-root", "--oversubscribe")]
        run = run_mpi(PROGRAMS, np=5, args=["slow_link", f"cluster={c.name}", "victim=node3",
                                            "rate=100mbit", f"policy={policy}", "width=16000",
                                            "rounds=16", "slow_at=8"],
                      timeout=180, mpirun_extra=mpirun_extra)
    assert hosts_of(run).get(2) == "node3", run.report()
    res = run.results()
    assert sorted(res) == [1, 2, 3, 4] and all(r["rounds"] == 16 for r in res.values()), res
    assert len({r["digest"] for r in res.values()}) == 1, res
    slowed = [int(m) for r in run.ranks
              for m in re.findall(r"^SLOWED (\d+)$", run.rank_out(r), flags=re.M)]
    assert len(slowed) == 1, run.report()
    times = _aggregation_times(res[1]["server"]["events"], rank=2)
    before = sorted(t for k, t in times.items() if 2 <= k <= slowed[0])
    after = sorted(t for k, t in times.items() if k >= slowed[0] + 2)
    med_before, med_after = before[len(before) // 2], after[len(after) // 2]
    print(f"\n{policy}: server's view of world rank 2's aggregations (node3): median "
          f"{med_before * 1e3:.0f} ms at 10gbit, {med_after * 1e3:.0f} ms at 100mbit")
    assert med_after > med_before + 0.1, (before, after)


@needs_namespaces
@pytest.mark.mpi
def test_horovodrun_runs_across_the_nodes_with_the_ssh_stand_in(four_nodes):
    # docs/cluster.md's lines: eval "$(mpsync cluster env)"; horovodrun --mpi -np 4
    #   -H "$(mpsync cluster hosts)" --network-interfaces eth0 python x.py
    from mpsync.launch import run_with_deadline

    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(REPO), str(REPO / "tests"))),
               OMP_NUM_THREADS="1")
    for line in cli(four_nodes.name, "env").stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = shlex.split(value)[0]
    hosts = cli(four_nodes.name, "hosts").stdout.strip()
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    res = run_with_deadline([horovodrun, "--mpi", "-np", "4", "-H", hosts,
                             "--network-interfaces", "eth0", sys.executable, PROGRAMS,
                             "horovod_sum"], 150, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    found = re.findall(r"HVD rank=(\d) size=4 host=(node\d+) sum=(\d+)", out)
    assert sorted(int(r) for r, _, _ in found) == [0, 1, 2, 3], out[-4000:]
    assert {s for _, _, s in found} == {"10"}, found
    assert len({h for _, h, _ in found}) >= 2, found


@needs_namespaces
@pytest.mark.mpi
def test_mpsync_train_cluster_starts_itself_on_the_nodes(four_nodes, tmp_path):
    from mpsync.launch.cluster import cluster_mpirun_extra

    extra = cluster_mpirun_extra(3, four_nodes.name)
    hostfile = Path(extra[extra.index("--hostfile") + 1]).read_text().split("\n")
    addrs = {n["name"]: n["address"] for n in four_nodes.status()["nodes"]}
    assert [ln for ln in hostfile if ln and not ln.startswith("#")] == [
        addrs["node1"], addrs["node2"], addrs["node3"]]  # the server alone on node1
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "mpsync.cli", "train", "--cluster",
                          four_nodes.name, "--np", "2", "--policy", "bsp", "--epochs", "0.3",
                          "--out", str(tmp_path / "run"), "--no-progress"],
                         capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"3 ranks on cluster {four_nodes.name}" in res.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["config"]["workers"] == 2
    assert metrics["evals"][-1]["samples"] >= 0.3 * 1438, metrics["evals"][-1]  # digits train
