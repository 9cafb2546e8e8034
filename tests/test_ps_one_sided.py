"""One-sided pushes and pulls (``mpsync.server.shard_window``): where a job uses them, what
the shards store and count through them, and the same answers as the messages give."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_harness import run_mpi
from mpsync.config import SyncConfig
from mpsync.server.shard_window import unavailable_reason, window_layout
from mpsync.server.weights import WeightStore


def test_a_shards_window_holds_its_weights_then_aligned_times_and_counts_per_worker():
    assert window_layout(5, np.float32, 3) == (24, 48, 72)   # 20 bytes of weights -> 24
    assert window_layout(4, np.float64, 2) == (32, 48, 64)
    assert window_layout(0, np.float32, 1) == (0, 8, 16)


def test_a_pinned_store_keeps_its_weights_in_the_window_through_init_apply_and_detach():
    window = np.zeros(4, dtype=np.float32)
    store = WeightStore()
    store.pinned = window
    store.init(np.arange(4, dtype=np.float32))
    assert store.weights is window and window.tolist() == [0, 1, 2, 3]
    # A sum offered another buffer is still made in the window: the workers add into it.
    spare = np.full(4, -1, dtype=np.float32)
    assert store.apply(np.ones(4, dtype=np.float32), into=spare) is None
    store.detach()
    assert store.weights is window and window.tolist() == [1, 2, 3, 4]
    assert spare.tolist() == [-1] * 4 and store.version == 1


@pytest.mark.parametrize("settings, reason", [
    (dict(policy="bsp", topology="ps"), "bsp's shards hold its rounds or barriers"),
    (dict(policy="ebsp", topology="ps"), "ebsp's shards hold its rounds or barriers"),
    (dict(policy="asp", ps_optimizer="server"), "the shards run the optimizer"),
    (dict(policy="asp", ps_one_sided=False), "ps_one_sided is off"),
    (dict(policy="asp"), None),
    (dict(policy="ssp"), None),
    (dict(policy="dssp"), None),
])
def test_only_policies_whose_shards_apply_on_arrival_push_one_sided(settings, reason):
    from mpi4py import MPI

    config = SyncConfig(**settings).validate()
    assert unavailable_reason(config, MPI.COMM_SELF) == reason


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["asp", "ssp"])
def test_one_sided_pushes_land_once_and_the_shards_count_and_hear_them(policy):
    steps, workers = 20, 2
    run = run_mpi("ps_one_sided_programs:pushes_land_once", np=workers + 1, timeout=180,
                  args=[f"policy={policy}", f"steps={steps}"])
    res = {r["rank"]: r for r in run.results().values()}
    assert len(res) == workers, run.report()
    assert all(r["window"] for r in res.values()), res
    assert all(r["silent"] == [] for r in res.values()), res
    text = "".join(run.rank_err(r) for r in run.ranks)
    assert "PS pushes and pulls one-sided" in text, run.report()
    for r in res.values():   # each worker hosts a shard: every push of both, and the last
        shard = r["shard"]
        assert shard["one_sided_pushes"] >= workers * steps, res
        assert shard["version"] >= shard["one_sided_pushes"], res


@pytest.mark.mpi
def test_without_the_window_the_same_pushes_come_as_messages():
    steps, workers = 20, 2
    run = run_mpi("ps_one_sided_programs:pushes_land_once", np=workers + 1, timeout=180,
                  args=["policy=asp", f"steps={steps}", "one_sided=0"])
    res = {r["rank"]: r for r in run.results().values()}
    assert len(res) == workers and not any(r["window"] for r in res.values()), res
    text = "".join(run.rank_err(r) for r in run.ranks)
    assert "PS pushes and pulls as messages (ps_one_sided is off)" in text, run.report()
    for r in res.values():
        assert r["shard"]["one_sided_pushes"] == 0, res
        assert r["shard"]["version"] >= workers * steps, res
