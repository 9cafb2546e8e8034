"""Rank programs for tests/test_fidelity.py: the papers' algorithms on real ranks.

Each program prints one ``RESULT {...}`` JSON line per worker rank and raises on a wrong
answer (run through ``run_mpi("fidelity_programs:NAME", ...)``).
"""

from __future__ import annotations

import json
import sys
import time

import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402
from torch_programs import _args, _data, _flat, _model, _reference_sgd  # noqa: E402


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def esync_one_step_rounds() -> None:
    """ESync with a slack larger than any iteration (Alg. 2 line 9 always true once every
    device is in the round): every round is one local step on every worker, so with plain SGD
    and ε = 1 the model after ``steps`` rounds is single-process SGD on the concatenated batch
    -- on the ring (allreduce of deltas) and on the PS alike, but on the PS only if a pull
    waits for every delta of the round: worker 0 is 3x slower, so a fast worker's pull would
    otherwise miss its delta."""
    a = _args()
    # 80 ms iterations: far longer than a reset message takes, even on a loaded machine, so
    # every worker is back in the round before the next report (else one more local step).
    steps, batch, lr, base = int(a.get("steps", 6)), 4, 0.3, 0.08
    mps.init(policy="esync", topology=a["topology"], backend="mpi", server="dedicated",
             epsilon=1.0, esync_slack=100.0, deadline=60)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    n, me = mps.size(), mps.rank()
    for step in range(steps):
        x, y = _data(n * batch, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[me * batch:(me + 1) * batch]),
                                          y[me * batch:(me + 1) * batch]).backward()
        time.sleep(base * (3 if me == 0 else 1))
        opt.step()
    local = mps.stats()["local"]
    mps.shutdown()
    final = _flat(model)
    ref = _reference_sgd(steps, n, batch, lr, 0.0)
    _result(rank=me, topology=a["topology"], rounds=local["rounds"],
            iterations=local["iterations"], params=final.tolist(),
            vs_sgd=float((final - ref).abs().max() / ref.abs().max()))


def esync_delayed_ack_abort() -> None:
    """ESync §4.2: in delayed-ACK mode a READY that arrives while an iteration computes
    discards that iteration's update.  Each worker sums the updates it applied (plain SGD:
    -lr·g per applied step); every round averages the deltas (ε = 1), so the final global
    model must be w0 + mean over workers of those sums -- the discarded iterations' gradients
    must not be in it."""
    a = _args()
    rounds, lr = int(a.get("rounds", 6)), 0.1
    mps.init(policy="esync", topology="ring", backend="mpi", server="dedicated",
             esync_delayed_ack=True, deadline=60)
    model = _model()
    w0 = _flat(model).clone()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    me = mps.rank()
    applied = torch.zeros_like(w0)
    step = 0
    while opt.strategy.round < rounds:
        x, y = _data(8, seed=1000 * me + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.03 * (3 if me == 0 else 1))
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        aborted_before = opt.strategy.aborted
        opt.step()
        if opt.strategy.aborted == aborted_before:
            applied -= lr * g
        step += 1
    opt.synchronize()
    mean_applied = mps.allreduce(applied)
    aborted = opt.strategy.aborted
    mps.shutdown()
    final = _flat(model)
    err = float((final - (w0 + mean_applied)).abs().max() / mean_applied.abs().max())
    _result(rank=me, aborted=aborted, steps=step, rounds=rounds, rel_err=err)
    if err > 1e-9:
        raise AssertionError(f"the global model is not the average of the applied updates: {err}")


def bsp_rounds() -> None:
    """BSP with momentum SGD and workers of unequal, jittery speeds, on ``topology`` (and,
    on the PS, ``ps_shards``): the model after ``steps`` rounds must be single-process
    momentum SGD on the concatenated batch, on the ring (gradient average) and on the PS
    (the server averages the round's deltas; every pull reads the round's model) alike."""
    a = _args()
    steps, batch, lr, momentum = int(a.get("steps", 8)), 4, 0.2, 0.9
    options = {"ps_shards": a["ps_shards"]} if "ps_shards" in a else {}
    mps.init(policy="bsp", topology=a["topology"], backend="mpi", server="dedicated",
             deadline=60, **options)
    model = _model()
    opt = mps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        named_parameters=model.named_parameters())
    n, me = mps.size(), mps.rank()
    jitter = torch.Generator().manual_seed(7 + me)
    for step in range(steps):
        x, y = _data(n * batch, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[me * batch:(me + 1) * batch]),
                                          y[me * batch:(me + 1) * batch]).backward()
        # Unequal speeds with jitter: a fast worker's next push races a slow worker's pull.
        time.sleep(0.002 * me + 0.01 * float(torch.rand(1, generator=jitter)))
        opt.step()
    local = mps.stats()["local"]
    mps.shutdown()
    final = _flat(model)
    ref = _reference_sgd(steps, n, batch, lr, momentum)
    _result(rank=me, topology=a["topology"], rounds=local["rounds"],
            iterations=local["iterations"], params=final.tolist(),
            vs_sgd=float((final - ref).abs().max() / ref.abs().max()))


if __name__ == "__main__":
    globals()[sys.argv[1]]()
