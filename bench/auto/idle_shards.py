"""What hosting the parameter server's shards costs a ring run: ``auto`` held on BSP by its
plan, the shards hosted (idle threads, ``auto_ps``) or not, the same model and batches.

Run under mpirun with a dedicated server rank (``-np 5``: 4 workers), once with ``on`` and
once with ``off``; worker 0 prints one ``RESULT`` line with the samples per second of the
timed steps (after a warm-up of 20)::

    mpirun --allow-run-as-root --oversubscribe -np 5 python bench/auto/idle_shards.py on 8
"""

from __future__ import annotations

import json
import sys
import time

import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402


def main(shards: str, seconds: float) -> None:
    mps.init(policy="auto", topology="ring", backend="mpi", server="dedicated",
             auto_plan="1:bsp", auto_ps=shards == "on", deadline=120)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(mps.rank())
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    steps, t0 = 0, None
    while True:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps += 1
        if steps == 20:
            t0 = time.perf_counter()
        # Every worker stops after the same step (BSP): the first to see the time up decides.
        if steps > 20 and steps % 10 == 0:
            up = torch.tensor([float(time.perf_counter() - t0 >= seconds)])
            if float(mps.allreduce(up, op=mps.Sum)) > 0:
                break
    elapsed = time.perf_counter() - t0
    if mps.rank() == 0:
        print("RESULT " + json.dumps({"shards": shards, "steps": steps - 20,
                                      "samples_per_s": round((steps - 20) * 32 * mps.size()
                                                             / elapsed, 1)}), flush=True)
    mps.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
