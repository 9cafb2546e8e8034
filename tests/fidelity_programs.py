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
from torch_programs import _args, _data, _digest, _flat, _model, _reference_sgd  # noqa: E402


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def esync_straggler_rounds() -> None:
    """ESync with worker 0 three times slower (0.24 s against 0.08 s per iteration, slack 0):
    by Alg. 2 the fast workers keep training while the slowest is still computing (two or
    three local iterations a round, the slowest one), and every round averages the model
    deltas (ε = 1), so the global model must be w0 plus the mean over workers of every
    update each applied -- on the ring and on the PS alike (on the PS only if a pull waits
    for every delta of the round)."""
    a = _args()
    rounds, lr = int(a.get("rounds", 5)), 0.1
    mps.init(policy="esync", topology=a["topology"], backend="mpi", server="dedicated",
             epsilon=1.0, esync_slack=0.0, deadline=60)
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
        time.sleep(0.24 if me == 0 else 0.08)
        applied -= lr * torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        opt.step()
        step += 1
    opt.synchronize()
    mean_applied = mps.allreduce(applied)
    mps.shutdown()
    final = _flat(model)
    err = float((final - (w0 + mean_applied)).abs().max() / mean_applied.abs().max())
    _result(rank=me, topology=a["topology"], iterations=step, rel_err=err,
            digest=_digest(final))


def esync_delayed_ack_abort() -> None:
    """ESync §4.2: in delayed-ACK mode a READY that arrives while an iteration computes
    discards that iteration's update.  One worker (it is the slowest: every round's first
    report is READY, Alg. 2 line 9) with 0.2 s iterations, far longer than a reply takes: the
    READY to an iteration's report lands during the next iteration, which must be aborted and
    aggregate instead.  Each step is classified from the strategy's counters: "abort" (that
    iteration was discarded), "sync" (the READY was seen at the report itself, after the
    optimizer step: only if it arrived while that step ran, a sub-millisecond window, or if
    the abort rule were gone) or "local".  The model must be w0 plus exactly the updates of
    the iterations that were not aborted."""
    a = _args()
    rounds, lr = int(a.get("rounds", 4)), 0.1
    mps.init(policy="esync", topology="ring", backend="mpi", server="dedicated",
             esync_delayed_ack=True, deadline=60)
    model = _model()
    w0 = _flat(model).clone()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    me = mps.rank()
    applied = torch.zeros_like(w0)
    kinds = []
    while opt.strategy.round < rounds:
        x, y = _data(8, seed=1000 * me + len(kinds))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.2)
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        aborted, rnd = opt.strategy.aborted, opt.strategy.round
        opt.step()
        if opt.strategy.aborted > aborted:
            kinds.append("abort")
        else:
            applied -= lr * g
            kinds.append("sync" if opt.strategy.round > rnd else "local")
    opt.synchronize()
    mps.shutdown()
    final = _flat(model)
    err = float((final - (w0 + applied)).abs().max() / applied.abs().max())
    _result(rank=me, kinds=kinds, aborted=opt.strategy.aborted, rel_err=err)


def ebsp_ps_join() -> None:
    """ElasticBSP on the PS with uneven step counts: worker 2 stops after ``short`` steps and
    joins (its last push, then resets at its pace); workers 0 and 1 (10 and 20 ms per
    iteration) take ``steps``.  ZipLine must keep placing barriers over workers 0 and 1."""
    a = _args()
    steps, short = int(a.get("steps", 40)), int(a.get("short", 6))
    mps.init(policy="ebsp", topology="ps", backend="mpi", server="dedicated", lookahead=8,
             deadline=60)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    me = mps.rank()
    mine = short if me == 2 else steps
    for step in range(mine):
        x, y = _data(8, seed=1000 * me + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.02 if me == 1 else 0.01)
        opt.step()
    supersteps = [dict(s) for s in opt.strategy.supersteps]
    opt.synchronize()
    mps.shutdown()
    state = mps.stats()["server"]["policy_state"]
    _result(rank=me, steps=mine, supersteps=supersteps,
            plans=[p["workers"] for p in state["plans"]],
            targets=[p["target_iteration"] for p in state["plans"]])


def ebsp_ring_barrier_weights() -> None:
    """ElasticBSP on the ring: every worker holds the same weights right after every barrier,
    although the workers start from different weights (no broadcast_parameters) and train on
    different data at different speeds between barriers."""
    a = _args()
    rounds = int(a.get("rounds", 6))
    mps.init(policy="ebsp", topology="ring", backend="mpi", server="dedicated", lookahead=8,
             deadline=60)
    me = mps.rank()
    model = _model(seed=me)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    at_barrier, between, step = [], set(), 0
    while opt.strategy.round < rounds:
        x, y = _data(8, seed=1000 * me + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.01 * (3 if me == 2 else 1))
        rnd = opt.strategy.round
        opt.step()
        step += 1
        if opt.strategy.round > rnd:
            at_barrier.append(_digest(_flat(model)))
        else:
            between.add(_digest(_flat(model)))
    opt.synchronize()
    mps.shutdown()
    _result(rank=me, at_barrier=at_barrier, between=sorted(between), steps=step)


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
