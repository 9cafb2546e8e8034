"""Rank programs for tests/test_ps_server_optimizer.py: the parameter server running the
optimizer (``ps_optimizer='server'``) on real ranks.  Each prints one ``RESULT {...}`` line per
worker rank (run through ``run_mpi("psopt_programs:NAME", ...)``)."""

from __future__ import annotations

import json
import sys
import time

import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402
from torch_programs import _args, _data, _digest, _flat, _model  # noqa: E402

BATCH, STEPS, LR, LR_LATER, DECAY = 4, 20, 0.02, 0.005, 1e-3


def _adam(params):
    return torch.optim.Adam(params, lr=LR, betas=(0.9, 0.99), weight_decay=DECAY)


def _reference_adam(workers: int) -> torch.Tensor:
    """Single-process Adam on the concatenated batch of every worker, with the same
    learning-rate change half-way."""
    model = _model()
    opt = _adam(model.parameters())
    for step in range(STEPS):
        if step == STEPS // 2:
            opt.param_groups[0]["lr"] = LR_LATER
        x, y = _data(workers * BATCH, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return _flat(model)


def _after_a_push(limit_s: float = 60.0) -> None:
    """Wait until the state server has counted a push (it counts one once every shard has
    taken its slice)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if any(w["pushes"] for w in mps.stats()["server"]["workers"].values()):
            return
        time.sleep(0.01)
    raise TimeoutError(f"no push counted within {limit_s:g}s")


def _save_cut(opt, model, path: str) -> None:
    """Between two rounds, with every worker held: worker 0 saves what a checkpoint keeps of
    the PS (the global model, the shards' optimizer state)."""
    mps.worker_comm().Barrier()
    if mps.rank() == 0:
        opt.strategy.pull_global()
        torch.save({"model": model.state_dict(),
                    "shards": opt.strategy.server_optimizer_state()}, path)
    mps.worker_comm().Barrier()


def bsp_adam() -> None:
    """BSP on the PS with Adam (float64) and workers of unequal, jittery speeds, the learning
    rate lowered half-way (the new settings reach the shards with the next push); with the
    server's optimizer the model after 20 rounds is single-process Adam on the concatenated
    batch, with the workers' own optimizers it is the mean of per-worker Adam steps.
    ``start_late=1``: every worker but worker 0 takes its first step (which pulls the
    starting weights) only after worker 0's first push is on every shard.
    ``save=PATH``: after round 10 worker 0 writes the global model and the shards' optimizer
    state to PATH, as a checkpoint does; ``resume=PATH``: start from such a file at round 10
    (the shards continue its optimizer state) and run the remaining rounds."""
    a = _args()
    mps.init(policy="bsp", topology="ps", backend="mpi", server="dedicated", deadline=60,
             ps_shards=int(a.get("ps_shards", 3)), ps_optimizer=a["ps_optimizer"])
    model = _model()
    opt = mps.DistributedOptimizer(_adam(model.parameters()),
                                   named_parameters=model.named_parameters())
    n, me = mps.size(), mps.rank()
    jitter = torch.Generator().manual_seed(7 + me)
    start_late = a.get("start_late") == "1"
    first = 0
    if a.get("resume"):
        saved = torch.load(a["resume"], weights_only=False)
        model.load_state_dict(saved["model"])
        opt.param_groups[0]["lr"] = LR_LATER
        first = STEPS // 2
        if me == 0:
            opt.strategy.restore_server_optimizer(saved["shards"])
    for step in range(first, STEPS):
        if step == STEPS // 2 and a.get("save"):
            _save_cut(opt, model, a["save"])
        if step == STEPS // 2:
            opt.param_groups[0]["lr"] = LR_LATER
        x, y = _data(n * BATCH, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[me * BATCH:(me + 1) * BATCH]),
                                          y[me * BATCH:(me + 1) * BATCH]).backward()
        # a fast worker's next push races a slow worker's pull of the round
        time.sleep(0.002 * me + 0.01 * float(torch.rand(1, generator=jitter)))
        if step == 0 and me > 0 and start_late:
            _after_a_push()
        opt.step()
    local = mps.stats()["local"]
    state = sum(len(s) for s in opt.state.values())   # the worker's own Adam state
    mps.shutdown()
    final = _flat(model)
    ref = _reference_adam(n)
    print("RESULT " + json.dumps({
        "rank": me, "rounds": local["rounds"], "iterations": local["iterations"],
        "digest": _digest(final), "worker_state": state, "final": final.tolist(),
        "vs_adam": float((final - ref).abs().max() / ref.abs().max())}),
        flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
