"""The simulator runs each policy's own rules and worker steps (ElasticBSP's PS superstep,
ESync's capability test and delayed ACK, OSP's Alg. 1 schedule), costs the parameter server's
shards, and differs from BSP where the policy does.  Single process, seeded, seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpsync.config import SyncConfig
from mpsync.policies import default_topology
from mpsync.simulate import (CostModel, SpeedModel, TrainingModel, parse_speeds, run_events,
                             simulate)

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent


def _config(policy, topology=None, **kw):
    return SyncConfig(policy=policy, topology=topology or default_topology(policy), **kw)


def test_elasticbsp_on_the_ps_pushes_every_iteration_and_barriers_at_zipline():
    # ZipLine §6.2.5: a push and a pull every iteration within a superstep, the barrier's
    # pull held until every barrier push is in
    speeds = SpeedModel(np.array([0.05, 0.05, 0.1, 0.2]))
    rec = run_events(_config("ebsp", "ps"), speeds, CostModel(model_bytes=1e5, query=1e-3),
                     duration=6.0)
    supersteps = rec.policy_state["supersteps"]
    assert len(supersteps) >= 4 * 5
    for s in supersteps:      # every iteration of the superstep pushed
        assert s["pushes"] == s["barrier_iteration"] - _previous_barrier(supersteps, s)
    # a pull per push: the staleness histogram counts every pull
    assert rec.stale_hist.sum() >= rec.total_iterations - 4
    # and the barrier holds: a worker's barriers are the same supersteps as everyone's
    per_worker = [sum(1 for s in supersteps if s["worker"] == w) for w in range(4)]
    assert max(per_worker) - min(per_worker) <= 1
    # the fast worker runs more iterations per superstep than the slow one (not BSP)
    assert rec.iters[0] >= 3 * rec.iters[3]


def _previous_barrier(supersteps, s):
    earlier = [x["barrier_iteration"] for x in supersteps
               if x["worker"] == s["worker"] and x["superstep"] < s["superstep"]]
    return max(earlier, default=0)


@pytest.mark.parametrize("engine", ["exact", "fast"])
def test_esync_capability_test_holds_the_first_reply_until_the_slowest_reported(engine):
    # Alg. 1 lines 3-8: the fast workers' first report (k = 0) waits for the 1 s worker's
    c = np.array([0.1, 0.1, 0.1, 1.0])
    row = simulate(_config("esync"), SpeedModel(c), CostModel(query=1e-3,
                                                                  fixed_aggregation=0.01),
                   duration=1.05, engine=engine)
    # 3 fast workers wait ~0.9 s each for the server in 4 x 1.05 s of worker time
    assert row["server_wait_fraction"] == pytest.approx(3 * (1.0 + 1e-3 - 0.1) / (4 * 1.05),
                                                        abs=0.01)
    assert row["iterations"] == 4          # the capability test's iteration is the first one


def test_esync_delayed_ack_trains_through_replies_and_aborts_on_ready():
    speeds = parse_speeds("groups:1x3,4x1", None, iter_time=0.1)
    cost = CostModel(query=0.02, fixed_aggregation=0.01)
    normal = simulate(_config("esync"), speeds, cost, duration=20.0)
    speeds = parse_speeds("groups:1x3,4x1", None, iter_time=0.1)
    delayed = simulate(_config("esync", esync_delayed_ack=True), speeds, cost, duration=20.0)
    assert delayed["engine"] == "exact"     # the aborts need the event engine
    assert delayed["aborted_iterations"] > 0 and normal["aborted_iterations"] == 0
    # §4.2: no NOT-READY round trip to wait for
    assert delayed["server_wait_fraction"] < 0.2 * normal["server_wait_fraction"]


def test_osp_has_no_ics_in_epoch_one_then_follows_alg1():
    # 4 equal workers, 0.1 s iterations, a 100 MB model at 10 Gbit/s: Eq. 5's bound is
    # T_c / T_ring of the model (0.83), capped at 0.8; S(G^u) = (1 - 0.8^(e-1))·0.8 in epoch
    # e, in whole tenths of the model (10 layers)
    training = TrainingModel(epoch_iterations=20, loss_decay=0.2, layers=10)
    cost = CostModel(model_bytes=1e8, bandwidth=1.25e9, query=1e-4)
    speeds = SpeedModel(np.full(4, 0.1))
    rec = run_events(_config("osp"), speeds, cost, iterations=100, training=training)
    per_epoch = {e["epoch"]: e for e in rec.policy_state["metrics"]["osp_ics_fraction"]}
    assert per_epoch[1]["ics_fraction"] == 0.0
    for e in (2, 3, 4, 5):
        expected = np.floor((1 - 0.8 ** (e - 1)) * 0.8 * 10) / 10
        assert per_epoch[e]["ics_fraction"] == pytest.approx(expected), e
        assert per_epoch[e]["u_max"] == pytest.approx(0.8 * 1e8 / 4)
    # epoch 1 is BSP exactly; later epochs hide part of the allreduce under the compute
    bsp = run_events(_config("bsp"), SpeedModel(np.full(4, 0.1)), cost, iterations=20)
    osp = run_events(_config("osp"), SpeedModel(np.full(4, 0.1)), cost, iterations=20,
                     training=training)
    assert osp.sim_time == pytest.approx(bsp.sim_time, rel=1e-12)
    fast = simulate(_config("osp"), SpeedModel(np.full(4, 0.1)), cost, iterations=100,
                    training=training, engine="fast")
    assert fast["sim_time_s"] == pytest.approx(rec.sim_time, rel=1e-9)
    assert rec.sim_time < 100 / 20 * bsp.sim_time


def test_osp_bound_shrinks_with_the_link():
    # Eq. 5: U_max = b·T_c/N; a slower link, a smaller bound, a smaller ICS
    training = TrainingModel(epoch_iterations=10, loss_decay=0.5, layers=100)

    def ics(bandwidth):
        rec = run_events(_config("osp"), SpeedModel(np.full(4, 0.05)),
                         CostModel(model_bytes=1e8, bandwidth=bandwidth), iterations=40,
                         training=training)
        return rec.policy_state["metrics"]["osp_ics_fraction"][-1]["ics_fraction"]

    assert 0 < ics(0.25e9) < ics(1e9)


def test_a_change_to_a_policy_changes_the_simulation(monkeypatch):
    # the exact engine asks the server's own policy object: break SSP's bound there and the
    # simulated staleness follows
    from mpsync.server import policies as server_policies

    speeds = parse_speeds("groups:1x3,4x1", None, iter_time=0.02)
    cost = CostModel(model_bytes=2e5)
    row = simulate(_config("ssp", staleness=2), speeds, cost, iterations=100, engine="exact")
    assert row["staleness"]["max"] == 2
    monkeypatch.setattr(server_policies.SSP, "may_pull", lambda self, w: True)
    speeds = parse_speeds("groups:1x3,4x1", None, iter_time=0.02)
    row = simulate(_config("ssp", staleness=2), speeds, cost, iterations=100, engine="exact")
    assert row["staleness"]["max"] > 2


def test_sharding_the_ps_lifts_the_single_link_bound():
    # 64 workers, a 10 MB model, 10 Gbit/s links: one shard carries every push and pull,
    # 16 shards a sixteenth each
    cost1 = CostModel(model_bytes=1e7, ps_shards=1)
    cost16 = CostModel(model_bytes=1e7, ps_shards=16)
    speeds = dict(spec="lognormal:0.3", workers=64, iter_time=0.05, seed=1)
    one = simulate(_config("asp"), parse_speeds(**speeds), cost1, iterations=50, engine="fast")
    many = simulate(_config("asp"), parse_speeds(**speeds), cost16, iterations=50,
                    engine="fast")
    assert many["samples_per_s"] > 8 * one["samples_per_s"]
    assert one["wait_fraction"] > 0.9 > many["wait_fraction"]


def test_cli_exposes_every_policy_parameter_and_sweeps_shards(tmp_path):
    r = subprocess.run([PY, "-m", "mpsync.cli", "simulate", "--workers", "16",
                        "--policies", "dssp,esync,osp,asp", "--iterations", "20",
                        "--staleness-low", "1", "--staleness-high", "4",
                        "--esync-delayed-ack", "true", "--osp-ics-size", "fixed",
                        "--osp-ics-max-fraction", "0.5", "--ps-shards", "1,auto", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    by = {(x["policy"], x["ps_shards"]): x for x in rows}
    assert by[("dssp", 1)]["config"] == {"staleness_low": 1, "staleness_high": 4}
    assert by[("dssp", 1)]["staleness"]["max"] <= 4
    assert by[("esync", 1)]["config"]["esync_delayed_ack"] is True
    assert by[("osp", 1)]["config"]["osp_ics_size"] == "fixed"
    assert by[("asp", 16)]["samples_per_s"] > by[("asp", 1)]["samples_per_s"]
    bad = subprocess.run([PY, "-m", "mpsync.cli", "simulate", "--workers", "4",
                          "--ps-shards", "0"], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert bad.returncode == 2 and "--ps-shards" in bad.stderr
