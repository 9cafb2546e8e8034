"""``mpsync bench collectives --np N``: a script's collectives, mpsync against Horovod and plain
mpi4py, in one ``mpirun`` job.

Per call (``allreduce``, ``allgather``, ``broadcast``) and size (bytes of each worker's
float32 input, default 4 KB, 64 KB, 1 MB, 16 MB), interleaved in every repeat (a barrier
before each call, so background load hits all three alike) and reported as the median over
repeats of the slowest rank's time:

* ``mpsync_ms``: what ``mps.allreduce`` / ``mps.allgather`` / ``mps.broadcast`` run
  (:class:`mpsync.torch._collectives.UserOps` and the data steps of
  :mod:`mpsync.torch._moves`: named negotiation with member 0, then the data step through the
  progress engine), out of place, ``op=Average`` for the allreduce;
* ``horovod_ms``: Horovod 0.28's ``hvd.allreduce`` / ``hvd.allgather`` / ``hvd.broadcast``
  (out of place), initialised in the same processes on the same communicator;
* ``mpi_ms``: plain blocking mpi4py ``Allreduce`` / ``Allgather`` / ``Bcast`` into a
  preallocated buffer (no scaling, no negotiation): the floor.

Both libraries are alive for the whole job (Horovod's background thread runs its cycle the
whole time), so every column pays for it alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mpsync.bench._timing import byte_sizes, timed

__all__ = ["add_arguments", "run", "DEFAULT_SIZES", "CALLS"]

KB, MB = 1 << 10, 1 << 20
DEFAULT_SIZES = (4 * KB, 64 * KB, 1 * MB, 16 * MB)
CALLS = ("allreduce", "allgather", "broadcast")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="worker ranks (default 2)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated bytes per worker (default 4 KB, 64 KB, 1 MB, 16 MB)")
    p.add_argument("--repeats", type=int, default=7,
                   help="interleaved repeats per point, at least 3 (default 7)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", default=None, help="write collectives_npN.json into this dir")
    p.add_argument("--timeout", type=float, default=900.0)


def run(args: argparse.Namespace) -> int:
    from mpsync.launch import mpirun_argv, python_argv, run_with_deadline

    if args.np < 1:
        raise SystemExit(f"--np must be >= 1, got {args.np}")
    if args.repeats < 3:
        raise SystemExit(f"--repeats must be >= 3 (a median of fewer says little), got "
                         f"{args.repeats}")
    sizes = byte_sizes(args.sizes, DEFAULT_SIZES)
    argv = mpirun_argv(args.np, python_argv("mpsync.bench.collectives", "--child",
                                            ",".join(map(str, sizes)), str(args.repeats)),
                       forward_env=("OMP_NUM_THREADS", "PYTHONPATH"))
    res = run_with_deadline(argv, args.timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
        raise SystemExit(f"bench collectives (np={args.np}) failed: "
                         f"{'timeout' if res.timed_out else f'exit {res.returncode}'}")
    rows = [json.loads(line[4:]) for line in res.stdout.splitlines() if line.startswith("ROW ")]
    for row in rows:
        row["np"] = args.np
        row["mpsync_vs_horovod"] = row["mpsync_ms"] / row["horovod_ms"]
        row["mpsync_vs_mpi"] = row["mpsync_ms"] / row["mpi_ms"]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"collectives_np{args.np}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    cols = ("call", "bytes", "mpsync_ms", "horovod_ms", "mpi_ms", "mpsync_vs_horovod",
            "mpsync_vs_mpi")
    print("  ".join(f"{c:>17}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>17.4g}" if isinstance(r[c], float) else f"{r[c]:>17}"
                        for c in cols))
    return 0


# -- rank side ---------------------------------------------------------------------------------
def _child(sizes: list[int], repeats: int) -> None:
    import horovod.torch as hvd
    import numpy as np
    import torch
    from mpi4py import MPI

    from mpsync.torch import _moves
    from mpsync.torch._collectives import Average, UserOps

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    ops = UserOps(world.Dup(), 600.0)
    hvd.init(comm=world)
    plain = world.Dup()
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        t = torch.full((n,), float(rank + 1))
        rows2d = torch.full((1, n), float(rank))
        out = np.empty(n, dtype=np.float32)
        gathered = np.empty(n * size, dtype=np.float32)
        src = t.numpy()
        methods = {
            "allreduce": {
                "mpsync_ms": lambda: _moves.start_allreduce(ops, t, Average, 1.0, 1.0, None,
                                                            "ar").wait(),
                "horovod_ms": lambda: hvd.allreduce(t, op=hvd.Average, name="ar"),
                "mpi_ms": lambda: plain.Allreduce(src, out, op=MPI.SUM),
            },
            "allgather": {
                "mpsync_ms": lambda: _moves.start_allgather(ops, rows2d, "ag").wait(),
                "horovod_ms": lambda: hvd.allgather(rows2d, name="ag"),
                "mpi_ms": lambda: plain.Allgather(src, gathered),
            },
            "broadcast": {
                "mpsync_ms": lambda: _moves.start_broadcast(ops, t, 0, "bc").wait(),
                "horovod_ms": lambda: hvd.broadcast(t, 0, name="bc"),
                "mpi_ms": lambda: plain.Bcast(src, root=0),
            },
        }
        for call in CALLS:
            row = {"call": call, "bytes": nbytes, "repeats": repeats}
            # budget 1e9: exactly ``repeats`` interleaved repeats after one warm-up round
            row.update(timed(world, methods[call], repeats, 1e9))
            if rank == 0:
                print("ROW " + json.dumps(row), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child([int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]))
    else:
        raise SystemExit("usage: mpsync bench collectives --np N [--sizes ...] (the --child "
                         "form is for the ranks mpirun starts)")
