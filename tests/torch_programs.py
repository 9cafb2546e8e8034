"""Rank programs for tests/test_torch*.py and tests/test_failures.py.

Run through the harness: ``run_mpi("torch_programs:NAME", np=N, args=[...])``, or as a script
(``run_mpi(str(PROGRAMS), args=["NAME", ...])``) when the program must rely on mpsync's own
abort hook rather than the harness's runner.  Each program checks its own result, prints one
``RESULT {...}`` JSON line per rank for the test to read, and raises on a wrong answer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402


def _args() -> dict:
    """``key=value`` command-line arguments."""
    out = {}
    for a in sys.argv[1:]:
        k, sep, v = a.partition("=")
        if sep:
            out[k] = v
    return out


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _init(**kw) -> None:
    """``mps.init`` (temporarily without a control plane while mpsync.server is absent)."""
    import importlib.util

    if importlib.util.find_spec("mpsync.server") is not None:
        mps.init(**kw)
        return
    from mpsync.config import SyncConfig
    from mpsync.torch import _runtime

    kw.pop("server", None)
    config = SyncConfig.from_options(server="colocated", **kw)
    world = MPI.COMM_WORLD
    ranks = list(range(world.Get_size()))
    ctx = _runtime.Context(config=config, world=world, control=world.Dup(), workers=world.Dup(),
                           server_rank=0, dedicated=False, worker_rank=world.Get_rank(),
                           world_ranks=ranks)
    _runtime._CONTEXT = ctx
    _runtime.install_abort_hooks(world, f"rank {world.Get_rank()}")
    _runtime._start_backend(ctx)


def _model(seed: int = 0, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8), torch.nn.Tanh(),
        torch.nn.Linear(8, 3)).to(dtype)


def _data(n: int, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _digest(t: torch.Tensor) -> str:
    """Bitwise fingerprint of a tensor (equal digests: identical parameters)."""
    import hashlib

    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())


def _reference_sgd(steps: int, workers: int, batch: int, lr: float, momentum: float):
    """Single-process SGD on the concatenated batch of all workers."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        x, y = _data(workers * batch, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return _flat(model)


def _train_shard(opt, model, steps: int, workers: int, batch: int, me: int) -> None:
    for step in range(steps):
        x, y = _data(workers * batch, seed=100 + step)
        xs, ys = x[me * batch:(me + 1) * batch], y[me * batch:(me + 1) * batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()


# -- BSP exactness --------------------------------------------------------------------------
def bsp_equals_single_process() -> None:
    """BSP on N workers (equal shards) == single-process SGD on the concatenated batch."""
    a = _args()
    backend = a.get("backend", "mpi")
    steps, batch, lr, momentum = 6, 5, 0.2, 0.9
    _init(policy="bsp", backend=backend, server=a.get("server", "dedicated"), deadline=30)
    model = _model()
    with torch.no_grad():  # workers start apart; broadcast_parameters must fix that
        for p in model.parameters():
            p.add_(0.01 * mps.rank())
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    mps.broadcast_optimizer_state(opt, root_rank=0)
    _train_shard(opt, model, steps, mps.size(), batch, mps.rank())
    ref = _reference_sgd(steps, mps.size(), batch, lr, momentum)
    mine = _flat(model)
    rel = _max_rel(mine, ref)
    stats = mps.stats()
    mps.shutdown()
    _result(backend=backend, rank=mps.rank(), size=mps.size(), max_rel=rel,
            params=_digest(mine), rounds=stats["local"]["rounds"],
            iterations=stats["local"]["iterations"])
    if rel > 1e-6:
        raise AssertionError(f"BSP differs from single-process SGD: max rel {rel:.3g}")


def bsp_backends_agree() -> None:
    """The same BSP run with the horovod and the mpi backend, in one job: identical results.

    Runs the mpi backend through the strategy directly on a second context (one process can
    hold only one ``mps.init``), so both use the same workers and the same data."""
    from mpsync.torch import _runtime
    from mpsync.torch.backends import MPIAggregator

    steps, batch, lr = 5, 4, 0.3
    _init(policy="bsp", backend="horovod", server="dedicated", deadline=30)
    ctx = _runtime.context()
    model_h = _model()
    opt_h = mps.DistributedOptimizer(torch.optim.SGD(model_h.parameters(), lr=lr),
                                     named_parameters=model_h.named_parameters())
    _train_shard(opt_h, model_h, steps, mps.size(), batch, mps.rank())
    mpi_ctx = _runtime.Context(
        config=ctx.config, world=ctx.world, control=ctx.control, workers=ctx.workers,
        server_rank=ctx.server_rank, dedicated=ctx.dedicated, worker_rank=ctx.worker_rank,
        world_ranks=ctx.world_ranks,
        backend=MPIAggregator(ctx.workers.Dup(), deadline=30.0, watch=None), client=None)
    model_m = _model()
    opt_m = mps.DistributedOptimizer(torch.optim.SGD(model_m.parameters(), lr=lr),
                                     named_parameters=model_m.named_parameters(),
                                     _context=mpi_ctx)
    _train_shard(opt_m, model_m, steps, mps.size(), batch, mps.rank())
    ref = _reference_sgd(steps, mps.size(), batch, lr, 0.0)
    h, m = _flat(model_h), _flat(model_m)
    mps.shutdown()
    _result(rank=mps.rank(), horovod_vs_mpi=_max_rel(h, m), horovod_vs_ref=_max_rel(h, ref),
            mpi_vs_ref=_max_rel(m, ref))
    if _max_rel(h, m) > 1e-6 or _max_rel(h, ref) > 1e-6 or _max_rel(m, ref) > 1e-6:
        raise AssertionError("backends disagree")


if __name__ == "__main__":
    # Script mode: ``python torch_programs.py NAME key=value ...``; no harness runner, so an
    # exception reaches mpsync's abort hook (installed by mps.init).
    globals()[sys.argv[1]]()
