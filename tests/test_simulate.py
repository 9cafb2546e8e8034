"""mpsync simulate: analytic cases, policy invariants, the fast engines against the event engine
(which drives the server's policy objects), the CLI.  Single process, seeded, seconds."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mpsync.config import ConfigError, SyncConfig
from mpsync.policies import default_topology
from mpsync.simulate import CostModel, SpeedModel, parse_speeds, run_events, simulate

PY = sys.executable


def _config(policy, topology=None, **kw):
    return SyncConfig(policy=policy, topology=topology or default_topology(policy), **kw)


@pytest.mark.parametrize("engine", ["exact", "fast"])
def test_bsp_wait_fraction_is_the_analytic_value(engine):
    # Round time T = max(c) + query + ring cost; worker w waits T - c_w of it.
    c = np.array([0.1, 0.13, 0.2, 0.37])
    q, agg, R = 0.002, 0.011, 40
    T = c.max() + q + agg
    duration = R * T + 0.5 * c.min()     # R whole rounds, then half the fastest iteration
    row = simulate(_config("bsp"), SpeedModel(c), CostModel(query=q, fixed_aggregation=agg),
                   duration=duration, engine=engine)
    expected = (R * (T - c)).sum() / (len(c) * duration)
    assert row["wait_fraction"] == pytest.approx(expected, rel=1e-9)
    assert row["rounds"] == R
    assert row["iterations"] == R * len(c)
    assert row["aggregation_fraction"] == pytest.approx(R * agg * len(c) / (len(c) * duration))


@pytest.mark.parametrize("engine", ["exact", "fast"])
def test_asp_never_waits_and_each_worker_runs_at_its_own_speed(engine):
    c = np.array([0.05, 0.1, 0.2, 0.4])
    cost = CostModel(query=0.0, fixed_aggregation=0.0)
    row = simulate(_config("asp"), SpeedModel(c), cost, duration=10.01, engine=engine)
    assert row["wait_fraction"] == 0.0
    # worker w completes floor(10.01 / c_w) iterations: 200 + 100 + 50 + 25
    assert row["iterations"] == 375
    assert row["iterations_per_worker"] == {"min": 25, "max": 200}


@pytest.mark.parametrize("s", [0, 1, 3])
@pytest.mark.parametrize("engine", ["exact", "fast"])
def test_ssp_staleness_never_exceeds_s(s, engine):
    speeds = parse_speeds("groups:1x3,2.5x2,6x1", None, iter_time=0.02, seed=3)
    config = _config("ssp", staleness=s) if s else _config("bsp", "ps")
    row = simulate(config, speeds, CostModel(model_bytes=2e5), iterations=200, engine=engine)
    assert row["staleness"]["max"] == s
    # the fastest worker is held back to at most s iterations ahead of the slowest
    spread = row["iterations_per_worker"]["max"] - row["iterations_per_worker"]["min"]
    assert spread <= s + 1


@pytest.mark.parametrize("engine", ["exact", "fast"])
def test_dssp_stays_within_its_upper_bound_and_uses_it(engine):
    speeds = parse_speeds("groups:1x3,4x1", None, iter_time=0.02)
    config = _config("dssp", staleness_low=1, staleness_high=6)
    row = simulate(config, speeds, CostModel(model_bytes=2e5), iterations=300, engine=engine)
    assert row["staleness"]["max"] <= 6
    assert row["staleness"]["max"] > 1       # the controller granted extra iterations


@pytest.mark.parametrize("policy", ["bsp", "asp", "ssp", "dssp", "ebsp", "esync", "osp"])
def test_iterations_and_time_are_conserved(policy):
    n, K = 6, 120
    speeds = parse_speeds("lognormal:0.4", n, seed=5, jitter=0.05)
    rec = run_events(_config(policy), speeds, CostModel(model_bytes=1e6), iterations=K)
    assert rec.total_iterations == n * K == int(rec.iters.sum())
    # every worker is in exactly one phase at every moment
    np.testing.assert_allclose(rec.time.sum(axis=1), rec.sim_time, rtol=1e-9)


# The fast engines restate the policy objects' control flow around the kernels: with
# constant speeds they must reproduce the event engine (the policy objects) exactly.
@pytest.mark.parametrize("spec", ["lognormal:0.4", "groups:1x5,1.5x4,3x3"])
@pytest.mark.parametrize("policy", ["bsp", "osp", "esync", "ebsp", "asp", "ssp", "dssp"])
def test_fast_engine_equals_the_event_engine(policy, spec):
    n, K = 12, 150
    config = _config(policy)
    cost = CostModel(model_bytes=1e6, query=2e-4)
    fast = simulate(config, parse_speeds(spec, n, seed=2), cost, iterations=K, engine="fast")
    exact = simulate(config, parse_speeds(spec, n, seed=2), cost, iterations=K,
                     engine="exact")
    assert fast["engine"] == "fast" and exact["engine"] == "exact"
    assert fast["sim_time_s"] == pytest.approx(exact["sim_time_s"], rel=1e-9)
    assert fast["rounds"] == exact["rounds"]
    assert fast["iterations_per_worker"] == exact["iterations_per_worker"]
    assert fast["wait_fraction"] == pytest.approx(exact["wait_fraction"], abs=2e-3)
    assert fast["local_steps_per_round"]["mean"] == pytest.approx(
        exact["local_steps_per_round"]["mean"], rel=1e-2)
    if exact["staleness"]:
        assert fast["staleness"]["hist"] == exact["staleness"]["hist"]
    if policy in ("esync", "asp", "ssp", "dssp"):
        # the compiled event loops: every message the server handles, resets included
        assert fast["messages_per_s"] == pytest.approx(exact["messages_per_s"], rel=1e-9)


def test_fast_asp_equals_the_event_engine_when_push_counts_spread_past_the_histogram():
    # a 10x speed gap: the push counts spread over more values than the fast engine's first
    # histogram holds (1,024), so it runs again with a larger one and must still match
    config = _config("asp")
    cost = CostModel(model_bytes=1e6, query=2e-4)
    fast, exact = (simulate(config, parse_speeds("groups:1x2,10x2", 4, seed=2), cost,
                            iterations=1500, engine=engine) for engine in ("fast", "exact"))
    spread = fast["iterations_per_worker"]["max"] - fast["iterations_per_worker"]["min"]
    assert spread > 1024
    assert fast["engine"] == "fast"
    assert fast["iterations_per_worker"] == exact["iterations_per_worker"]
    assert fast["sim_time_s"] == pytest.approx(exact["sim_time_s"], rel=1e-12)
    assert fast["staleness"]["hist"] == exact["staleness"]["hist"]
    assert fast["messages_per_s"] == pytest.approx(exact["messages_per_s"], rel=1e-9)


@pytest.mark.parametrize("until", [{"iterations": 40}, {"duration": 30.0}])
def test_fast_bsp_on_the_ps_holds_a_step_until_every_worker_pulled_the_round(until):
    # 100 MB through one PS link, 10 ms iterations: a fast worker's next report comes in while
    # slower workers' pulls of the round still queue at the shard; BSP.decide_held holds its
    # SYNC until every reset of the round is in, and the fast engine must too
    config = _config("bsp", "ps")
    cost = CostModel(model_bytes=1e8, query=2e-4)
    rows = [simulate(config, parse_speeds("groups:1x5,1.5x4,3x3", 12, iter_time=0.01, seed=2),
                     cost, engine=engine, **until) for engine in ("fast", "exact")]
    fast, exact = rows
    assert fast["engine"] == "fast"
    assert fast["sim_time_s"] == pytest.approx(exact["sim_time_s"], rel=1e-12)
    assert fast["wait_fraction"] == pytest.approx(exact["wait_fraction"], rel=1e-9)
    assert fast["rounds"] == exact["rounds"]
    assert fast["messages_per_s"] == pytest.approx(exact["messages_per_s"], rel=1e-9)


def test_fast_engine_with_jitter_agrees_statistically():
    n, K = 16, 400
    cost = CostModel(model_bytes=1e6, query=2e-4)
    for policy in ("esync", "ebsp", "ssp"):
        a = simulate(_config(policy), parse_speeds("lognormal:0.3", n, seed=4, jitter=0.1),
                     cost, iterations=K, engine="fast")
        b = simulate(_config(policy), parse_speeds("lognormal:0.3", n, seed=4, jitter=0.1),
                     cost, iterations=K, engine="exact")
        assert a["samples_per_s"] == pytest.approx(b["samples_per_s"], rel=0.03), policy
        assert a["wait_fraction"] == pytest.approx(b["wait_fraction"], abs=0.03), policy


def test_esync_fast_workers_fill_the_slowest_iteration():
    # 0.1 s workers beside a 0.4 s one: Alg. 2 lets them run 3 local iterations per round
    # (a 4th would end after the slowest's report); the slowest runs one.
    speeds = parse_speeds("groups:1x3,4x1", None, iter_time=0.1)
    row = simulate(_config("esync"), speeds, CostModel(query=1e-3, fixed_aggregation=0.01),
                   iterations=200, engine="exact")
    hist = row["local_steps_per_round"]["hist"]
    rounds = row["rounds"]
    # round 1: everyone synchronizes at once (all capabilities start at 0); then 3 + 1
    assert hist == {"1": 4 + (rounds - 1), "3": 3 * (rounds - 1)}


def test_ring_cost_model():
    cost = CostModel(model_bytes=1e8, bandwidth=1e9, latency=1e-5)
    assert cost.ring(1) == 0.0
    assert cost.ring(4) == pytest.approx(2 * 3 / 4 * 0.1 + 6e-5)
    assert cost.link() == pytest.approx(0.1 + 1e-5)
    assert cost.push() == pytest.approx(0.1 + 1e-5 + 1e8 / cost.apply_rate)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_ps_shards_queue_pushes_and_pulls_and_apply_every_update(shards):
    # 8 workers with 1 ms iterations keep the shards busy: a BSP round is 8 pushes (receive
    # B/S and apply it) and 8 pulls (send B/S), one after another at each shard
    B, bw, apply = 1e7, 1e9, 4e9
    ps = CostModel(model_bytes=B, bandwidth=bw, latency=0.0, query=0.0, ps_shards=shards,
                   apply_rate=apply)
    t = [simulate(_config("bsp", "ps"), SpeedModel(np.full(8, 1e-3)), ps, iterations=k,
                  engine=engine)["sim_time_s"] for k in (20, 40) for engine in ("fast", "exact")]
    per_round = 8 * (B / shards / bw + B / shards / apply) + 8 * B / shards / bw
    assert (t[2] - t[0]) / 20 == pytest.approx(per_round, rel=1e-9)
    assert t[1] == pytest.approx(t[0], rel=1e-12) and t[3] == pytest.approx(t[2], rel=1e-12)


def test_ps_transfers_never_beat_the_workers_own_link():
    # as many shards as workers: the shards share the work, each worker's link is the limit
    B, bw = 1e7, 1e9
    ps = CostModel(model_bytes=B, bandwidth=bw, latency=0.0, query=0.0, ps_shards=64,
                   apply_rate=1e12)
    row = simulate(_config("asp"), SpeedModel(np.full(4, 1e-3)), ps, iterations=50)
    # per iteration: compute, a push and a pull of the whole model through the worker's link
    # (the run ends when the 50th iteration is computed, before its push)
    assert row["sim_time_s"] == pytest.approx(50 * 1e-3 + 49 * 2 * B / bw, rel=1e-9)
    with pytest.raises(ConfigError, match="ps_shards"):
        CostModel(ps_shards=0)
    with pytest.raises(ConfigError, match="apply_rate"):
        CostModel(apply_rate=0)


def test_speed_specs_and_their_errors(tmp_path):
    g = parse_speeds("groups:1x2,3x2", None, iter_time=0.1)
    np.testing.assert_allclose(g.base, [0.1, 0.1, 0.3, 0.3])
    assert np.isclose(parse_speeds("groups:1x2,3x2", 8).base, 0.3).sum() == 4  # proportions
    ln = parse_speeds("lognormal:0.3", 1000, iter_time=0.1, seed=1)
    assert np.median(ln.base) == pytest.approx(0.1, rel=0.05)
    sched = parse_speeds("const", 2, schedule="5:1,3")
    assert sched.time_of(1, 4.9) == pytest.approx(0.1) and sched.time_of(1, 5.0) == \
        pytest.approx(0.3)
    for bad, msg in [("groups:1x0", "count"), ("groups:ax2", "factor"), ("weibull:2", "unknown"),
                     ("lognormal:-1", "sigma"), ("groups:1x2,3x2", "at least")]:
        with pytest.raises(ConfigError, match=msg):
            parse_speeds(bad, 1 if msg == "at least" else None)
    with pytest.raises(ConfigError, match="metrics.json"):
        (tmp_path / "x.json").write_text("{}")
        parse_speeds(f"trace:{tmp_path / 'x.json'}", None)


def test_trace_speeds_are_the_runs_iteration_times(tmp_path):
    metrics = {"config": {"policy": "esync", "topology": "ring", "batch_size": 32},
               "wall_s": 10.0, "samples_per_s": 100.0, "wait_fraction": 0.2,
               "workers": {"0": {"compute_s": 5.0, "iterations": 100, "rounds": 50,
                                 "wait_s": 0.2, "aggregation_s": 0.5},
                           "1": {"compute_s": 8.0, "iterations": 40, "rounds": 50,
                                 "wait_s": 0.1, "aggregation_s": 1.5}},
               "server": {"events": [[0.05 * i + 0.001 * (i % 3), 1, "report", i]
                                     for i in range(30)]}}
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(metrics))
    sp = parse_speeds(f"trace:{path}", None)
    np.testing.assert_allclose(sp.base, [0.05, 0.2])
    assert sp.trace["aggregation_s"] == pytest.approx(0.01)   # the least-waiting worker's
    assert sp.trace["query_s"] == pytest.approx((0.002 + 0.0025) / 2)
    assert 0 < sp.jitter < 0.05
    assert parse_speeds(f"trace:{path}", 4).base.size == 4
    with pytest.raises(ConfigError, match="multiple"):
        parse_speeds(f"trace:{path}", 3)


def test_cli_json_rows(tmp_path):
    r = subprocess.run([PY, "-m", "mpsync.cli", "simulate", "--workers", "32,64", "--speeds",
                        "lognormal:0.3", "--policies", "bsp,ssp,esync", "--iterations", "50",
                        "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [(x["policy"], x["workers"]) for x in rows] == [
        (p, n) for n in (32, 64) for p in ("bsp", "ssp", "esync")]
    for x in rows:
        for key in ("wait_fraction", "samples_per_s", "iterations_per_s", "aggregation_fraction",
                    "rounds", "decisions_per_s", "local_steps_per_round", "staleness"):
            assert key in x
        assert x["iterations"] == x["workers"] * 50
    assert rows[1]["staleness"]["max"] <= 3 and rows[0]["staleness"] is None
    assert (tmp_path / "wait_fraction.png").read_bytes()[:4] == b"\x89PNG"
    assert "| esync | ring | 64 |" in (tmp_path / "table.md").read_text()


def test_cli_rejects_bad_input():
    r = subprocess.run([PY, "-m", "mpsync.cli", "simulate", "--workers", "8", "--iterations",
                        "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--iterations must be >= 1" in r.stderr
    r = subprocess.run([PY, "-m", "mpsync.cli", "simulate", "--workers", "8", "--policies",
                        "bsp,nope"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown policy 'nope'" in r.stderr
    r = subprocess.run([PY, "-m", "mpsync.cli", "simulate", "--workers", "8", "--bandwidth",
                        "10Q"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--bandwidth" in r.stderr
