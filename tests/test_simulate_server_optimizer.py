"""The simulator's costs of the parameter server's optimizer (``ps_optimizer``): a shard adds a
pushed delta (worker), runs an optimizer step per push (server: ASP, SSP, DSSP) or merges each
push and steps once per round (server: BSP); and the row's ``shard_busy_fraction``, which says
when the shards, not the workers, set the pace (ZipLine §6.2.2)."""

from __future__ import annotations

import numpy as np
import pytest

from mpsync.config import ConfigError, SyncConfig
from mpsync.simulate import CostModel, SpeedModel, simulate

B, BW, APPLY, OPT = 1e7, 1e9, 4e9, 5e8   # bytes, bytes/s


def _cost(**kw):
    return CostModel(**{"model_bytes": B, "bandwidth": BW, "latency": 0.0, "query": 0.0,
                        "apply_rate": APPLY, "optimizer_rate": OPT, **kw})


def test_a_shards_update_cost_per_mode():
    assert _cost().server_update() == pytest.approx(B / APPLY)
    assert _cost(ps_optimizer="server").server_update() == pytest.approx(B / OPT)
    assert _cost(ps_optimizer="server", round_pushes=4, ps_shards=2).server_update() == \
        pytest.approx(B / 2 / APPLY + B / 2 / OPT / 4)
    bsp = _cost().for_run(SyncConfig(policy="bsp", topology="ps", ps_optimizer="server"), 8)
    asp = _cost().for_run(SyncConfig(policy="asp", ps_optimizer="server"), 8)
    assert (bsp.round_pushes, bsp.ps_optimizer) == (8, "server")
    assert (asp.round_pushes, asp.ps_optimizer) == (1, "server")
    with pytest.raises(ConfigError, match="ps_optimizer"):
        CostModel(ps_optimizer="shard")
    with pytest.raises(ConfigError, match="optimizer_rate"):
        CostModel(optimizer_rate=0)


@pytest.mark.parametrize("engine", ["fast", "exact"])
def test_bsp_round_merges_every_push_and_steps_once(engine):
    n = 8
    config = SyncConfig(policy="bsp", topology="ps", ps_optimizer="server").validate()
    t = [simulate(config, SpeedModel(np.full(n, 1e-3)), _cost(), iterations=k,
                  engine=engine)["sim_time_s"] for k in (20, 40)]
    per_round = n * (B / BW + B / APPLY) + B / OPT + n * B / BW
    assert (t[1] - t[0]) / 20 == pytest.approx(per_round, rel=1e-9)


def test_the_server_optimizer_makes_the_shards_the_bottleneck_sooner():
    """ASP, 8 workers of 250 ms: adding deltas keeps one shard a third idle; an optimizer step
    per push saturates it, and throughput falls to what the shard can serve."""
    speeds = np.full(8, 0.25)
    rows = {mode: simulate(SyncConfig(policy="asp", ps_optimizer=mode).validate(),
                           SpeedModel(speeds), _cost(optimizer_rate=OPT / 2), iterations=200)
            for mode in ("worker", "server")}
    worker, server = rows["worker"], rows["server"]
    assert worker["ps_optimizer"] == "worker" and server["ps_optimizer"] == "server"
    assert worker["shard_busy_fraction"] < 0.9
    assert server["shard_busy_fraction"] > 0.98
    per_push = 2 * B / BW + B / (OPT / 2)      # a shard's time per iteration served
    assert server["iterations_per_s"] == pytest.approx(1 / per_push, rel=0.02)
    assert server["iterations_per_s"] < 0.8 * worker["iterations_per_s"]
    ring = simulate(SyncConfig(policy="bsp").validate(), SpeedModel(speeds), _cost(),
                    iterations=20)
    assert ring["shard_busy_fraction"] is None and ring["ps_optimizer"] is None


def test_the_simulate_command_takes_the_server_optimizer_where_a_policy_can_run_it():
    from mpsync.apps.simulate import _config

    class Args:
        topology = None
        ps_optimizer = "server"

    for name in ("staleness", "staleness_low", "staleness_high", "lookahead",
                 "zipline_variant", "epsilon", "esync_slack", "esync_delayed_ack",
                 "osp_ics_size", "osp_ics_max_fraction"):
        setattr(Args, name, None)
    assert _config(Args, "ssp").ps_optimizer == "server"
    assert _config(Args, "esync").ps_optimizer == "worker"    # local steps: its own optimizer
    assert _config(Args, "osp").ps_optimizer == "worker"      # ring


def test_bench_psopt_measures_every_way_and_feeds_the_rates_to_the_simulator():
    from mpsync.bench.psopt import bottleneck_rows, measure

    m = measure(4096, 2, 3, budget=0.05)
    assert set(m["ms"]) == {"shard_add_delta", "shard_add_scaled_delta",
                            "shard_sgd_momentum_step", "shard_adam_step", "shard_adam_round",
                            "worker_torch_sgd_momentum_step", "worker_torch_adam_step"}
    assert m["range_bytes"] == 2048 and all(v > 0 for v in m["ms"].values())
    rows = bottleneck_rows(1e7, 1, [2, 16], 0.05, 1e9, apply_rate=4e9, optimizer_rate=2e8)
    busy = {(r["workers"], r["ps_optimizer"]): r["shard_busy_fraction"] for r in rows}
    assert busy[2, "worker"] < busy[2, "server"] < 1.0
    assert busy[16, "server"] > 0.98
