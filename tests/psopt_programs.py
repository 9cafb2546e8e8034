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


def bsp_adam() -> None:
    """BSP on the PS with Adam (float64) and workers of unequal, jittery speeds, the learning
    rate lowered half-way (the new settings reach the shards with the next push); with the
    server's optimizer the model after 20 rounds is single-process Adam on the concatenated
    batch, with the workers' own optimizers it is the mean of per-worker Adam steps."""
    a = _args()
    mps.init(policy="bsp", topology="ps", backend="mpi", server="dedicated", deadline=60,
             ps_shards=int(a.get("ps_shards", 3)), ps_optimizer=a["ps_optimizer"])
    model = _model()
    opt = mps.DistributedOptimizer(_adam(model.parameters()),
                                   named_parameters=model.named_parameters())
    n, me = mps.size(), mps.rank()
    jitter = torch.Generator().manual_seed(7 + me)
    for step in range(STEPS):
        if step == STEPS // 2:
            opt.param_groups[0]["lr"] = LR_LATER
        x, y = _data(n * BATCH, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[me * BATCH:(me + 1) * BATCH]),
                                          y[me * BATCH:(me + 1) * BATCH]).backward()
        # a fast worker's next push races a slow worker's pull of the round
        time.sleep(0.002 * me + 0.01 * float(torch.rand(1, generator=jitter)))
        opt.step()
    local = mps.stats()["local"]
    state = sum(len(s) for s in opt.state.values())   # the worker's own Adam state
    mps.shutdown()
    final = _flat(model)
    ref = _reference_adam(n)
    print("RESULT " + json.dumps({
        "rank": me, "rounds": local["rounds"], "iterations": local["iterations"],
        "digest": _digest(final), "worker_state": state,
        "vs_adam": float((final - ref).abs().max() / ref.abs().max())}),
        flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
