"""The state server under mpirun: every policy's guarantee, faults, bad input and load.

Workers are emulated devices that sleep ``base * speed`` per iteration (tests/server_programs.py);
the ring aggregation is a real Allreduce among them, so a wrong SYNC decision deadlocks (and
the harness's timeout fails the test) or breaks a check.
"""

from __future__ import annotations

import json
import re
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


def _undisturbed_run(tmp_path, policy, clean_rounds, need, attempts=3, **opts):
    """``_policy_run`` until a run has ``need`` clean rounds, as judged by ``clean_rounds``
    (the workers' records -> one bool per round, from their ``overrun``: how far an
    iteration, sleep plus query, ran over its nominal time).  On this VM the host sometimes
    takes the cores away for a while (whole runs with 10-80 ms overruns in most rounds), and
    such a run says nothing of a policy's timing.  The run is repeated on that measured
    criterion only, never because an assertion failed; after ``attempts`` disturbed runs
    the test fails.  Returns (stats, workers, clean) of the first usable run."""
    for attempt in range(attempts):
        sub = tmp_path / f"attempt{attempt}"
        sub.mkdir()
        _, stats, workers = _policy_run(sub, policy, **opts)
        clean = np.asarray(clean_rounds(workers))
        if clean.sum() >= need:
            return stats, workers, clean
    overrun = np.max([w["overrun"] for w in workers], axis=0)
    pytest.fail(f"{attempts} runs disturbed by the machine, last overruns (ms): "
                f"{np.round(overrun * 1e3, 1).tolist()}")


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


def _pull_outcomes(events):
    """Rebuilt from the server's event log alone: per rank, for its n-th push, whether the pull
    that followed was held (``held_after[rank][n]``), and every rank's push count when the
    server decided that pull (``counts_at[rank][n]``: other workers' pushes can land between a
    worker's push and its pull, and the staleness rule sees them)."""
    counts: dict[int, int] = {}
    held_after: dict[int, dict[int, bool]] = {}
    counts_at: dict[int, dict[int, dict]] = {}
    pending: dict[int, int] = {}  # rank -> push number whose pull outcome is not yet seen
    for _, rank, kind, _ in events:
        if kind == "push":
            counts[rank] = counts.get(rank, 0) + 1
            pending[rank] = counts[rank]
        elif kind in ("pull", "held") and rank in pending:
            n = pending.pop(rank)
            held_after.setdefault(rank, {})[n] = kind == "held"
            counts_at.setdefault(rank, {})[n] = dict(counts)
    return held_after, counts_at


def test_dssp_gap_within_s_upper_and_extra_iterations_as_the_controller_decided(tmp_path):
    s_low, s_high = 1, 4
    _, stats, _ = _policy_run(tmp_path, "dssp", "ps", iters=40, base=0.002,
                              staleness_low=s_low, staleness_high=s_high)
    assert stats["max_staleness_gap"] <= s_high
    grants = stats["policy_state"]["grants"]
    assert grants, "the controller never granted extra iterations to a fast worker"
    for g in grants:
        table = np.array(g["push_table"])
        assert 1 <= g["r_max"] <= s_high - s_low
        r_star = sched.dssp_controller_reference(table, g["p"], g["r_max"], g["slowest"])
        assert g["r_star"] == r_star > 0
    # The fastest workers got most of the grants.  (Not all: a grant goes to whoever is ahead
    # by pushes at that moment, and near the end, with the fast workers' last pushes in, the
    # 4x worker can be ahead of a worker held back by the staleness bound; seen in about one
    # run in five with this test's 2 ms iterations on 2 oversubscribed cores.)
    grants_per_worker = stats["policy_state"]["controller_grants"]
    assert grants_per_worker[3] <= min(grants_per_worker[:2]) / 2, grants_per_worker

    # DSSP Alg. 1: a grant of r* lets the fastest worker run r* iterations beyond s_L without
    # waiting (the OK of the granting push is the first), and no more: the pull after its
    # (r*)-th push waits again unless it fell back within s_L or got a new grant.  Observed on
    # the server's event log (pushes, answered pulls, held pulls), not on the grant records.
    events = stats["events"]
    assert len(events) < 200_000, "the event log wrapped"
    held_after, counts_at = _pull_outcomes(events)
    granted_at = {(g["worker"] + 1, g["pushes"]) for g in grants}
    ran_in_full = 0
    for g in grants:
        rank, first, r_star = g["worker"] + 1, g["pushes"], g["r_star"]
        outcomes = held_after[rank]
        observed = [outcomes[n] for n in range(first, first + r_star) if n in outcomes]
        assert not any(observed), (f"rank {rank} was held during its {r_star} granted "
                                   f"iterations after push {first}: {observed}")
        after = first + r_star
        if after in outcomes:
            ran_in_full += 1
            at = counts_at[rank][after]
            gap = at[rank] - min(at.get(r, 0) for r in range(1, 5))
            if gap > s_low and (rank, after) not in granted_at:
                assert outcomes[after], (f"rank {rank} ran past its {r_star} granted "
                                         f"iterations (push {after}, gap {gap}) without waiting")
    assert ran_in_full > 0, "no grant could be followed to its end"


def test_esync_fast_workers_run_more_local_iterations_and_the_slowest_barely_waits(tmp_path):
    base, rounds, eps = 0.01, 20, 0.0

    def clean_rounds(workers):
        # Rounds 1.. (round 0 is left out below) in which no worker's iteration ran more than
        # 5 ms over its nominal time.
        return np.max([w["overrun"] for w in workers], axis=0)[1:] < 0.005

    stats, workers, clean = _undisturbed_run(tmp_path, "esync", clean_rounds, 10,
                                             rounds=rounds, base=base, esync_slack=eps)
    slow = workers[3]
    assert slow["local_before_sync"] == [1] * rounds     # the slowest never runs ahead
    # Round 0 starts from registration, not from an aggregation: left out below.
    per_round = [np.array(w["local_before_sync"][1:]) for w in workers]
    # Speeds 1x,1x,2x,4x: a worker of speed s fits 4/s iterations into the slowest's one, and
    # Alg. 2 lets it start an iteration only if it ends before the slowest's (rest_time).  The
    # last of those ends exactly when the slowest's does, so any per-iteration overhead (the
    # query, sleep overshoot) puts it past the boundary: 4/s - 1 .. 4/s per round, on the
    # median of rounds (a descheduled rank can shorten a round).
    # The upper bound on every round holds where the round and the one before it were clean: a
    # slowest worker descheduled in its iteration reports a longer one, and its peers rest
    # into that time.
    settled = clean & np.r_[True, clean[:-1]]
    for w, ideal in ((0, 4), (1, 4), (2, 2)):
        med = float(np.median(per_round[w]))
        assert ideal - 1 <= med <= ideal, (w, per_round[w].tolist())
        assert per_round[w][settled].max() <= ideal + 1, (w, per_round[w].tolist(), settled)
    fast_ratio = [float(np.median(per_round[w])) for w in (0, 1)]  # the slowest runs 1
    assert all(3 <= r <= 5 for r in fast_ratio), fast_ratio      # "about 4x"
    assert np.median(per_round[0]) > np.median(per_round[2])     # 1x runs more than 2x
    # ESync §4.1: once ready, the slowest waits at most the fastest's iteration time + ε.
    # Asserted on the 75th percentile with 5 ms of scheduling allowance (5 ranks on 2 shared
    # cores), over the clean rounds (``_undisturbed_run``): a rank descheduled for a time
    # slice, or a host that takes the VM's cores away (a full test run once saw waits of
    # 30-80 ms in most rounds), says nothing of Alg. 2.  Most rounds must be clean, so a
    # server that is slow to answer still fails the test.
    waits = np.array(slow["slowest_wait"][1:])
    assert np.percentile(waits[clean], 75) < base * 1 + eps + 0.005, (
        np.round(waits * 1e3, 1).tolist(), clean.tolist())
    assert np.median(waits[clean]) < base * 1 + eps
    assert {w["rounds"] for w in stats["workers"].values()} == {rounds}


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


def _ebsp_inputs_from_events(events, ranks):
    """Replay the server's event log (its own receipt times) into the inputs of each ElasticBSP
    plan, independently of what the policy recorded: an iteration's interval is the time from
    the worker's previous event (registration, report or reset) to its report; a plan is made
    at the report that ends the monitoring phase (ZipLine Fig. 5): every worker has passed
    every earlier barrier (its reset) and reported twice since; ``last`` is each worker's
    latest report then."""
    last, interval, iteration = {}, {}, {}
    since = dict.fromkeys(ranks, 0)     # reports since the worker's last reset
    resets = dict.fromkeys(ranks, 0)
    plans = []
    for t, rank, kind, value in events:
        if rank not in since:
            continue
        if kind == "register":
            last[rank] = t
        elif kind == "report":
            if rank in last:
                interval[rank] = t - last[rank]
            last[rank] = t
            iteration[rank] = value
            since[rank] += 1
            if all(resets[r] == len(plans) and since[r] >= 2 for r in ranks):
                plans.append({"last": [last[r] for r in ranks],
                              "interval": [interval[r] for r in ranks],
                              "base_iteration": [iteration[r] for r in ranks]})
        elif kind == "reset":
            last[rank] = t
            resets[rank] += 1
            since[rank] = 0
    return plans


def _least_waiting_barrier(last, interval, R):
    """ZipLine §4.1 Problem 1 by its definition, not by ZipLine: predicted pushes
    M[p, i] = last[p] + (i + 1)·interval[p]; over all R^n choices of one per worker, the least
    max - min, among equals the earliest max (§4.2 Thm. 1); each worker's z is then its last
    predicted push not after that barrier."""
    M = last[:, None] + (np.arange(R)[None, :] + 1) * interval[:, None]
    n = len(last)
    choice = np.stack(np.meshgrid(*[np.arange(R)] * n, indexing="ij"), -1).reshape(-1, n)
    Z = M[np.arange(n), choice]
    hi = Z.max(axis=1)
    d = hi - Z.min(axis=1)
    best = np.flatnonzero(d == d.min())
    t_sync = hi[best].min()
    return [int(np.flatnonzero(M[p] <= t_sync).max()) for p in range(n)]


def test_ebsp_barrier_is_zipline_on_the_servers_timestamps(tmp_path):
    R = 15
    _, stats, workers = _policy_run(tmp_path, "ebsp", rounds=8, base=0.004, lookahead=R)
    plans = stats["policy_state"]["plans"]
    assert len(plans) >= 8
    assert len(stats["events"]) < 200_000, "the event log wrapped"
    rebuilt = _ebsp_inputs_from_events(stats["events"], [1, 2, 3, 4])
    assert len(rebuilt) == len(plans)
    for plan, mine in zip(plans, rebuilt):
        assert plan["workers"] == [0, 1, 2, 3]
        assert mine["base_iteration"] == plan["base_iteration"]
        # Event times are relative to the server's start; the plan's absolute: same intervals.
        assert np.allclose(mine["interval"], plan["interval"], rtol=0, atol=1e-6)
        # The barrier is the least-waiting one over every choice of one predicted push per
        # worker (ZipLine's Problem 1, by brute force over all R^n), ties to the earliest.
        z = _least_waiting_barrier(np.array(plan["last_push"]), np.array(plan["interval"]), R)
        assert plan["z"] == z, (plan, z)
        assert plan["target_iteration"] == [b + k + 1 for b, k in
                                             zip(mine["base_iteration"], z)]
    # Each worker synchronized exactly at the iteration its round's plan fixed.
    by_round = {p["round"]: p for p in plans}
    for w, rec in enumerate(workers):
        for rnd, k in enumerate(rec["sync_iters"]):
            assert by_round[rnd]["target_iteration"][w] == k
    # Heterogeneous speeds (1x vs 4x): the fastest ran well over the slowest's local
    # iterations (4x ideally; exactly 2x was seen on a machine loaded by other jobs).
    assert sum(workers[0]["local_before_sync"]) > 1.5 * sum(workers[3]["local_before_sync"])


def test_ebsp_with_equal_speeds_degenerates_to_bsp(tmp_path):
    # The server learns each interval from one pair of its own receipt times (ZipLine §4), so
    # on an oversubscribed machine a descheduled iteration reads several ms long, and ZipLine
    # then rightly prefers a barrier where that "slower" worker runs one iteration fewer once
    # the shift fits in the lookahead (after gamma / delta_gamma iterations). With 50 ms
    # iterations and R = 7 that needs a measured difference above 7.1 ms. (R = 15 put it at
    # 3.3 ms, which a CI run on 2 busy cores overran in every round of three runs.) On a loaded
    # machine it still happens in a round now and then, so most rounds, not all, must be
    # BSP-like here; test_server_policies.py checks the exact property on a noise-free clock.
    def clean_rounds(workers):
        # A round's plan is made from intervals measured in the round before: a round is clean
        # if no worker's iteration ran over its 50 ms by 6 ms or more in it or the one before.
        over = np.max([rec["overrun"] for rec in workers], axis=0) >= 0.006
        return ~(over | np.concatenate([[False], over[:-1]]))

    _, workers, clean = _undisturbed_run(tmp_path, "ebsp", clean_rounds, 5, speeds="1,1,1",
                                         rounds=10, base=0.05, lookahead=7)
    equal = [len({rec["local_before_sync"][rnd] for rec in workers}) == 1 for rnd in range(10)]
    assert sum(e for e, c in zip(equal, clean) if c) >= 0.6 * clean.sum(), (
        [rec["local_before_sync"] for rec in workers], clean.tolist())
    for rnd in range(10):
        # Whatever the plan, the ring guarantee holds: everyone aggregates in the same round,
        # and in the equal rounds at the same iteration.
        if all(equal[: rnd + 1]):
            assert all(rec["gaps"][rnd] == 0 for rec in workers)


def test_osp_every_worker_gets_the_same_bitmap(tmp_path):
    _, stats, workers = _policy_run(tmp_path, "osp", iters=20, base=0.001)
    assert stats["policy_state"]["ics_layers_total"] > 0
    assert all(rec["ics_layers"] > 0 for rec in workers)
    # Alg. 1 on the reported epochs and losses: nothing in ICS in epoch 1, then
    # S(G^u) = (1 - loss_i / L)·U_max with U_max the smallest worker's bound (150).
    per_epoch = stats["policy_state"]["metrics"]["osp_ics_fraction"]
    assert per_epoch[0]["epoch"] == 1 and per_epoch[0]["ics_fraction"] == 0.0
    assert [e["s_gu"] for e in per_epoch[1:]] == pytest.approx([75.0, 100.0, 112.5])
    assert all(e["u_max"] == 150.0 for e in per_epoch)


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


def test_a_push_header_waiting_for_its_payload_does_not_stop_the_server(tmp_path):
    out = tmp_path / "late.json"
    run_mpi("server_fault_programs:late_payload", np=3, timeout=120,
            args=["hold=1.5", "deadline=2.0", f"out={out}"])
    stats = json.loads(out.read_text())
    worker = json.loads((tmp_path / "late.json.worker").read_text())
    # Rank 1 was answered throughout: nothing waited for rank 2's payloads (1.5 s, 2 s).
    assert worker["slowest_s"] < 1.0, worker
    assert worker["iterations"] >= 50, worker
    # The late push was applied when its payload came; the one without payload was not.
    assert stats["pushes"] == {"1": worker["iterations"], "2": 1}, stats
    assert worker["model"] == [worker["iterations"] + 100.0] * 4
    dropped = [line for line in stats["log"] if "no payload within 2s" in line]
    assert len(dropped) == 1 and "rank 2" in dropped[0] and "push" in dropped[0], stats["log"]


def test_colocated_server_thread_on_a_training_rank(tmp_path):
    out = tmp_path / "colocated.json"
    run_mpi("server_programs:policy_run", np=3, timeout=120,
            args=["policy=bsp", "topology=ring", "colocated=1", "iters=40", f"out={out}"])
    stats = json.loads(out.read_text())
    assert sorted(stats["workers"]) == ["0", "1", "2"]
    assert all(w["decisions"]["SYNC"] == 40 for w in stats["workers"].values())


def test_a_rank_that_is_not_a_worker_is_dropped_and_logged_once_and_the_writers_round_trip(
        tmp_path):
    out = tmp_path / "outsider.json"
    run = run_mpi("server_fault_programs:outsider", np=4, timeout=90,
                  args=["n=50", "iters=20", f"out={out}"])
    res = json.loads(out.read_text())
    assert "outsider: sent 50, reply received: False" in run.rank_out(3)
    assert res["rejected"] == 50
    about_3 = [line for line in res["log"] if "rank 3" in line]
    assert len(about_3) == 1 and "not a worker of this server" in about_3[0], res["log"]
    assert sorted(res["workers"]) == ["1", "2"]           # rank 3 never counted as a worker
    assert all(w["decisions"]["SYNC"] == 20 for w in res["workers"].values())

    # write_stats_json: the same stats, as JSON.
    stats = json.loads((tmp_path / "outsider.json.stats.json").read_text())
    assert stats["workers"] == res["workers"] and stats["rejected_messages"] == 50
    # write_chrome_trace: Chrome/Perfetto JSON object format, one row per worker rank, a
    # "sync" span for every SYNC-then-reset and a "compute" span for every report.
    trace = json.loads((tmp_path / "outsider.json.trace.json").read_text())
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    events = trace["traceEvents"]
    for e in events:
        assert isinstance(e, dict) and {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    for tid in (1, 2):
        spans = [e for e in events if e["tid"] == tid and e["ph"] == "X"]
        assert sum(e["name"] == "sync" for e in spans) == 20
        assert sum(e["name"] == "compute" for e in spans) == 20
        # Spans of one worker do not overlap: each starts after the previous one ended.
        ends = [(e["ts"], e["ts"] + e["dur"]) for e in sorted(spans, key=lambda e: e["ts"])]
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(ends, ends[1:]))
    assert not [e for e in events if e["tid"] == 3]


def test_bench_server_smoke():
    import subprocess
    import sys

    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mpsync.cli", "bench", "server", "--np", "2",
                        "--queries", "2000", "--json", "--timeout", "60"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("p50_us", "p99_us", "raw_p50_us", "python_floor_p50_us", "polling_floor_p50_us",
                "queries_per_s", "paced_floor_p50_us", "server_decisions_per_s"):
        assert np.isfinite(res[key]) and res[key] > 0, (key, res)
    assert res["clients"] == 1 and res["queries_per_client"] == 2000 and res["blocks"] == 4
    assert res["fast_path"] is True   # the compiled path is what this machine runs
    assert res["p50_us"] <= res["p99_us"]
    # One client sends a query only after the previous reply: the total time is at least the
    # sum of the round trips, at least half of which are >= p50.
    assert res["queries_per_s"] <= 2e6 / res["p50_us"], res
    assert time.monotonic() - start < 60


def test_fuzz_10000_hypothesis_messages_the_server_keeps_answering_correctly(tmp_path):
    out = tmp_path / "fuzz.json"
    run = run_mpi("server_fault_programs:fuzz", np=5, timeout=300,
                  args=["n=5000", "iters=300", f"out={out}"])
    res = json.loads(out.read_text())
    # Ranks 1-2 honest, 3 a fuzzing worker, 4 a fuzzing rank the server does not know.
    for r in (1, 2):
        assert f"honest rank {r} ok" in run.rank_out(r)
    sent = {}
    for r in (3, 4):
        m = re.search(r"fuzzer rank \d+ sent (\d+) messages, (\d+) replies", run.rank_out(r))
        assert m, run.rank_out(r)
        sent[r] = int(m.group(1))
    assert sum(sent.values()) >= 10_000, sent
    # Every message of the unknown rank was dropped (it got no reply: checked on rank 4).
    assert res["rejected"] >= sent[4]
    assert res["workers"] == ["1", "2", "3"]
    assert res["pushes"]["1"] == res["pushes"]["2"] == 300
    # Each kind of rejection is logged once per source, and every line names the rank.
    assert len(res["log"]) == len(set(res["log"]))
    assert all("from rank 3" in line or "from rank 4" in line for line in res["log"])
    assert any("from rank 4" in line and "not a worker" in line for line in res["log"])
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


@pytest.mark.parametrize("policy, options", [
    ("bsp", ["bad=1", "rounds=150"]),
    ("esync", ["rounds=40", "early=1"]),
    ("esync", ["rounds=40", "delayed=1", "bad=1"]),
    ("ebsp", ["rounds=12"]),
])
def test_the_compiled_loop_serves_the_ring_protocol_and_hands_over_what_it_leaves(
        tmp_path, policy, options):
    """Transport smoke test: what a message does to the tables is the rules' business
    (tests/test_server_rules.py); here the compiled loop around them must carry a real
    ring job to its end, serve most messages itself, and hand the rest to the Python loop."""
    out = tmp_path / "transport.json"
    run = run_mpi("server_programs:transport", np=5, timeout=240,
                  args=[f"policy={policy}", f"out={out}", *options])
    for r in range(1, 5):
        assert f"transport worker {r} ok" in run.rank_out(r)
    stats = json.loads(out.read_text())
    messages = stats["messages"]
    # Most steps and resets compiled (with a worker gone, ESync's decisions still are);
    # malformed messages and ElasticBSP's planning handed over to Python.
    assert messages["compiled"] > 0.5 * (messages["compiled"] + messages["python"]), messages
    if "bad=1" in options or policy == "ebsp":
        assert messages["handed_over"] > 0, messages
    assert messages["awaited"] > 0, messages   # due reports met by the compiled loop's wait
    decisions = [w["decisions"] for w in stats["workers"].values()]
    assert sum(d["SYNC"] for d in decisions) > 0
    if policy != "bsp":
        assert sum(d["LOCAL"] for d in decisions) > 0, decisions
    if "bad=1" in options:
        assert stats["rejected_messages"] > 0
