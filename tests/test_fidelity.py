"""The papers' algorithms on real ranks: ESync's synchronous rounds computing the same model on
the ring and on the PS, and ESync §4.2's abort of the iteration a READY interrupts.  The
single-process worked scenarios (ElasticBSP supersteps, OSP's Alg. 1 and U_max) are in
test_server_policies.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


def _results(run) -> dict[int, dict]:
    out = {}
    for rank in run.ranks:
        for line in run.rank_out(rank).splitlines():
            if line.startswith("RESULT "):
                out[rank] = json.loads(line[len("RESULT "):])
    return out


def test_esync_on_the_ps_and_on_the_ring_give_the_same_model_from_the_same_seeds():
    models = {}
    for topology in ("ring", "ps"):
        run = run_mpi("fidelity_programs:esync_one_step_rounds", np=4, timeout=180,
                      args=[f"topology={topology}", "steps=6"])
        res = _results(run)
        assert len(res) == 3, run.report()
        for r in res.values():
            assert r["iterations"] == 6 and r["rounds"] >= 6, r
            # One local step per round, ε = 1: ESync is SGD on the concatenated batch.
            assert r["vs_sgd"] <= 1e-9, (topology, r["vs_sgd"])
        models[topology] = np.array(res[min(res)]["params"])
        assert all(np.array_equal(np.array(r["params"]), models[topology])
                   for r in res.values())
    scale = np.abs(models["ring"]).max()
    assert np.abs(models["ring"] - models["ps"]).max() <= 1e-12 * scale


def _bsp_models(topology: str, *extra: str) -> np.ndarray:
    run = run_mpi("fidelity_programs:bsp_rounds", np=4, timeout=180,
                  args=[f"topology={topology}", "steps=8", *extra])
    res = _results(run)
    assert len(res) == 3, run.report()
    for r in res.values():
        assert r["iterations"] == 8, r
        # Momentum SGD is linear in the gradients: averaging the workers' momentum steps
        # (PS) is stepping on the averaged gradient (ring), both SGD on the whole batch.
        assert r["vs_sgd"] <= 1e-9, (topology, extra, r["vs_sgd"])
    model = np.array(res[min(res)]["params"])
    assert all(np.array_equal(np.array(r["params"]), model) for r in res.values())
    return model


def test_bsp_on_the_ps_averages_and_gives_the_ring_s_model_from_the_same_seeds():
    # One shard is the single store; three put every parameter tensor across shard borders.
    ring = _bsp_models("ring")
    for shards in (1, 3):
        ps = _bsp_models("ps", f"ps_shards={shards}")
        assert np.abs(ring - ps).max() <= 1e-12 * np.abs(ring).max(), shards


def test_esync_delayed_ack_discards_the_iteration_a_ready_interrupts():
    run = run_mpi("fidelity_programs:esync_delayed_ack_abort", np=3, timeout=180,
                  args=["rounds=6"])
    res = _results(run)
    assert len(res) == 2, run.report()
    for r in res.values():
        assert r["rel_err"] <= 1e-9, r
    # READY comes back within the next iteration (30-90 ms of it): that iteration is aborted.
    assert sum(r["aborted"] for r in res.values()) >= 3, res
