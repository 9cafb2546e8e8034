"""``--cluster`` on ``mpsync bench allreduce`` and ``mpsync bench server``, kept tiny: the
ranks land one per node of a virtual cluster the command makes, every figure comes back, and
the cluster is gone afterwards.  The figures themselves are benchmarks (bench/, not asserted
against targets here); the test checks that they are measurements of the right thing: times
that a rate-limited link bounds from below.

Skips only where network namespaces are unavailable (the reason is printed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.mpi, pytest.mark.cluster]


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    from mpsync import cluster

    ok, why = cluster.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")


def _bench(*args, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "mpsync.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _namespaces_of(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ns for ns in out.split() if ns.startswith(f"{name}-")]


def test_allreduce_across_two_nodes_is_bounded_by_the_link(tmp_path):
    size = 4 << 20
    res = _bench("allreduce", "--cluster", "tbench", "--cluster-nodes", "2",
                 "--cluster-rates", "100mbit", "--sizes", str(size),
                 "--seconds-per-point", "0.1", "--max-repeats", "3", "--probe-variants", "",
                 "--out", str(tmp_path), "--json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not _namespaces_of("tbench"), "the cluster made for the run was not removed"
    summary = json.loads((tmp_path / "cluster.json").read_text())
    [run] = summary["runs"]
    [row] = run["rows"]
    assert (run["nodes"], run["rate"], row["bytes"]) == (2, "100mbit", size)
    # At 100 Mbit/s a 2-rank allreduce of 4 MiB must move 4 MiB each way over the link:
    # at least 0.34 s; shared memory would take about a millisecond.  So must the parameter
    # server's traffic without it (a push of half the buffer and a reply each way).
    floor_ms = size * 8 / 100e6 * 1e3
    for method in ("mpsync", "horovod", "mpi", "mpsync_mpi", "probe_mpi", "shift",
                   "ps_alltoall", "ps_pairwise"):
        assert row[f"{method}_ms"] >= 0.95 * floor_ms, (method, row)
        assert 0 < row[f"{method}_link_fraction"] <= 1.05, (method, row)
    assert row["mpsync_vs_horovod"] > 0


def test_server_across_nodes_answers_from_another_node(tmp_path):
    out = tmp_path / "server.json"
    res = _bench("server", "--cluster", "tbench", "--np", "2", "--queries", "800",
                 "--paced-iters", "20", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not _namespaces_of("tbench")
    result = json.loads(out.read_text())
    assert (result["cluster"], result["nodes"], result["link_rate"]) == ("tbench", 2, "1gbit")
    # Over TCP between namespaces a round trip costs tens of µs, not shared memory's 2-3 µs.
    assert result["raw_p50_us"] > 8, result
    assert result["p50_us"] > 0 and result["paced_p50_us"] > 0
