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
