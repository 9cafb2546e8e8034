"""The virtual cluster's layout and command lines (``mpsync cluster``), pure: names,
addresses, rates, the ip/tc commands, the ssh stand-in, placement, the CLI's argument checks
and the relaunch of ``mpsync train --cluster`` under mpirun; no root, no namespace needed.
Real namespaces, links and mpirun across them are in tests/test_cluster.py.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpsync.cluster import layout as P


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
