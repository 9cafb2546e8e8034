"""The plain-mpi4py ceiling of ASP on the sharded parameter server: `mpsync train --np 4 --model
wide-mlp --policy asp`'s compute and its exchange's bytes, and nothing else.

    mpirun -np 6 python raw_train.py SECONDS [SHARDS]    # 4 workers, then SHARDS shard ranks

Ranks 0-3 are workers: each iteration the wide MLP's forward, backward and torch's SGD step
with momentum on a digits batch of 32 (one thread, as compute_only.py), then Δ = w - base
(numpy, the parameters being views of one flat array), Δ's slices sent to the shards, the
shards' weights received straight into the parameters, and the base set to them: ASP's push
and pull, without a state server, a finiteness check, a header or a deadline.  The other
ranks (2 by default, as the job's two shards) each own a contiguous slice of the weights;
they receive a push from any worker (``MPI_Recv`` from any source), add it with numpy, and
send the sum back to that worker, until every worker has said it is done.  Shards are
processes here, threads of workers 0 and 1 in the job: the same cores either way.

Worker 0 prints the samples per second of the four workers together over the SECONDS after
the first iteration, which is what a `mpsync train` run's `samples_per_s` reads (its
evaluations excluded).  Whatever the framework adds to the exchange can only lower this.
"""

import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from mpsync.apps.datasets import load_dataset
from mpsync.apps.models import build_model

WORKERS = 4
PUSH, DONE = 1, 2


def slices(size: int, shards: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, size, shards + 1).astype(int)
    return list(zip(edges[:-1], edges[1:]))


def flat_params(model: torch.nn.Module) -> np.ndarray:
    """Every parameter rebound to its view of one flat float32 array (returned)."""
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    at = 0
    for p in params:
        n = p.numel()
        flat[at:at + n].copy_(p.data.reshape(-1))
        p.data = flat[at:at + n].view_as(p)
        at += n
    return flat.numpy()


def worker(comm, seconds: float, shards: int) -> None:
    torch.set_num_threads(1)
    data = load_dataset("digits")
    model = build_model(data.input_shape, data.n_classes, 0, "wide-mlp")
    w = flat_params(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    rng, samples = np.random.default_rng(comm.rank), 0
    parts = slices(w.size, shards)
    base, delta = w.copy(), np.empty_like(w)
    comm.Barrier()
    start = end = None
    while end is None or time.perf_counter() < end:
        i = int(rng.integers(0, len(y) - 32))
        opt.zero_grad()
        loss_fn(model(x[i:i + 32]), y[i:i + 32]).backward()
        opt.step()
        np.subtract(w, base, out=delta)
        reqs = [comm.Isend(delta[a:b], WORKERS + s, PUSH) for s, (a, b) in enumerate(parts)]
        reqs += [comm.Irecv(w[a:b], WORKERS + s, PUSH) for s, (a, b) in enumerate(parts)]
        MPI.Request.Waitall(reqs)
        base[:] = w
        if start is None:     # the clock starts after the first iteration (the JIT's, torch's
            start = time.perf_counter()       # first-call costs), as a job's start-up does
            end = start + seconds
        else:
            samples += 32
    elapsed = time.perf_counter() - start
    for s in range(shards):
        comm.Send(np.empty(0, np.float32), WORKERS + s, DONE)
    total = comm.reduce(samples / elapsed, root=0)
    if comm.rank == 0:
        print(f"{total:.0f}")


def shard(comm, shards: int) -> None:
    size = sum(p.numel() for p in build_model((64,), 10, 0, "wide-mlp").parameters())
    a, b = slices(size, shards)[comm.rank - WORKERS]
    model = build_model((64,), 10, 0, "wide-mlp")
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()[a:b].copy()
    delta, status, done = np.empty_like(weights), MPI.Status(), 0
    comm.Barrier()
    while done < WORKERS:
        comm.Recv(delta, MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        if status.Get_tag() == DONE:
            done += 1
            continue
        weights += delta
        comm.Send(weights, status.Get_source(), PUSH)
    comm.reduce(0.0, root=0)


def main(seconds: float, shards: int) -> None:
    comm = MPI.COMM_WORLD
    if comm.size != WORKERS + shards:
        sys.exit(f"run with mpirun -np {WORKERS + shards} ({WORKERS} workers, {shards} shards)")
    if comm.rank < WORKERS:
        worker(comm, seconds, shards)
    else:
        shard(comm, shards)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)
