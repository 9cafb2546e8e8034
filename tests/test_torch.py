"""mpsync.torch: BSP exactness, backends, the Horovod-shaped API (multi-rank via the harness)."""

from __future__ import annotations

import json

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


def results(run) -> dict[int, dict]:
    """The ``RESULT {...}`` line of every rank that printed one, by world rank."""
    out = {}
    for rank in run.ranks:
        for line in run.rank_out(rank).splitlines():
            if line.startswith("RESULT "):
                out[rank] = json.loads(line[len("RESULT "):])
    return out


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
def test_bsp_equals_single_process_sgd_on_the_concatenated_batch(backend):
    # 1 dedicated server + 3 workers; momentum SGD in float64, workers start from different
    # weights (broadcast_parameters must fix that).
    run = run_mpi("torch_programs:bsp_equals_single_process", np=4, args=[f"backend={backend}"],
                  timeout=120)
    res = results(run)
    workers = sorted(r for r in res)
    assert len(workers) == 3, run.report()
    for r in workers:
        assert res[r]["size"] == 3 and res[r]["backend"] == backend
        assert res[r]["max_rel"] <= 1e-6, res[r]["max_rel"]
        assert res[r]["iterations"] == 6 and res[r]["rounds"] == 6
    # Every worker ends with the very same parameters.
    first = res[workers[0]]["params"]
    assert all(res[r]["params"] == first for r in workers)


def test_horovod_and_mpi_backends_agree():
    run = run_mpi("torch_programs:bsp_backends_agree", np=4, timeout=120)
    res = results(run)
    assert len(res) == 3, run.report()
    for r in res.values():
        assert r["horovod_vs_mpi"] <= 1e-6 and r["horovod_vs_ref"] <= 1e-6
        assert r["mpi_vs_ref"] <= 1e-6
