"""mpsync.torch: BSP exactness, backends, the Horovod-shaped API (multi-rank via the harness)."""

from __future__ import annotations

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("backend", ["mpi", "horovod", "gloo"])
def test_bsp_equals_single_process_sgd_on_the_concatenated_batch(backend):
    # 1 dedicated server + 3 workers; momentum SGD in float64, workers start from different
    # weights (broadcast_parameters must fix that).
    run = run_mpi("torch_programs:bsp_equals_single_process", np=4, args=[f"backend={backend}"],
                  timeout=120)
    res = run.results()
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
    res = run.results()
    assert len(res) == 3, run.report()
    for r in res.values():
        assert r["horovod_vs_mpi"] <= 1e-6 and r["horovod_vs_ref"] <= 1e-6
        assert r["mpi_vs_ref"] <= 1e-6


def test_bsp_on_gloo_gives_bitwise_the_weights_of_mpi():
    # 1 dedicated server + 2 workers, 20 float32 momentum steps on each backend in one job.
    run = run_mpi("torch_programs:bsp_gloo_matches_mpi", np=3, args=["steps=20"], timeout=120)
    res = run.results()
    assert sorted(res) == [1, 2], run.report()
    for r in res.values():
        assert r["size"] == 2 and r["backend"] == "ProcessGroupAggregator", r
        assert r["bitwise"] and r["max_rel"] == 0.0, r
    assert len({r["digest"] for r in res.values()}) == 1, res


def test_esync_with_equal_speeds_equals_bsp_step_for_step():
    run = run_mpi("torch_programs:esync_equal_speeds_equals_bsp", np=4, timeout=120)
    res = run.results()
    assert len(res) == 3, run.report()
    for r in res.values():
        # Equal speeds: the server says SYNC after every local step (one step per round)...
        assert r["iterations"] == 8 and r["rounds"] == 8, r
        # ...and delta averaging with ε = 1 after one SGD step is gradient averaging.
        assert r["max_rel"] <= 1e-9, r
    assert len({r["digest"] for r in res.values()}) == 1


@pytest.mark.parametrize("policy,topology", [("esync", "ring"), ("ebsp", "ps")])
def test_a_4x_straggler_lets_fast_workers_take_more_local_steps(policy, topology):
    run = run_mpi("torch_programs:esync_straggler", np=4, timeout=180,
                  args=[f"policy={policy}", f"topology={topology}", "rounds=6"])
    res = run.results()
    assert len(res) == 3, run.report()
    slow = [r for r in res.values() if r["slow"] > 1]
    fast = [r for r in res.values() if r["slow"] == 1]
    assert len(slow) == 1 and len(fast) == 2
    for r in fast:
        assert r["iterations"] >= 1.5 * slow[0]["iterations"], res
    # shutdown's final aggregation: every worker ends with the very same model
    assert len({r["digest"] for r in res.values()}) == 1, res


@pytest.mark.parametrize("policy", ["asp", "dssp"])
def test_ps_applies_every_pushed_update_exactly_once(policy):
    run = run_mpi("torch_programs:ps_updates_applied_once", np=4, timeout=120,
                  args=[f"policy={policy}", "steps=25"])
    res = run.results()
    assert len(res) == 3, run.report()
    for r in res.values():
        assert r["rel_err"] <= 1e-9, r
    assert len({r["digest"] for r in res.values()}) == 1


def test_ps_init_returns_once_every_shard_loaded_its_compiled_loop():
    run = run_mpi("torch_programs:ps_init_waits_for_warm_shards", np=3, timeout=120)
    res = run.results()
    assert len(res) == 2 and any(r["hosts_a_shard"] for r in res.values()), run.report()
    assert all(r["warmed"] for r in res.values()), res


@pytest.mark.parametrize("backend", ["mpi"])
def test_osp_with_an_empty_ics_set_equals_bsp(backend):
    run = run_mpi("torch_programs:osp_run", np=4, timeout=120, args=["ics=0", f"backend={backend}"])
    res = run.results()
    assert len(res) == 3, run.report()
    for r in res.values():
        assert r["ics_layers"] == 0 and r["vs_bsp"] <= 1e-6, r


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
def test_osp_with_ics_applies_every_workers_gradients(backend):
    run = run_mpi("torch_programs:osp_run", np=4, timeout=120,
                  args=["ics=0.8", "steps=30", f"backend={backend}"])
    res = run.results()
    assert len(res) == 3, run.report()
    for r in res.values():
        assert r["ics_layers"] > 0, r  # the server did put layers into In-Computation Sync
        # Σ applied global gradients == mean over workers of Σ local gradients
        assert r["conservation"] <= 1e-9, r
    assert len({r["digest"] for r in res.values()}) == 1


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
def test_allreduce_sum_is_exact_and_gather_object_collects_every_worker(backend):
    run = run_mpi("torch_programs:sum_and_gather", np=4, args=[f"backend={backend}"],
                  timeout=120)
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()  # world rank 0 is the dedicated server
    assert all(r["size"] == 3 and r["backend"] == backend for r in res.values())
    big = 2 ** 62 // 4
    assert all(r["int64"] == [6, 3 * big + 3, -9] for r in res.values()), res


COLOCATED_SINGLE = """
import sys
import mpi4py
mpi4py.rc.thread_level = "single"   # before MPI is initialised: no MPI_THREAD_MULTIPLE
from mpi4py import MPI
import mpsync.torch as mps
from mpsync.config import ConfigError
assert MPI.Query_thread() < MPI.THREAD_MULTIPLE, MPI.Query_thread()
try:
    mps.init(policy="bsp", backend="mpi", server="colocated")
except ConfigError as e:
    print("REFUSED", e, flush=True)
    sys.exit(0)
print("ACCEPTED", flush=True)
sys.exit(1)
"""


def test_colocated_server_without_thread_multiple_is_refused(tmp_path):
    script = tmp_path / "colocated_single.py"
    script.write_text(COLOCATED_SINGLE)
    run = run_mpi(str(script), np=2, timeout=90)
    for rank in (0, 1):
        out = run.rank_out(rank)
        assert "REFUSED" in out, run.report()
        assert "server='colocated'" in out and "MPI_THREAD_MULTIPLE" in out, out
