"""mpsync.transport: the one place that decides Open MPI's transport settings across nodes, and
the cluster launch options that carry them (no namespaces needed: the layout is pure)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpsync import cluster, transport
from mpsync.cluster import layout


def test_tuned_by_default_and_replaced_or_removed_by_the_environment():
    assert transport.mca_pairs(environ={}) == list(transport.TUNED)
    assert transport.mca_pairs(environ={"MPSYNC_MPI_TUNING": "none"}) == []
    assert transport.mca_pairs(environ={"MPSYNC_MPI_TUNING": "defaults"}) == []
    assert transport.mca_pairs(environ={"MPSYNC_MPI_TUNING": " btl_tcp_links=4, "
                                        "coll_tuned_allreduce_algorithm=6"}) == [
        ("btl_tcp_links", "4"), ("coll_tuned_allreduce_algorithm", "6")]
    # An explicit spec wins over the environment.
    assert transport.mca_pairs("tuned", environ={"MPSYNC_MPI_TUNING": "none"}) == \
        list(transport.TUNED)
    assert transport.mca_argv("btl_tcp_links=3") == ["--mca", "btl_tcp_links", "3"]
    assert transport.mca_env("btl_tcp_links=3") == {"OMPI_MCA_btl_tcp_links": "3"}
    assert not transport.is_set({"MPSYNC_MPI_TUNING": " "})
    assert transport.is_set({"MPSYNC_MPI_TUNING": "none"})


@pytest.mark.parametrize("spec, message", [
    ("fast", "'fast' is not name=value"),
    ("--mca=btl_tcp_links", "is not name=value"),
    ("btl_tcp_links=", "'btl_tcp_links=' is not name=value"),
    ("BTL=2", "'BTL=2' is not name=value"),
    ("btl_tcp_links=2,btl_tcp_links=4", "btl_tcp_links given twice"),
])
def test_bad_specs_are_named(spec, message):
    with pytest.raises(transport.TransportError, match="MPSYNC_MPI_TUNING") as e:
        transport.mca_pairs(spec)
    assert message in str(e.value)


def test_module_prints_options_for_job_scripts():
    out = subprocess.run([sys.executable, "-m", "mpsync.transport", "tuned"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == transport.mca_argv("tuned")
    bad = subprocess.run([sys.executable, "-m", "mpsync.transport", "x"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "MPSYNC_MPI_TUNING='x'" in bad.stderr


def test_cluster_launch_options_end_with_the_transport_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "RUN_ROOT", tmp_path)
    monkeypatch.delenv("MPSYNC_MPI_TUNING", raising=False)
    state = layout.plan("tt", 3, "10.213.9.0/24", state_dir=str(tmp_path / "tt"))
    (tmp_path / "tt").mkdir()   # a saved layout stands in for `cluster up`
    (tmp_path / "tt" / "state.json").write_text(json.dumps(state.to_dict()))
    opts = cluster.launch_options(4, name="tt")
    assert opts[-len(transport.mca_argv()):] == transport.mca_argv()
    assert "btl_tcp_links" not in cluster.launch_options(4, name="tt", tuning="none")
    monkeypatch.setenv("MPSYNC_MPI_TUNING", "none")
    assert "btl_tcp_links" not in cluster.launch_options(name="tt")
    monkeypatch.setenv("MPSYNC_MPI_TUNING", "btl_tcp_links=3")
    env = cluster.shell_env("tt")
    assert env["OMPI_MCA_btl_tcp_links"] == "3" and "OMPI_MCA_coll_tuned_allreduce_algorithm" \
        not in env
