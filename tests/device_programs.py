"""Rank programs for tests/test_device.py: the device paths' CPU twins on real ranks.

Each program prints ``RESULT {...}`` per worker (``run.results()``) and raises on a wrong
answer.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402


def _args() -> dict:
    return dict(a.partition("=")[::2] for a in sys.argv[1:] if "=" in a)


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def ps_staged() -> None:
    """A policy on the parameter server with the PS's device path forced on host parameters
    (``ParameterServer.staged``: the base beside the parameters, Δ computed there, one copy
    each way through a host buffer) or not; prints the final weights' digest."""
    from mpsync.torch.strategies.ps import ParameterServer

    a = _args()
    ParameterServer.staged = a.get("staged") == "1"
    mps.init(policy=a.get("policy", "bsp"), topology="ps", backend="mpi", server="dedicated",
             deadline=60)
    me = mps.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    for step in range(int(a.get("steps", 8))):
        g = torch.Generator().manual_seed(1000 * me + step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    staged = opt.strategy.staged
    mps.shutdown()   # the final aggregation: every worker ends with the same model
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    _result(rank=me, staged=staged,
            digest=hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16])
