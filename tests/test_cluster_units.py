"""Pure parts of the cross-node tooling, no namespace needed: the virtual cluster's slurm.conf
and slurmd command, the wide MLP of the cross-node comparison, and the bus-bandwidth figures
of ``mpsync bench allreduce --cluster``."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpsync.cluster.slurm import SlurmNode, slurm_conf, slurmd_argv

NODES = [SlurmNode("node1", "10.77.0.1", "/var/run/netns/node1"),
         SlurmNode("node2", "10.77.0.2", "/var/run/netns/node2")]


def _conf(**kw) -> dict[str, list[str]]:
    text = slurm_conf(login_host="vm", login_addr="10.77.0.254", nodes=NODES,
                      directory=Path("/var/lib/x"), **kw)
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_slurm_conf_puts_the_controller_on_the_login_address_and_one_line_per_node():
    conf = _conf()
    assert conf["SlurmctldHost"] == ["vm(10.77.0.254)"]
    nodes = conf["NodeName"]
    assert [n.split()[0] for n in nodes] == ["node1", "node2"]
    assert "NodeAddr=10.77.0.1" in nodes[0] and "NodeAddr=10.77.0.2" in nodes[1]
    assert conf["PartitionName"][0].split()[:2] == ["cluster", "Nodes=node1,node2"]
    # One slurmd per node shares the file: their paths must differ per node.
    for key in ("SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"):
        assert "%n" in conf[key][0], key
    # Away from Slurm's defaults and from the single-node test cluster (.ci/slurm.sh).
    ports = {int(conf["SlurmctldPort"][0]), int(conf["SlurmdPort"][0])}
    assert not ports & {6817, 6818, 16817, 16818}


def test_slurm_conf_rejects_an_empty_or_repeated_node_list():
    with pytest.raises(ValueError, match="no nodes"):
        slurm_conf(login_host="vm", login_addr="10.0.0.1", nodes=[], directory=Path("/x"))
    with pytest.raises(ValueError, match="repeat"):
        slurm_conf(login_host="vm", login_addr="10.0.0.1", nodes=[NODES[0], NODES[0]],
                   directory=Path("/x"))


def test_slurmd_enters_only_the_network_namespace_and_sets_the_hostname():
    argv = slurmd_argv(NODES[1], Path("/etc/c.conf"))
    # nsenter --net, not `ip netns exec` (which remounts /sys and hides the cgroup mounts).
    assert argv[:2] == ["nsenter", "--net=/var/run/netns/node2"]
    assert argv[2:4] == ["unshare", "--uts"]
    assert argv[-1] == "hostname node2 && exec slurmd -f '/etc/c.conf' -N node2"
    with pytest.raises(ValueError, match="letters"):
        slurmd_argv(SlurmNode("node1; rm -rf /", "10.0.0.1", "/x"), Path("/c"))


def test_wide_mlp_has_megabytes_of_gradients_and_trains_on_images():
    import torch

    from mpsync.apps.models import WideMLP, build_model

    model = build_model((1, 8, 8), 10, seed=3, name="wide-mlp")
    assert isinstance(model, WideMLP)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    assert 8e6 < nbytes < 9.5e6, nbytes
    assert len(list(model.parameters())) == 8  # 4 Linear layers: weights and biases
    x = torch.randn(5, 1, 8, 8)
    assert model(x).shape == (5, 10)
    same = build_model((1, 8, 8), 10, seed=3, name="wide-mlp")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))


def test_build_model_names_a_wrong_model_or_shape():
    from mpsync.apps.models import build_model

    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model((64,), 10, 0, name="vgg")
    with pytest.raises(ValueError, match="'mlp' takes"):
        build_model((1, 8, 8), 10, 0, name="mlp")
    assert type(build_model((1, 8, 8), 10, 0)).__name__ == "SmallCNN"


def test_bus_bandwidth_is_the_link_rate_when_the_links_are_the_only_limit():
    from mpsync.bench.nodes import bus_bandwidth, link_fraction

    # A ring allreduce of B bytes over n ranks puts 2(n-1)/n * B on each link each way: at
    # exactly that rate, busbw equals the rate whatever n.
    rate_bits = 10**9
    for n in (2, 4, 8):
        nbytes = 64 << 20
        seconds = 2 * (n - 1) / n * nbytes * 8 / rate_bits
        assert bus_bandwidth(nbytes, seconds, n) == pytest.approx(rate_bits / 8)
        assert link_fraction(nbytes, seconds, n, rate_bits) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least 2"):
        bus_bandwidth(1 << 20, 0.1, 1)


def test_cluster_bench_rows_get_ratios_and_link_fractions_per_method_and_variant():
    from mpsync.bench.nodes import derive_row, check_targets

    row = {"bytes": 64 << 20, "mpsync_ms": 1100.0, "horovod_ms": 1000.0,
           "mpsync_links2+ring_ms": 880.0, "horovod_links2+ring_ms": 800.0,
           "shift_ms": 600.0}
    out = derive_row(row, 4, "1gbit", ["links2+ring"])
    assert out["mpsync_vs_horovod"] == pytest.approx(1.1)
    assert out["mpsync_vs_horovod_links2+ring"] == pytest.approx(1.1)
    # 64 MiB, 4 ranks, 1 s: busbw = 1.5 * 64 MiB/s = 0.805 Gbit/s.
    assert out["horovod_link_fraction"] == pytest.approx(1.5 * (64 << 20) * 8 / 1e9)
    # A shift carries the buffer once per link and direction.
    assert out["shift_link_fraction"] == pytest.approx((64 << 20) * 8 / 0.6 / 1e9)
    targets = check_targets([{"rate": "1gbit", "nodes": 4, "rows": [out]}])["4nodes_1gbit"]
    assert targets["mpsync_vs_horovod_median_ge_1MB"] == pytest.approx(1.1)
    assert targets["link_fraction_64MB"]["horovod"] == out["horovod_link_fraction"]


def test_the_compare_setup_line_names_the_rate_the_comparison_ran_at(tmp_path, monkeypatch):
    """``compare --bandwidth`` sets every link for the comparison: the table's setup line
    names that rate, not the one the cluster was made with."""
    import argparse
    import json

    from mpsync import cluster
    from mpsync.apps import compare, runs
    from mpsync.cluster.layout import plan

    monkeypatch.setattr(cluster, "RUN_ROOT", tmp_path)
    cluster._save_state(plan("units", 3, "10.213.0.0/24", bandwidth="10gbit",
                             state_dir=str(tmp_path / "units")))
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(["--cluster", "units", "--np", "2"])
    assert "links 10gbit" in runs.setup_line(args, {})
    args = parser.parse_args(["--cluster", "units", "--np", "2", "--bandwidth", "100mbit"])
    assert "links 100mbit" in runs.setup_line(args, {})
    assert json.loads((tmp_path / "units" / "state.json").read_text())["bandwidth"] == "10gbit"
