"""The papers' rules that live in the MPI path, on real ranks: ESync's rounds with a straggler
on the ring and on the PS, BSP's rounds on the PS, ESync §4.2's abort of the iteration a READY interrupts, ElasticBSP
on the PS after a worker joins, and ElasticBSP's barrier weights on the ring.  The
single-process worked scenarios of every policy are in test_fidelity_rules.py."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_esync_with_a_straggler_averages_every_applied_update_and_lets_fast_workers_run(
        topology):
    run = run_mpi("fidelity_programs:esync_straggler_rounds", np=4, timeout=180,
                  args=[f"topology={topology}", "rounds=5"])
    res = run.results()
    assert len(res) == 3, run.report()
    for r in res.values():
        # Every update any worker applied is in the model, averaged (Eq. 6-8), none twice.
        assert r["rel_err"] <= 1e-9, r
    assert len({r["digest"] for r in res.values()}) == 1
    slow = res[1]["iterations"]              # world rank 1 is worker 0, the straggler
    # Alg. 2: 2-3 local iterations of a fast worker per iteration of the slowest (BSP: 1).
    assert all(res[rank]["iterations"] >= 1.6 * slow for rank in (2, 3)), res


def _bsp_models(topology: str, *extra: str) -> np.ndarray:
    run = run_mpi("fidelity_programs:bsp_rounds", np=4, timeout=180,
                  args=[f"topology={topology}", "steps=8", *extra])
    res = run.results()
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
    run = run_mpi("fidelity_programs:esync_delayed_ack_abort", np=2, timeout=180,
                  args=["rounds=4"])
    res = run.results()
    assert len(res) == 1, run.report()
    r = res[1]
    # Each round: the report of a local iteration is answered READY; the READY lands during
    # the next iteration, which is aborted and aggregates instead (§4.2).  Without the abort
    # the READY would be seen at that iteration's report ("sync").
    assert "sync" not in r["kinds"], r
    assert r["kinds"].count("abort") == 4 == r["aborted"], r
    assert r["kinds"][0] == "local" and r["kinds"][-1] == "abort", r
    # The aborted iterations' updates are not in the model, every other one is.
    assert r["rel_err"] <= 1e-9, r


def test_ebsp_on_the_ps_keeps_placing_barriers_among_the_workers_left_after_a_join():
    run = run_mpi("fidelity_programs:ebsp_ps_join", np=4, timeout=180,
                  args=["steps=40", "short=6"])
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    plans, targets = res[1]["plans"], res[1]["targets"]
    # Each plan covers the workers still running: worker 2 leaves after its 6 steps, and at
    # the end the first of workers 0 and 1 to finish leaves too.
    assert plans[0] in ([0, 1, 2], [0, 1]), plans
    assert all(set(b) <= set(a) for a, b in zip(plans, plans[1:])), plans
    assert plans.count([0, 1]) >= 3, plans      # supersteps go on after the join
    # Each worker synchronized at every barrier planned for it while it ran, at the planned
    # iteration (an ASP run after the join would have no barrier at all).
    for rank, worker in ((1, 0), (2, 1), (3, 2)):
        barriers = [s["barrier_iteration"] for s in res[rank]["supersteps"]]
        planned = [t[ws.index(worker)] for ws, t in zip(plans, targets) if worker in ws]
        assert barriers == planned[:len(barriers)], (rank, barriers, planned)
        assert len(barriers) >= len(planned) - 1, (rank, barriers, planned)


def test_ebsp_on_the_ring_every_worker_holds_the_same_weights_at_every_barrier():
    run = run_mpi("fidelity_programs:ebsp_ring_barrier_weights", np=4, timeout=180,
                  args=["rounds=6"])
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    barriers = [r["at_barrier"] for r in res.values()]
    assert all(len(b) == 6 for b in barriers), barriers
    for k in range(6):
        assert len({b[k] for b in barriers}) == 1, (k, barriers)
    # Between barriers the replicas differ (local SGD on different data, different speeds).
    assert not set(res[1]["between"]) & set(res[2]["between"])
