"""``mpsync bench collectives --np N``: a script's collectives, mpsync against Horovod and plain
mpi4py.

Calls: ``allreduce`` (``op=Average``), ``allreduce_fp16`` (``Compression.fp16``),
``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` and ``grouped_reducescatter``, each at every size (bytes of each worker's
float32 input; default 4 KB, 64 KB, 1 MB, 16 MB, 64 MB; the grouped calls split it over
:data:`GROUP_PARTS` tensors), out of place.

One library per ``mpirun`` job, the jobs interleaved: ``--repeats`` rounds of an mpsync job
then a Horovod job.  Two libraries alive in one process measure each other: Horovod's
background thread enters MPI every cycle, and with it running a plain blocking 16 MB
``Allreduce`` on the main thread took 10.8 ms against 5.4 ms without it (np 2, same
machine, same minute) -- Horovod's own allreduce, measured inside that process, got 5.7 ms.
A user's script runs one library, so each job runs one, beside plain blocking mpi4py into a
preallocated buffer (no negotiation, no scaling: the floor) timed in the same job.

Per job, call and size: one warm-up call of each, then ``--calls-per-job`` calls, the library's
and mpi4py's alternating (a barrier before each), the slowest rank's median.  A row reports the
median over the rounds of those medians:

* ``mpsync_ms``: what ``mps.allreduce`` and the rest run
  (:class:`mpsync.torch._collectives.UserOps` and the data steps of
  :mod:`mpsync.torch._moves`: named negotiation with member 0, then the data step through the
  progress engine);
* ``horovod_ms``: Horovod 0.28's ``hvd.allreduce`` and the rest;
* ``mpi_ms``: plain mpi4py's ``Allreduce`` (also the floor for the fp16 and grouped
  allreduce), ``Allgather``, ``Bcast``, ``Alltoall``, ``Reduce_scatter_block``, from the
  mpsync jobs (``mpi_ms_hvd_job``: the same from the Horovod jobs).

``--loop N`` adds ``mpsync_loop_ms`` and ``horovod_loop_ms``: after a barrier, ``N`` calls
back to back, as a training loop makes them, the slowest rank's time divided by ``N``.  A call
timed alone measures its latency from a common start; back to back, what each call costs
every rank in CPU shows too (on ranks that share cores it is most of the time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mpsync.bench._timing import byte_sizes, timed

__all__ = ["add_arguments", "run", "DEFAULT_SIZES", "CALLS"]

KB, MB = 1 << 10, 1 << 20
DEFAULT_SIZES = (4 * KB, 64 * KB, 1 * MB, 16 * MB, 64 * MB)
CALLS = ("allreduce", "allreduce_fp16", "grouped_allreduce", "allgather", "grouped_allgather",
         "broadcast", "alltoall", "reducescatter", "grouped_reducescatter")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="worker ranks (default 2)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated bytes per worker (default 4 KB, 64 KB, 1 MB, 16 MB, "
                        "64 MB)")
    p.add_argument("--calls", default=",".join(CALLS),
                   help="comma-separated calls to time (default: all of " + ", ".join(CALLS)
                   + ")")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved rounds of an mpsync job and a Horovod job, at least 3 "
                        "(default 3)")
    p.add_argument("--calls-per-job", type=int, default=5,
                   help="timed calls per call and size in each job (default 5)")
    p.add_argument("--loop", type=int, default=0,
                   help="also time this many calls back to back per call and size (default "
                        "0: not)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", default=None, help="write collectives_npN.json into this dir")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")


def _job(args, library: str, sizes: list[int], calls: list[str]) -> dict:
    """One ``mpirun`` job timing ``library``: {(call, bytes): {"lib_ms", "mpi_ms"}}."""
    from mpsync.launch import mpirun_argv, python_argv, run_with_deadline

    argv = mpirun_argv(args.np, python_argv("mpsync.bench.collectives", "--child", library,
                                            ",".join(map(str, sizes)), ",".join(calls),
                                            str(args.calls_per_job), str(args.loop)),
                       forward_env=("OMP_NUM_THREADS", "PYTHONPATH"))
    res = run_with_deadline(argv, args.timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
        raise SystemExit(f"bench collectives ({library}, np={args.np}) failed: "
                         f"{'timeout' if res.timed_out else f'exit {res.returncode}'}")
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            out[(row["call"], row["bytes"])] = row
    return out


def run(args: argparse.Namespace) -> int:
    import numpy as np

    if args.np < 1:
        raise SystemExit(f"--np must be >= 1, got {args.np}")
    if args.repeats < 3:
        raise SystemExit(f"--repeats must be >= 3 (a median of fewer says little), got "
                         f"{args.repeats}")
    if args.loop < 0:
        raise SystemExit(f"--loop must be >= 0, got {args.loop}")
    if args.calls_per_job < 1:
        raise SystemExit(f"--calls-per-job must be >= 1, got {args.calls_per_job}")
    sizes = byte_sizes(args.sizes, DEFAULT_SIZES)
    calls = [c.strip() for c in args.calls.split(",") if c.strip()]
    unknown = sorted(set(calls) - set(CALLS))
    if unknown or not calls:
        raise SystemExit(f"--calls: unknown {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(CALLS)}")
    rounds = {"mpsync": [], "horovod": []}
    for _ in range(args.repeats):
        for library in rounds:
            rounds[library].append(_job(args, library, sizes, calls))

    def median(library, key, column):
        return float(np.median([r[key][column] for r in rounds[library]]))

    rows = []
    for nbytes in sizes:
        for call in calls:
            key = (call, nbytes)
            row = {"np": args.np, "call": call, "bytes": nbytes, "rounds": args.repeats,
                   "calls_per_job": args.calls_per_job,
                   "mpsync_ms": median("mpsync", key, "lib_ms"),
                   "horovod_ms": median("horovod", key, "lib_ms"),
                   "mpi_ms": median("mpsync", key, "mpi_ms"),
                   "mpi_ms_hvd_job": median("horovod", key, "mpi_ms")}
            if args.loop:
                row["mpsync_loop_ms"] = median("mpsync", key, "loop_ms")
                row["horovod_loop_ms"] = median("horovod", key, "loop_ms")
                row["loop_mpsync_vs_horovod"] = row["mpsync_loop_ms"] / row["horovod_loop_ms"]
            row["mpsync_vs_horovod"] = row["mpsync_ms"] / row["horovod_ms"]
            row["mpsync_vs_mpi"] = row["mpsync_ms"] / row["mpi_ms"]
            rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"collectives_np{args.np}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    cols = ("call", "bytes", "mpsync_ms", "horovod_ms", "mpi_ms", "mpsync_vs_horovod",
            "mpsync_vs_mpi") + (("mpsync_loop_ms", "horovod_loop_ms",
                                 "loop_mpsync_vs_horovod") if args.loop else ())
    print("  ".join(f"{c:>21}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>21.4g}" if isinstance(r[c], float) else f"{r[c]:>21}"
                        for c in cols))
    return 0


# -- rank side ---------------------------------------------------------------------------------
GROUP_PARTS = 4  # the grouped calls split each size over this many tensors


def _methods(library: str, lib, plain, rank: int, size: int, nbytes: int) -> dict:
    """call -> {"lib_ms": one call of ``library``'s, "mpi_ms": plain mpi4py's} for one size;
    ``lib``: mpsync's :class:`UserOps`, or ``horovod.torch``."""
    import numpy as np
    import torch
    from mpi4py import MPI

    n = max(size * GROUP_PARTS, nbytes // 4 // (size * GROUP_PARTS) * size * GROUP_PARTS)
    t = torch.full((n,), float(rank + 1))
    parts = list(t.view(GROUP_PARTS, -1).clone().unbind(0))
    rows2d = torch.full((1, n), float(rank))
    parts2d = [p.view(1, -1) for p in parts]
    src, out = t.numpy(), np.empty(n, dtype=np.float32)
    gathered = np.empty(n * size, dtype=np.float32)
    scattered = np.empty(n // size, dtype=np.float32)
    plain_calls = {
        "allreduce": lambda: plain.Allreduce(src, out, op=MPI.SUM),
        "allgather": lambda: plain.Allgather(src, gathered),
        "broadcast": lambda: plain.Bcast(src, root=0),
        "alltoall": lambda: plain.Alltoall(src, out),
        "reducescatter": lambda: plain.Reduce_scatter_block(src, scattered, op=MPI.SUM),
    }
    if library == "horovod":
        hvd = lib
        calls = {
            "allreduce": lambda: hvd.allreduce(t, op=hvd.Average, name="ar"),
            "allreduce_fp16": lambda: hvd.allreduce(t, op=hvd.Average, name="arh",
                                                    compression=hvd.Compression.fp16),
            "grouped_allreduce": lambda: hvd.grouped_allreduce(parts, op=hvd.Average,
                                                               name="gar"),
            "allgather": lambda: hvd.allgather(rows2d, name="ag"),
            "grouped_allgather": lambda: hvd.grouped_allgather(parts2d, name="gag"),
            "broadcast": lambda: hvd.broadcast(t, 0, name="bc"),
            "alltoall": lambda: hvd.alltoall(t, name="a2a"),
            "reducescatter": lambda: hvd.reducescatter(t, op=hvd.Average, name="rs"),
            "grouped_reducescatter": lambda: hvd.grouped_reducescatter(parts, op=hvd.Average,
                                                                       name="grs"),
        }
    else:
        from mpsync.torch import _moves, mpi_ops
        from mpsync.torch._collectives import Average
        from mpsync.torch.dataplane.compression import Compression

        ops = lib
        calls = {
            "allreduce": lambda: _moves.start_allreduce(ops, t, Average, 1.0, 1.0, None,
                                                        "ar").wait(),
            "allreduce_fp16": lambda: _moves.start_allreduce(ops, t, Average, 1.0, 1.0,
                                                             Compression.fp16, "arh").wait(),
            "grouped_allreduce": lambda: mpi_ops.start_grouped_allreduce(
                ops, parts, Average, 1.0, 1.0, None, "gar", False).wait(),
            "allgather": lambda: _moves.start_allgather(ops, rows2d, "ag").wait(),
            "grouped_allgather": lambda: mpi_ops.start_grouped_allgather(ops, parts2d,
                                                                         "gag").wait(),
            "broadcast": lambda: _moves.start_broadcast(ops, t, 0, "bc").wait(),
            "alltoall": lambda: _moves.start_alltoall(ops, t, None, "a2a").wait(),
            "reducescatter": lambda: mpi_ops.start_reducescatter(ops, t, Average, 1.0, 1.0,
                                                                 None, "rs").wait(),
            "grouped_reducescatter": lambda: mpi_ops.start_grouped_reducescatter(
                ops, parts, Average, 1.0, 1.0, None, "grs").wait(),
        }
    return {call: {"lib_ms": fn, "mpi_ms": plain_calls[_FLOOR.get(call, call)]}
            for call, fn in calls.items()}


# the plain mpi4py call each one is held against
_FLOOR = {"allreduce_fp16": "allreduce", "grouped_allreduce": "allreduce",
          "grouped_allgather": "allgather", "grouped_reducescatter": "reducescatter"}


def _back_to_back(comm, fn, count: int) -> float:
    """ms per call of ``count`` calls of ``fn`` back to back after a barrier, slowest rank."""
    import time

    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    return 1e3 * comm.allreduce((time.perf_counter() - t0) / count, op=MPI.MAX)


def _child(library: str, sizes: list[int], calls: list[str], repeats: int,
           loop: int = 0) -> None:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if library == "horovod":
        import horovod.torch as lib

        lib.init(comm=world)
    else:
        from mpsync.torch._collectives import UserOps

        lib = UserOps(world.Dup(), 600.0)
    plain = world.Dup()
    for nbytes in sizes:
        methods = _methods(library, lib, plain, rank, size, nbytes)
        for call in calls:
            row = {"call": call, "bytes": nbytes}
            # budget 1e9: exactly ``repeats`` interleaved calls after one warm-up call each
            row.update(timed(world, methods[call], repeats, 1e9))
            if loop:
                row["loop_ms"] = _back_to_back(world, methods[call]["lib_ms"], loop)
            if rank == 0:
                print("ROW " + json.dumps(row), flush=True)
        del methods
    if library == "horovod":
        lib.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--child" and sys.argv[2] in ("mpsync", "horovod"):
        _child(sys.argv[2], [int(s) for s in sys.argv[3].split(",")], sys.argv[4].split(","),
               int(sys.argv[5]), int(sys.argv[6]))
    else:
        raise SystemExit("usage: mpsync bench collectives --np N [--sizes ...] (the --child "
                         "form is for the ranks mpirun starts)")
