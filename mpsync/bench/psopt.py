"""``mpsync bench psopt``: what a parameter-server shard spends on one push, with the workers'
optimizer (``ps_optimizer='worker'``: add the delta) or its own (``'server'``: an optimizer step
per push, or a merge per push and one step per round), beside the baseline the server's way
takes the work from: the worker's own ``torch.optim`` step on the whole model.  Then the
simulator (``mpsync simulate``'s cost model, with the rates just measured) says, per worker
count, how busy a shard is and what the workers get: where the server becomes the bottleneck
(ZipLine §6.2.2).

One process, no MPI: the shard's work is numpy on its range, the same code the shard thread
runs (:mod:`mpsync.server.shard_optimizer`, :class:`~mpsync.server.weights.WeightStore`).
Medians of interleaved repeats, after a warm-up.
"""

from __future__ import annotations

import argparse
import time

from mpsync.bench._timing import byte_sizes, report_json

__all__ = ["add_arguments", "run", "measure", "bottleneck_rows"]

# the small model of the latency targets and the 8.7 MB one of the allreduce benchmark
DEFAULT_SIZES = (64 * 1024, 8_700_000)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=None, help="model bytes, comma-separated (float32)")
    p.add_argument("--shards", type=int, default=2, help="shards the model is cut into")
    p.add_argument("--workers", default="4,8,16,32", help="worker counts for the simulation")
    p.add_argument("--iter-time", type=float, default=0.1, help="seconds per iteration (sim)")
    p.add_argument("--bandwidth", default="1.25G",
                   help="bytes/s per link (sim; 1.25G = 10 Gbit/s)")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timing per size")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)


def _median_ms(fns: dict, budget: float) -> dict:
    import numpy as np

    for f in fns.values():
        f()
    t0 = time.perf_counter()
    for f in fns.values():
        f()
    repeats = int(min(200, max(5, budget / max(time.perf_counter() - t0, 1e-6))))
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def measure(model_bytes: int, shards: int, workers: int, budget: float) -> dict:
    """Milliseconds per push on one shard's range (``model_bytes / shards``), each way, and
    the worker's own optimizer step on the whole model."""
    import numpy as np
    import torch

    from mpsync.server.shard_optimizer import OptimizerSettings, ServerUpdates
    from mpsync.server.weights import WeightStore

    torch.set_num_threads(1)
    n_model = model_bytes // 4
    n_range = max(1, n_model // shards)
    rng = np.random.default_rng(0)
    grad = rng.normal(size=n_range).astype(np.float32)
    weights = rng.normal(size=n_range).astype(np.float32)

    def store(scale):
        s = WeightStore(scale)
        s.init(weights)
        return s

    add, average = store(1.0), store(1.0 / workers)
    sgd = ServerUpdates(per_round=False)
    sgd.configure(OptimizerSettings(kind="sgd", lr=1e-6, momentum=0.9).to_array())
    adam = ServerUpdates(per_round=False)
    adam.configure(OptimizerSettings(kind="adam", lr=1e-6).to_array())
    rounds = ServerUpdates(per_round=True)
    rounds.configure(OptimizerSettings(kind="adam", lr=1e-6).to_array())
    w_sgd, w_adam, w_round = weights.copy(), weights.copy(), weights.copy()

    def round_of_pushes():
        for w in range(workers):
            rounds.take(w_round, grad, w)
        rounds.settle(w_round, None)

    param = torch.nn.Parameter(torch.from_numpy(rng.normal(size=n_model).astype(np.float32)))
    param.grad = torch.from_numpy(rng.normal(size=n_model).astype(np.float32))
    torch_sgd = torch.optim.SGD([param], lr=1e-6, momentum=0.9)
    torch_adam = torch.optim.Adam([param], lr=1e-6)
    ms = _median_ms({
        "shard_add_delta": lambda: add.apply(grad),
        "shard_add_scaled_delta": lambda: average.apply(grad),
        "shard_sgd_momentum_step": lambda: sgd.take(w_sgd, grad, 0),
        "shard_adam_step": lambda: adam.take(w_adam, grad, 0),
        "shard_adam_round": round_of_pushes,
        "worker_torch_sgd_momentum_step": torch_sgd.step,
        "worker_torch_adam_step": torch_adam.step,
    }, budget)
    ms["shard_adam_round"] /= workers     # per push: a merge and 1/n of a step
    range_bytes = n_range * 4
    return {"model_bytes": model_bytes, "shards": shards, "range_bytes": range_bytes,
            "workers_per_round": workers, "ms": ms,
            "shard_rates_bytes_per_s": {k: range_bytes / (v / 1e3) for k, v in ms.items()
                                        if k.startswith("shard_") and v > 0}}


def bottleneck_rows(model_bytes: float, shards: int, counts, iter_time: float,
                    bandwidth: float, apply_rate: float, optimizer_rate: float) -> list[dict]:
    """ASP on the PS, per worker count and ``ps_optimizer``: the simulated shard busy fraction
    and throughput with the measured rates (the cost model's table, mpsync.simulate)."""
    import numpy as np

    from mpsync.config import SyncConfig
    from mpsync.simulate import CostModel, SpeedModel, simulate

    from mpsync import policies

    # the policy whose pulls never wait (ASP): every push queues at the shards at once
    no_wait = next(s.name for s in policies.specs() if s.simulation_model("ps") == "no_wait")
    rows = []
    for n in counts:
        for mode in ("worker", "server"):
            cost = CostModel(model_bytes=model_bytes, bandwidth=bandwidth, latency=50e-6,
                             query=1e-4, ps_shards=shards, apply_rate=apply_rate,
                             optimizer_rate=optimizer_rate)
            row = simulate(SyncConfig(policy=no_wait, ps_optimizer=mode).validate(),
                           SpeedModel(np.full(n, iter_time)), cost, iterations=200)
            rows.append({"workers": n, "ps_optimizer": mode,
                         "iterations_per_s": row["iterations_per_s"],
                         "shard_busy_fraction": row["shard_busy_fraction"]})
    return rows


def run(args) -> int:
    from mpsync.simulate import parse_rate

    sizes = byte_sizes(args.sizes, DEFAULT_SIZES)
    counts = [int(x) for x in str(args.workers).split(",") if x.strip()]
    if args.shards < 1 or not counts or min(counts) < 1:
        raise SystemExit("--shards and --workers need integers >= 1")
    bandwidth = parse_rate(args.bandwidth, "--bandwidth")
    result = {"sizes": [], "simulated": {}}
    for size in sizes:
        m = measure(size, args.shards, max(counts[0], 2), args.budget)
        result["sizes"].append(m)
        rates = m["shard_rates_bytes_per_s"]
        result["simulated"][str(size)] = bottleneck_rows(
            size, args.shards, counts, args.iter_time, bandwidth,
            rates["shard_add_delta"], rates["shard_adam_step"])
    if report_json(result, args.out, "psopt.json", args.json):
        return 0
    for m in result["sizes"]:
        ms = m["ms"]
        print(f"model {m['model_bytes']} B, shard range {m['range_bytes']} B "
              f"({m['shards']} shards), ms per push:")
        for k, v in ms.items():
            print(f"  {k:32s} {v:9.4f}")
        rows = result["simulated"][str(m["model_bytes"])]
        print(f"  simulated ASP at {args.iter_time:g} s/iteration: workers, mode, "
              f"iterations/s, shard busy")
        for r in rows:
            print(f"    {r['workers']:4d} {r['ps_optimizer']:7s} {r['iterations_per_s']:9.1f} "
                  f"{r['shard_busy_fraction']:.3f}")
    return 0
