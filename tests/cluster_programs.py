"""Rank programs for tests/test_cluster.py: Horovod-style training scripts (``import
mpsync.torch as mps``) run on the virtual cluster's nodes.

Run as scripts (``python cluster_programs.py NAME key=value ...``) so that what ends a failed
job is mpsync's own machinery.  Every rank prints ``HOST <world rank> <hostname>`` before
``mps.init`` (the dedicated server rank never returns from it); workers print one ``RESULT
{...}`` JSON line.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import torch
from mpi4py import MPI

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402


def _args() -> dict:
    out = {}
    for a in sys.argv[2:]:
        k, sep, v = a.partition("=")
        if sep:
            out[k] = v
    return out


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _digest(model) -> str:
    import hashlib

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.contiguous().numpy().tobytes()).hexdigest()[:16]


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 4))


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 16, generator=g)
    return x, (x[:, :4].argmax(dim=1))


def _start(a: dict, **init_kw):
    print(f"HOST {MPI.COMM_WORLD.Get_rank()} {socket.gethostname()}", flush=True)
    mps.init(policy=a.get("policy", "bsp"), topology=a.get("topology", "ring"),
             backend=a.get("backend", "mpi"), server="dedicated", **init_kw)
    model = _model(int(a.get("width", 64)))
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def _step(model, opt, seed: int) -> None:
    x, y = _batch(seed)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def train() -> None:
    """Unequal speeds (worker k sleeps (k+1) x ``iter_time`` per iteration).  Ring: until
    ``rounds`` aggregation rounds (workers may only stop together, at a round boundary, as
    ESync lets the fast ones take local steps); PS: ``steps`` iterations each.  After
    ``mps.shutdown`` every worker must hold the same model."""
    a = _args()
    model, opt = _start(a, deadline=60)
    me = mps.rank()
    rounds, steps = int(a.get("rounds", 10)), int(a.get("steps", 20))
    base = float(a.get("iter_time", 0.01))
    step = 0
    while (opt.strategy.round < rounds if a.get("topology", "ring") == "ring"
           else step < steps):
        time.sleep(base * (me + 1))
        _step(model, opt, 1000 * me + step)
        step += 1
    local = mps.stats()["local"]
    mps.shutdown()
    _result(rank=me, host=socket.gethostname(), iterations=local["iterations"],
            rounds=local["rounds"], digest=_digest(model))


def _cut_in_background(cluster: str, node: str) -> None:
    """Cut ``node``'s cable from a thread, so the cut lands wherever the training happens to
    be (as a real one does), not while this worker holds the others in a collective; prints
    ``FAULT <wall time>`` once the link is down, with the time the cut was started (an upper
    bound on the time from the cut to the end of the job)."""
    import threading

    def cut():
        started = time.time()
        subprocess.run([sys.executable, "-m", "mpsync.cli", "cluster", "--name", cluster,
                        "link", node, "--down"], check=True, stdout=subprocess.DEVNULL)
        print(f"FAULT {started:.6f}", flush=True)

    threading.Thread(target=cut, daemon=True).start()


def cut_link() -> None:
    """Train; after ``cut_at`` steps worker ``cutter`` cuts node ``victim``'s link with
    ``mpsync cluster link NODE --down`` (the switch is reachable from any node's shell, as an
    administrator's would be).  The job must then end by itself, with the configuration's
    default timeouts."""
    a = _args()
    model, opt = _start(a)
    me = mps.rank()
    cut_at, base = int(a.get("cut_at", 5)), float(a.get("iter_time", 0.05))
    for step in range(100_000):
        if step == cut_at and me == int(a.get("cutter", 0)):
            _cut_in_background(a["cluster"], a["victim"])
        time.sleep(base)
        _step(model, opt, 1000 * me + step)
    raise AssertionError("training went on for 100,000 steps after the link was cut")


def slow_link() -> None:
    """Ring training until ``rounds`` rounds; when worker ``cutter`` starts round ``slow_at``
    it lowers node ``victim``'s link to ``rate``.  The job must end normally; worker 0 prints
    the server's statistics (its event log holds every report and reset on the server clock)."""
    a = _args()
    model, opt = _start(a, deadline=60)
    me = mps.rank()
    rounds, slow_at = int(a.get("rounds", 16)), int(a.get("slow_at", 8))
    base = float(a.get("iter_time", 0.02))
    step, slowed = 0, False
    while opt.strategy.round < rounds:
        if not slowed and opt.strategy.round >= slow_at and me == int(a.get("cutter", 0)):
            subprocess.run([sys.executable, "-m", "mpsync.cli", "cluster", "--name",
                            a["cluster"], "link", a["victim"], "--bandwidth", a["rate"]],
                           check=True, stdout=subprocess.DEVNULL)
            slowed = True
            print(f"SLOWED {opt.strategy.round}", flush=True)
        time.sleep(base * (me + 1))
        _step(model, opt, 1000 * me + step)
        step += 1
    done, stats = opt.strategy.round, mps.stats()
    mps.shutdown()
    _result(rank=me, host=socket.gethostname(), rounds=done,
            server=stats["server"] if me == 0 else None, digest=_digest(model))


def horovod_sum() -> None:
    """Plain Horovod (no mpsync) under horovodrun: a sum over every rank, with each rank's
    hostname."""
    import horovod.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    print(f"HVD rank={hvd.rank()} size={hvd.size()} host={socket.gethostname()} "
          f"sum={total.item():g}", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
