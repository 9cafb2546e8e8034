"""The virtual cluster (``mpsync cluster``): layout and command lines (pure, any machine), then
real namespaces, real links and real mpirun across them (root; skipped with the reason where
namespaces are unavailable).
"""

from __future__ import annotations

import ipaddress
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
from mpsync.cluster import layout as P

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- pure: no root needed

def test_rates_parse_in_tc_units_and_reject_nonsense():
    assert P.parse_rate("1gbit") == 10**9
    assert P.parse_rate("100Mbit") == 10**8
    assert P.parse_rate("2.5gbit") == 2_500_000_000
    assert P.format_rate(10**9) == "1gbit" and P.format_rate(2_500_000_000) == "2500mbit"
    for bad in ("1gb", "fast", "", "1 gigabit", "10bit"):
        with pytest.raises(P.ClusterError, match="bandwidth"):
            P.parse_rate(bad)


def test_tbf_burst_holds_a_gso_segment_and_two_ms_of_the_rate():
    assert P.tbf_burst(P.parse_rate("100mbit")) == 128 * 1024   # floor: > one 64 KiB segment
    assert P.tbf_burst(P.parse_rate("1gbit")) == 250_000        # 2 ms at 125 MB/s
    assert P.tbf_burst(P.parse_rate("10gbit")) == 2_500_000


def test_subnet_choice_skips_every_overlapping_route_and_address():
    assert P.choose_subnet(["192.0.2.0/24", "default"]) == "10.213.0.0/24"
    assert P.choose_subnet(["10.213.0.0/24", "10.213.1.7/32"]) == "10.213.2.0/24"
    # A wide route covering all 10.213.x candidates: fall back to 172.29.x.
    assert P.choose_subnet(["10.0.0.0/8"]) == "172.29.0.0/24"
    # Another mpsync cluster's subnet is taken even if its route were missing.
    assert P.choose_subnet([], taken=["10.213.0.0/24"]) == "10.213.1.0/24"
    with pytest.raises(P.ClusterError, match="no free private subnet"):
        P.choose_subnet(["10.0.0.0/8", "172.16.0.0/12"])


def test_plan_names_everything_after_the_cluster_and_addresses_one_subnet():
    s = P.plan("ab", 3, "10.213.4.0/24", bandwidth="1gbit", slots=4, state_dir="/x")
    assert [n.namespace for n in s.nodes] == ["ab-node1", "ab-node2", "ab-node3"]
    assert [n.name for n in s.nodes] == ["node1", "node2", "node3"]
    assert s.switch_namespace == "ab-switch" and s.login_link == "ab-login"
    net = ipaddress.ip_network(s.subnet)
    addrs = [s.login_address] + [n.address for n in s.nodes]
    assert len(set(addrs)) == 4 and all(ipaddress.ip_address(a) in net for a in addrs)
    assert s.bandwidth == "1gbit" and s.burst == 250_000 and s.nodes[0].slots == 4
    assert P.ClusterState.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize("name", ["", "Upper", "1abc", "toolongname", "a-b"])
def test_bad_cluster_names_are_refused(name):
    with pytest.raises(P.ClusterError, match="cluster name"):
        P.plan(name, 2, "10.213.0.0/24")


def test_bad_node_and_slot_counts_are_refused():
    with pytest.raises(P.ClusterError, match="--nodes"):
        P.plan("a", 0, "10.213.0.0/24")
    with pytest.raises(P.ClusterError, match="--slots"):
        P.plan("a", 2, "10.213.0.0/24", slots=0)


def test_up_commands_build_a_switch_a_link_per_node_and_rate_limit_both_ends():
    s = P.plan("c", 2, "10.213.0.0/24", bandwidth="100mbit")
    cmds = P.up_commands(s)
    assert cmds[0] == ["ip", "netns", "add", "c-switch"]
    assert ["ip", "-n", "c-switch", "link", "add", "node2", "type", "veth", "peer", "name",
            "eth0", "netns", "c-node2"] in cmds
    assert ["ip", "-n", "c-node1", "addr", "add", "10.213.0.11/24", "dev", "eth0"] in cmds
    tbfs = [c for c in cmds if c[0] == "tc"]
    assert len(tbfs) == 4  # two nodes x two ends
    assert ["tc", "-n", "c-node1", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
            "100mbit", "burst", str(128 * 1024), "latency", P.TBF_LATENCY] in tbfs
    assert any(c[:3] == ["tc", "-n", "c-switch"] and "node1" in c for c in tbfs)
    assert ["ip", "addr", "add", "10.213.0.1/24", "dev", "c-login"] in cmds
    # Nothing but the login link is ever made in the host's namespace.
    host_side = [c for c in cmds if c[:2] == ["ip", "link"] and c[2] in ("add",)]
    assert host_side == [["ip", "link", "add", "c-login", "type", "veth", "peer", "name",
                          "login", "netns", "c-switch"]]
    assert not [c for c in P.up_commands(P.plan("c", 2, "10.213.0.0/24")) if c[0] == "tc"]


def test_down_commands_remove_only_the_clusters_own_objects():
    s = P.plan("c", 3, "10.213.0.0/24")
    cmds = P.down_commands(s)
    assert cmds == [["ip", "link", "del", "c-login"], ["ip", "netns", "del", "c-node1"],
                    ["ip", "netns", "del", "c-node2"], ["ip", "netns", "del", "c-node3"],
                    ["ip", "netns", "del", "c-switch"]]


def test_link_commands_act_at_the_switch_port():
    s = P.plan("c", 2, "10.213.0.0/24")
    assert P.link_state_commands(s, s.node("node2"), False) == [
        ["ip", "-n", "c-switch", "link", "set", "node2", "down"]]
    assert P.rate_commands(s, s.node("10.213.0.12"), None) == [
        ["tc", "-n", "c-node2", "qdisc", "del", "dev", "eth0", "root"],
        ["tc", "-n", "c-switch", "qdisc", "del", "dev", "node2", "root"]]
    with pytest.raises(P.ClusterError, match="no node 'node9'"):
        s.node("node9")


def test_placement_keeps_node1_for_the_server_and_spreads_the_rest():
    s = P.plan("c", 4, "10.213.0.0/24")
    a = [n.address for n in s.nodes]
    assert P.placement(s, 5) == [a[0], a[1], a[2], a[3], a[1]]
    assert P.placement(s, 5, server_alone=False) == [a[0], a[1], a[2], a[3], a[0]]
    one = P.plan("c", 1, "10.213.0.0/24")
    assert P.placement(one, 3) == [one.nodes[0].address] * 3
    text = P.hostfile_text(s, P.placement(s, 3))
    assert [ln for ln in text.splitlines() if not ln.startswith("#")] == [a[0], a[1], a[2]]
    assert f"{a[2]} slots=2" in P.hostfile_text(s)


def test_mpirun_options_keep_open_mpi_on_the_cluster_subnet():
    s = P.plan("c", 2, "10.213.0.0/24", state_dir="/run/x/c")
    opts = P.mpirun_options(s, hostfile="/h", sequential=True)
    assert opts[:4] == ["--hostfile", "/h", "--map-by", "seq"]
    pairs = {opts[i + 1]: opts[i + 2] for i, o in enumerate(opts) if o == "--mca"}
    assert pairs == {"plm_rsh_agent": "/run/x/c/agent", "btl": "tcp,self",
                     "oob_tcp_if_include": "10.213.0.0/24",
                     "btl_tcp_if_include": "10.213.0.0/24"}
    assert "--allow-run-as-root" in opts
    assert "--allow-run-as-root" not in P.mpirun_options(s, hostfile="/h", standalone=False)


def test_agent_script_carries_the_node_table_and_the_agent_code():
    s = P.plan("c", 2, "10.213.0.0/24")
    text = P.agent_script(s, python="/opt/py")
    assert text.startswith("#!/opt/py -I\n")
    ns = {}
    exec(compile(text.split("\n", 1)[1].replace('if __name__ == "__main__"', "if False"),
                 "agent", "exec"), ns)
    node2 = {"name": "node2", "namespace": "c-node2", "address": "10.213.0.12"}
    assert ns["NODES"]["10.213.0.12"] == ns["NODES"]["node2"] == node2


def test_agent_reads_ssh_command_lines_like_ssh():
    from mpsync.cluster import agent

    assert agent.split_ssh_args(["-o", "StrictHostKeyChecking=no", "-p", "22", "-x", "-T",
                                 "10.213.0.12", "cd", "/tmp", "&&", "true"]) == \
        ("10.213.0.12", ["cd", "/tmp", "&&", "true"])
    assert agent.split_ssh_args(["-oBatchMode=yes", "node1"]) == ("node1", [])
    assert agent.split_ssh_args(["-p", "22"]) == (None, [])
    # horovodrun's form: options after the host too.
    assert agent.split_ssh_args(["-o", "PasswordAuthentication=no", "10.213.0.11", "-p", "22",
                                 "-o", "ConnectTimeout=10", "true"]) == ("10.213.0.11", ["true"])
    node = {"name": "node2", "namespace": "c-node2", "address": "10.213.0.12"}
    assert agent.remote_argv(node, ["PATH=/x:$PATH", ";", "orted", "-mca", "a", "b"]) == [
        "nsenter", "--net=/run/netns/c-node2", "unshare", "--uts", "sh", "-c",
        "hostname node2 && PATH=/x:$PATH ; orted -mca a b"]


def test_agent_refuses_an_unknown_host(tmp_path):
    s = P.plan("c", 2, "10.213.0.0/24")
    path = tmp_path / "agent"
    path.write_text(P.agent_script(s, python=sys.executable))
    path.chmod(0o755)
    bad = subprocess.run([str(path), "node7", "true"], capture_output=True, text=True)
    assert bad.returncode == 255 and "no node node7 (nodes: node1 node2)" in bad.stderr


def test_agent_ends_the_whole_remote_tree():
    from mpsync.cluster import agent

    # A shell with a grandchild that ignores SIGTERM: both must be gone afterwards.
    child = subprocess.Popen(["sh", "-c", "sh -c 'trap \"\" TERM; sleep 60' & wait"],
                             start_new_session=True)
    import time

    deadline = time.monotonic() + 5
    while not agent.descendants(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = agent.descendants(child.pid)
    assert tree
    agent.end_session(child, grace=1.0)
    assert child.poll() is not None
    for pid in tree:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_a_second_up_with_other_settings_is_described():
    a = P.plan("c", 2, "10.213.0.0/24", bandwidth="1gbit")
    b = P.plan("c", 4, "10.213.0.0/24", slots=3)
    assert P.differences(a, a) == []
    assert P.differences(a, b) == ["nodes: 2 running, 4 asked",
                                   "bandwidth: 1gbit running, unlimited asked",
                                   "slots: 2 running, 3 asked"]


def test_cli_rejects_a_bad_rate_with_exit_2(capsys):
    from mpsync.cli import main

    assert main(["cluster", "up", "--nodes", "2", "--bandwidth", "fast"]) == 2
    assert "bandwidth 'fast'" in capsys.readouterr().err


def test_train_flags_round_trip_for_the_relaunch_under_mpirun():
    import argparse

    from mpsync.apps import train
    from mpsync.launch.cluster import argv_from_namespace

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    argv = ["--policy", "esync", "--time-budget", "20", "--no-progress", "--cluster", "abc",
            "--np", "3", "--slowdown", "1,2,1", "--out", "r1"]
    args = parser.parse_args(argv)
    assert args.cluster == "abc" and args.np == 3
    again = argv_from_namespace(parser, args, drop=("cluster", "cluster_placement", "np"))
    assert "--cluster" not in again and "--np" not in again
    assert vars(parser.parse_args(again)) == dict(vars(args), cluster=None, np=None)
    assert parser.parse_args(["--cluster"]).cluster == ""  # the default cluster


def test_compare_without_cluster_launches_as_before(tmp_path):
    import argparse

    from mpsync.apps import compare, runs

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    argv = runs.launch_argv(parser.parse_args([]), "bsp", tmp_path)
    assert "--hostfile" not in argv and "plm_rsh_agent" not in argv


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


def results_of(run) -> dict[int, dict]:
    res = {}
    for r in run.ranks:
        for line in run.rank_out(r).splitlines():
            if line.startswith("RESULT "):
                res[r] = json.loads(line[7:])
    return res


@pytest.fixture(scope="module")
def four_nodes():
    if not AVAILABLE:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    with Cluster("acc", "--nodes", "4", "--bandwidth", "1gbit") as c:
        yield c


@needs_namespaces
@pytest.mark.mpi
@pytest.mark.parametrize("policy,topology", [("esync", "ring"), ("bsp", "ring"), ("ssp", "ps")])
def test_a_horovod_style_script_trains_across_four_nodes(four_nodes, policy, topology):
    # Exactly the line a user pastes: mpirun $(mpsync cluster mpirun-args) -np 5 python x.py
    run = run_mpi(PROGRAMS, np=5, args=["train", f"policy={policy}", f"topology={topology}"],
                  timeout=150, mpirun_extra=four_nodes.mpirun_args())
    hosts = hosts_of(run)
    assert sorted(hosts) == [0, 1, 2, 3, 4], run.report()
    assert len(set(hosts.values())) >= 2, hosts
    assert set(hosts.values()) <= {"node1", "node2", "node3", "node4"}, hosts
    res = results_of(run)
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
    # but the defaults: what ends the job is the server's silence detection (10 s) and the
    # launcher losing the node (the agent's 13 s), not a test timeout.
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
    res = results_of(run)
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
    # The README's lines: eval "$(mpsync cluster env)"; horovodrun --mpi -np 4
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
