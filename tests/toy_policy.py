"""A policy defined outside mpsync, the way a user adds one: "synchronize every K-th iteration"
on the ring (local SGD with periodic model averaging).

Importing this module registers the policy; ``MPSYNC_PLUGINS=toy_policy`` makes every rank
import it before its configuration is validated.  Nothing in mpsync names it.

``train_ring`` is the rank program of tests/testpolicies.py (run through the harness).
"""

from __future__ import annotations

import hashlib
import json

from mpsync import policies
from mpsync.server import LOCAL, SYNC, Policy

NAME = "every3"
EVERY = 3


class SyncEveryK(Policy):
    """Every worker synchronizes after local iterations K, 2K, ...: the same iterations for
    all, so every worker gets SYNC in the same round and the ring's collectives match."""

    def on_step(self, w, k, compute, now):
        if k % EVERY == 0:
            return SYNC, 0, 0
        return LOCAL, EVERY - k % EVERY, 0


policies.register(
    NAME, description=f"every {EVERY}th iteration (a test's toy policy)",
    server=f"{__name__}:SyncEveryK",
    strategies={"ring": "mpsync.torch.strategies:DeltaAveraging"})


def train_ring() -> None:
    """Workers with different data: after a SYNC every replica is the same model, after a
    local step they differ; rounds = iterations // K."""
    import torch

    import mpsync.torch as mps

    torch.set_num_threads(1)
    mps.init(policy=NAME, server="dedicated", deadline=30)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    me, comm = mps.rank(), mps.worker_comm()
    g = torch.Generator().manual_seed(100 + me)
    equal_after = []
    for _ in range(2 * EVERY + 1):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        digests = comm.allgather(_digest(model))
        equal_after.append(len(set(digests)) == 1)
    local = mps.stats()["local"]
    server = mps.stats()["server"]
    rounds = opt.strategy.round   # before shutdown's final aggregation
    mps.shutdown()
    final = comm.allgather(_digest(model))
    print("RESULT " + json.dumps({
        "rank": me, "equal_after_step": equal_after, "iterations": local["iterations"],
        "rounds": rounds, "server_policy": server.get("policy"),
        "final_equal": len(set(final)) == 1}), flush=True)


def _digest(model) -> str:
    import torch

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()
