"""The state server under mpirun: every policy's guarantee, faults, bad input and load.

Workers are emulated devices that sleep ``base * speed`` per iteration (tests/server_programs.py);
the ring aggregation is a real Allreduce among them, so a wrong SYNC decision deadlocks (and
the harness's timeout fails the test) or breaks a check.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pytest

from mpi_harness import run_mpi
from mpsync import sched

pytestmark = pytest.mark.mpi


def _policy_run(tmp_path, policy, topology="ring", speeds="1,1,2,4", timeout=120, check=True,
                **opts):
    out = tmp_path / f"{policy}-{topology}.json"
    args = [f"policy={policy}", f"topology={topology}", f"speeds={speeds}", f"out={out}"]
    args += [f"{k}={v}" for k, v in opts.items()]
    run = run_mpi("server_programs:policy_run", np=len(speeds.split(",")) + 1, args=args,
                  timeout=timeout, check=check)
    if not check:
        return run, None, None
    return run, json.loads(out.read_text()), json.loads((tmp_path / (out.name + ".workers")).read_text())


def test_bsp_all_workers_aggregate_at_the_same_iteration(tmp_path):
    _, stats, workers = _policy_run(tmp_path, "bsp", iters=30, base=0.002)
    for rec in workers:
        assert rec["local_before_sync"] == [1] * 30
        assert rec["gaps"] == [0] * 30          # min == max iteration at every aggregation
    for w in stats["workers"].values():
        assert w["decisions"] == {"LOCAL": 0, "SYNC": 30} and w["rounds"] == 30


def test_ssp_gap_never_exceeds_s(tmp_path):
    _, stats, _ = _policy_run(tmp_path, "ssp", "ps", iters=40, base=0.002, staleness=2)
    assert stats["max_staleness_gap"] <= 2
    # The bound was binding: the fast workers' pulls were held at times.
    assert stats["workers"]["1"]["held_pulls"] > 0
    assert stats["ps_version"] == 4 * 40


def test_dssp_gap_within_s_upper_and_extra_iterations_as_the_controller_decided(tmp_path):
    _, stats, _ = _policy_run(tmp_path, "dssp", "ps", iters=40, base=0.002, staleness_low=1,
                              staleness_high=4)
    assert stats["max_staleness_gap"] <= 4
    grants = stats["policy_state"]["grants"]
    assert grants, "the controller never granted extra iterations to a fast worker"
    for g in grants:
        table = np.array(g["push_table"])
        assert 1 <= g["r_max"] <= 4 - 1
        r_star = sched.dssp_controller_reference(table, g["p"], g["r_max"], g["slowest"])
        assert g["r_star"] == r_star > 0
    # The fastest workers got the grants, the slowest none.
    assert stats["policy_state"]["controller_grants"][3] == 0


def test_esync_fast_workers_run_more_local_iterations_and_the_slowest_barely_waits(tmp_path):
    base = 0.01
    _, stats, workers = _policy_run(tmp_path, "esync", rounds=15, base=base)
    slow = workers[3]
    assert slow["local_before_sync"] == [1] * 15          # the slowest never runs ahead
    ratios = [np.mean(w["local_before_sync"][1:]) / np.mean(slow["local_before_sync"][1:])
              for w in workers[:2]]
    assert all(r >= 2.5 for r in ratios), ratios        # speeds 4x: about 4x the iterations
    # ESync §4.1: once ready, the slowest waits at most the fastest's iteration time + ε
    # (ε = esync_slack = 0 here); oversubscribed ranks add scheduling noise, hence the median.
    assert statistics.median(slow["slowest_wait"][1:]) < base * 1 + 0.01
    assert {w["rounds"] for w in stats["workers"].values()} == {15}


def test_esync_delayed_ack_one_ready_per_round_and_no_waiting_for_not_ready(tmp_path):
    _, stats, workers = _policy_run(tmp_path, "esync", rounds=12, base=0.005, delayed=1)
    for rec in workers:
        assert rec["readies"] == rec["rounds"] == 12
    # NOT-READY is never sent in this mode: LOCAL decisions exist only on the server's side.
    assert sum(w["decisions"]["LOCAL"] for w in stats["workers"].values()) > 0
    assert np.mean(workers[0]["local_before_sync"]) > np.mean(workers[3]["local_before_sync"])
    # §4.2's capability includes the state query's round trip: every worker measured one (a
    # READY's send-to-seen time; it was 0 before the first READY) and sent it with its reports.
    rtt = stats["policy_state"]["query_rtt_s"]
    assert all(0 < r < 2.0 for r in rtt), rtt


def test_ebsp_barrier_is_zipline_on_the_servers_timestamps(tmp_path):
    _, stats, workers = _policy_run(tmp_path, "ebsp", rounds=8, base=0.004, lookahead=15)
    plans = stats["policy_state"]["plans"]
    assert len(plans) >= 8
    for plan in plans:
        M = sched.predict(np.array(plan["last_push"]), np.array(plan["interval"]), 15)
        res = sched.zipline(M, "basic")
        assert res.z.tolist() == plan["z"]
        assert plan["target_iteration"] == [b + z + 1 for b, z in
                                             zip(plan["base_iteration"], plan["z"])]
    # Each worker synchronized exactly at the iteration its round's plan fixed.
    by_round = {p["round"]: p for p in plans}
    for w, rec in enumerate(workers):
        for rnd, k in enumerate(rec["sync_iters"]):
            assert by_round[rnd]["target_iteration"][w] == k
    # Heterogeneous speeds: the fast workers ran more local iterations than the slowest.
    assert sum(workers[0]["local_before_sync"]) > 2 * sum(workers[3]["local_before_sync"])


def test_ebsp_with_equal_speeds_degenerates_to_bsp(tmp_path):
    _, _, workers = _policy_run(tmp_path, "ebsp", speeds="1,1,1", rounds=10, base=0.004)
    for rnd in range(10):
        counts = {rec["local_before_sync"][rnd] for rec in workers}
        assert len(counts) == 1, f"round {rnd}: workers ran {counts} local iterations"
    for rec in workers:
        assert rec["gaps"] == [0] * 10


def test_osp_every_worker_gets_the_same_bitmap(tmp_path):
    _, stats, workers = _policy_run(tmp_path, "osp", iters=20, base=0.001)
    assert stats["policy_state"]["ics_layers_total"] > 0
    assert all(rec["ics_layers"] > 0 for rec in workers)


@pytest.mark.parametrize("policy, topology", [
    ("bsp", "ring"), ("asp", "ps"), ("ssp", "ps"), ("dssp", "ps"), ("ebsp", "ring"),
    ("esync", "ring"), ("osp", "ring"), ("ebsp", "ps"), ("esync", "ps")])
def test_1000_rounds_without_deadlock(tmp_path, policy, topology):
    budget = {"rounds": 1000} if policy in ("ebsp", "esync") else {"iters": 1000}
    _, stats, workers = _policy_run(tmp_path, policy, topology, speeds="1,1,2", base=0,
                                    timeout=240, **budget)
    assert all(rec["rounds"] >= 1000 or rec["iterations"] >= 1000 for rec in workers)
    assert all(w["done"] for w in stats["workers"].values())


def test_a_silent_worker_on_the_ring_aborts_the_job_naming_it(tmp_path):
    start = time.monotonic()
    run, _, _ = _policy_run(tmp_path, "esync", speeds="1,1,1", rounds=50, base=0.002,
                            silent_timeout=2, stall="1,5,600", check=False, timeout=90)
    elapsed = time.monotonic() - start
    assert not run.ok and not run.timed_out
    assert "worker rank(s) [2] silent" in run.stderr + run.rank_err(0)
    assert elapsed < 40, f"took {elapsed:.0f}s to abort"


@pytest.mark.parametrize("policy", ["ebsp", "esync"])
def test_a_stalled_worker_on_the_ps_is_taken_out_and_the_others_keep_training(tmp_path, policy):
    _, stats, workers = _policy_run(tmp_path, policy, "ps", speeds="1,1,1", duration=7,
                                    base=0.01, silent_timeout=1.5, stall="1,5,4")
    assert any("[2] silent" in line and "taken out" in line for line in stats["log"])
    assert any("responding again" in line for line in stats["log"])
    removed = [e for e in stats["events"] if e[2] == "removed"]
    assert removed[0][1] == 2  # (a heavily loaded machine may pause others later, too)
    t_removed = removed[0][0]
    # While rank 2 was stalled the others went on synchronizing.
    syncs_during = [e for e in stats["events"] if e[2] == "sync" and e[1] != 2 and
                    t_removed < e[0] < t_removed + 2.5]
    assert len(syncs_during) >= 10


def test_colocated_server_thread_on_a_training_rank(tmp_path):
    out = tmp_path / "colocated.json"
    run_mpi("server_programs:policy_run", np=3, timeout=120,
            args=["policy=bsp", "topology=ring", "colocated=1", "iters=40", f"out={out}"])
    stats = json.loads(out.read_text())
    assert sorted(stats["workers"]) == ["0", "1", "2"]
    assert all(w["decisions"]["SYNC"] == 40 for w in stats["workers"].values())


def test_fuzz_10000_bad_messages_the_server_keeps_answering(tmp_path):
    out = tmp_path / "fuzz.json"
    run = run_mpi("server_programs:fuzz", np=4, timeout=300, args=["n=10000", f"out={out}"])
    res = json.loads(out.read_text())
    for r in (1, 2):
        assert f"honest rank {r} ok" in run.rank_out(r)
    assert res["rejected"] >= 5000
    # Each kind of rejection is logged once per source, and every line names the rank.
    assert len(res["log"]) == len(set(res["log"]))
    assert all("from rank 3" in line for line in res["log"])
    assert res["ps_version"] >= 600


def test_load_64_clients_2000_queries_each(tmp_path):
    out = tmp_path / "load.json"
    run_mpi("server_programs:load", np=65, timeout=600, args=["queries=2000", f"out={out}"])
    res = json.loads(out.read_text())
    assert res["total_steps"] == 64 * 2000 and res["syncs"] == 64 * 2000
    assert set(res["per_worker"].values()) == {2000}
    assert res["rejected"] == 0
    # Memory flat: after Open MPI has set up its 64 connections (the first quarter of the run),
    # resident memory does not grow with the number of messages handled.
    samples = res["rss_kb"]
    t_end = samples[-1][0]
    settled = [kb for t, kb in samples if t >= 0.25 * t_end]
    assert max(settled) - min(settled) < 8_000, samples
    print(f"load: {res['total_steps'] / res['elapsed_s']:.0f} queries/s, RSS "
          f"{res['rss_start_kb']} -> {res['rss_end_kb']} kB")
