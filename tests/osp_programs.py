"""Rank programs for tests/test_osp_bound.py: OSP's U_max (OSP paper §4.1.2, Eq. 5) measured on
real ranks, through the harness (``run_mpi("osp_programs:NAME", ...)``)."""

from __future__ import annotations

import json
import sys
import time

import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402


def _args() -> dict:
    return dict(a.partition("=")[::2] for a in sys.argv[1:] if "=" in a)


def measured_bound() -> None:
    """Workers whose compute takes ``base`` x their factor of ``speeds`` train OSP with the
    measured U_max over a link emulated at ``bandwidth`` bytes/s; each prints its U_max, the
    link rate and compute time it measured, and how many layers the server put in ICS."""
    a = _args()
    speeds = [float(x) for x in a.get("speeds", "1,1,2,4").split(",")]
    base, steps = float(a.get("base", 0.08)), int(a.get("steps", 16))
    mps.init(policy="osp", backend=a.get("backend", "mpi"), server="dedicated", deadline=60,
             comm_bandwidth=float(a["bandwidth"]))
    me = mps.rank()
    if mps.size() != len(speeds):
        raise SystemExit(f"speeds={speeds} names {len(speeds)} workers, {mps.size()} run")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4)
                                  for m in (torch.nn.Linear(512, 512), torch.nn.Tanh())])
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(me))
    for step in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        time.sleep(base * speeds[me])
        # Three "epochs" with a falling loss, so Alg. 1 opens ICS, sized by the measured bound.
        epoch = 1 + 3 * step // steps
        opt.strategy.note_progress(epoch, 1.0 / epoch)
        opt.step()
    s = opt.strategy
    out = {"rank": me, "speed": speeds[me], "u_max": s.u_max, "link_rate": s.link_rate,
           "compute_time": s.compute_time, "ics_layers": s.ics_layers_total}
    mps.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def momentum_conservation() -> None:
    """OSP with SGD momentum and most of the model in In-Computation Sync: once every ICS is
    corrected (Eq. 7, momentum buffer included), the model is the one momentum SGD makes from
    the workers' mean gradients, w_T = w_0 - lr Σ_i (1 - μ^(T-i+1)) / (1 - μ) · mean_i, with
    i = 1..T; a momentum buffer left holding a local gradient breaks it."""
    from torch_programs import _data, _flat, _model

    a = _args()
    steps, batch, lr, mu = int(a.get("steps", 24)), 4, 0.1, 0.9
    mps.init(policy="osp", backend=a.get("backend", "mpi"), server="dedicated", deadline=30,
             osp_ics_size="fixed", osp_ics_max_fraction=0.8)
    me, n = mps.rank(), mps.size()
    model = _model()
    w0 = _flat(model).clone()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=mu),
                                   named_parameters=model.named_parameters())
    grads = []
    for step in range(steps):
        x, y = _data(n * batch, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[me * batch:(me + 1) * batch]),
                                          y[me * batch:(me + 1) * batch]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        epoch = 1 + 3 * step // steps
        opt.strategy.note_progress(epoch, 1.0 / epoch)
        opt.step()
    ics_layers = opt.strategy.ics_layers_total
    opt.synchronize()
    mean = mps.allreduce(torch.stack(grads))
    weights = torch.tensor([(1 - mu ** (steps - i)) / (1 - mu) for i in range(steps)],
                           dtype=mean.dtype)
    expected = w0 - lr * (weights[:, None] * mean).sum(0)
    got = _flat(model)
    err = float((got - expected).abs().max() / (w0 - expected).abs().max())
    mps.shutdown()
    print("RESULT " + json.dumps({"rank": me, "ics_layers": ics_layers, "err": err}), flush=True)
