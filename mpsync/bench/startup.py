"""``mpsync bench startup [--np N] [--rounds K] [--cluster [NAME]] [--json]``: seconds from
``mpirun`` to the first iteration, against the floor, in the same run.

Each round launches, one after the other and interleaved (the machine's load drifts), with
the same ``mpirun`` options and ``--np`` ranks (workers plus the dedicated server rank):

* ``floor``: a script that only imports torch, numba and mpi4py, then meets the other ranks
  in a barrier: what any such job pays before its first line of work;
* ``torch_step``: the floor plus what a PyTorch script does before its first step without
  mpsync (the same model built, one SGD step: torch imports its compiler stack, ``_dynamo``,
  the first time an optimizer is made);
* ``horovod_script``: a Horovod-style script on ``mpsync.torch`` (``init``,
  ``DistributedOptimizer``, ``broadcast_parameters``), until its first step is done;
* ``mpsync_train``: ``mpsync train`` (the demo's job, 1 s of training), until training
  begins (``train_start_clock`` in its metrics), and to its end (``total_s``).

Each time is taken by the launcher: from just before ``mpirun`` starts to the moment the
program reports (a ``time.time()`` printed by rank 1, or the metrics).  Reported per
program: min/median/max over the rounds, and each median over the floor's.

``--cluster`` starts every program on the virtual cluster's nodes instead (placed as
``mpsync train --cluster`` places them, ``--cluster-placement``): the fresh start that a
restart on that cluster is to be compared with, since each launch there also goes through
the cluster's agent into the nodes' namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mpsync import policies
from mpsync.launch.cluster import add_cluster_arguments, cluster_mpirun_argv

__all__ = ["add_arguments", "run"]

_FLOOR = """
import time, torch, numba
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.Get_rank() == 1:
    print("FIRST", time.time(), flush=True)
"""

# Without mpsync: the demo's model and one optimizer step on every rank.
_TORCH_STEP = """
import time, torch, numba
from mpi4py import MPI
from mpsync.apps.models import build_model
torch.set_num_threads(1)
model = build_model((1, 8, 8), 10, 0, "auto")
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loss = torch.nn.functional.cross_entropy(model(torch.zeros(32, 1, 8, 8)),
                                         torch.zeros(32, dtype=torch.long))
loss.backward()
opt.step()
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.Get_rank() == 1:
    print("FIRST", time.time(), flush=True)
"""

# A Horovod script with its import line changed (the floor's imports, then mpsync.torch).
_HOROVOD = """
import time, torch, numba
from mpi4py import MPI
import mpsync.torch as hvd
from mpsync.apps.models import build_model
hvd.init(server="dedicated")   # the defaults: the baseline policy
torch.set_num_threads(1)
model = build_model((1, 8, 8), 10, 0, "auto")
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
loss = torch.nn.functional.cross_entropy(model(torch.zeros(32, 1, 8, 8)),
                                         torch.zeros(32, dtype=torch.long))
loss.backward()
opt.step()
if hvd.rank() == 0:
    print("FIRST", time.time(), flush=True)
hvd.shutdown()
"""

PROGRAMS = ("floor", "torch_step", "horovod_script", "mpsync_train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--np", type=int, default=5,
                        help="ranks: the demo's 4 workers + 1 server rank (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--programs", default=",".join(PROGRAMS),
                        help=f"which to launch, comma-separated (default all: "
                             f"{','.join(PROGRAMS)}; the ratios need floor)")
    add_cluster_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")


# ``mpsync train``'s start-up, part by part (``startup_clock`` in its metrics, the order the
# parts end in; ``process`` is the exec of worker 0's process): what a restart is compared
# with, part for part (``bench/elastic/fault_matrix.py``'s ``restart_parts``).
TRAIN_PARTS = ("process", "main", "checkpoint_read", "torch_imported", "data_and_model", "init",
               "ready")


def _parts(clock: dict, start: float) -> dict:
    """Seconds of each part of ``mpsync train``'s start-up, from ``start`` (``mpirun``);
    ``process`` is called ``launch`` (mpirun to worker 0's exec), as in a restart's table."""
    parts, prev = {}, start
    for name in TRAIN_PARTS:
        at = clock.get(name)
        if at is not None:
            parts["launch" if name == "process" else name] = at - prev
            prev = at
    return parts


def _launch(program: str, np_: int, work: Path, timeout: float, cluster: str | None = None,
            placement: str = "server-alone") -> tuple[float, float, dict]:
    """(seconds to the first iteration, seconds to the end, ``mpsync train``'s start-up parts
    or {}) of one launch (on this host, or on the virtual cluster ``cluster``)."""
    from mpsync.launch.mpirun import python_argv, run_with_deadline

    env = dict(os.environ, OMP_NUM_THREADS="1")
    if program == "mpsync_train":
        out = work / "train"
        command = python_argv("mpsync.apps.train", "--policy", policies.baseline().name,
                              "--time-budget", "1",
                              "--out", str(out), "--no-progress", "--slowdown", "",
                              "--iter-time", "0.05")
    else:
        script = work / f"{program}.py"
        script.write_text({"floor": _FLOOR, "torch_step": _TORCH_STEP,
                           "horovod_script": _HOROVOD}[program])
        command = [sys.executable, str(script)]
    argv = cluster_mpirun_argv(np_, command, cluster, placement=placement,
                               forward_env=("PYTHONPATH", "OMP_NUM_THREADS"))
    start = time.time()
    res = run_with_deadline(argv, timeout, env=env)
    end = time.time()
    if res.returncode != 0:
        raise RuntimeError(f"{program}: mpirun failed ({'timed out' if res.timed_out else res.returncode}):"
                           f"\n{res.stderr[-2000:]}")
    parts: dict = {}
    if program == "mpsync_train":
        metrics = json.loads((work / "train" / "metrics.json").read_text())
        first = metrics["train_start_clock"]
        parts = _parts(metrics.get("startup_clock") or {}, start)
    else:
        first = float(next(ln.split()[1] for ln in res.stdout.splitlines()
                           if ln.startswith("FIRST")))
    return first - start, end - start, parts


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "runs": values}


def run(args: argparse.Namespace) -> int:
    if args.np < 2 or args.rounds < 1:
        print("mpsync bench startup: --np must be >= 2 and --rounds >= 1", file=sys.stderr)
        return 2
    programs = [p for p in args.programs.split(",") if p]
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown or "floor" not in programs:
        print(f"mpsync bench startup: --programs {args.programs}: "
              + (f"unknown {', '.join(unknown)}; " if unknown else "")
              + f"choose from {', '.join(PROGRAMS)}, floor among them", file=sys.stderr)
        return 2
    if args.cluster is not None:
        from mpsync import cluster as vc

        state = vc.load_state(args.cluster or None)
        if state is None:
            print(f"mpsync bench startup: cluster {args.cluster or vc.default_name()!r} is not "
                  f"up (mpsync cluster up --nodes N)", file=sys.stderr)
            return 2
    first: dict[str, list] = {p: [] for p in programs}
    total: dict[str, list] = {p: [] for p in programs}
    train_parts: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for program in programs:
                f, t, parts = _launch(program, args.np, Path(tmp), args.timeout,
                                      args.cluster, args.cluster_placement)
                if parts:
                    train_parts.append(parts)
                first[program].append(f)
                total[program].append(t)
    floor = statistics.median(first["floor"])
    result = {"np": args.np, "rounds": args.rounds, "cluster": args.cluster,
              "cluster_placement": args.cluster_placement if args.cluster is not None else None,
              "first_iteration_s": {p: _spread(v) for p, v in first.items()},
              "total_s": {p: _spread(v) for p, v in total.items()},
              "over_floor": {p: statistics.median(v) / floor for p, v in first.items()},
              # The median of each part over the rounds (they need not add up to the median).
              "mpsync_train_parts": {k: statistics.median(p[k] for p in train_parts if k in p)
                                     for k in dict.fromkeys(k for p in train_parts for k in p)},
              "load_average": os.getloadavg()[0]}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    where = "" if args.cluster is None else f" on cluster {args.cluster or 'default'}"
    print(f"start-up, mpirun -np {args.np}{where}, {args.rounds} interleaved rounds (load average "
          f"{result['load_average']:.1f}): seconds from mpirun to the first iteration")
    for p in programs:
        s, t = result["first_iteration_s"][p], result["total_s"][p]
        print(f"  {p:15s} median {s['median']:6.2f}  (min {s['min']:.2f}, max {s['max']:.2f})  "
              f"{result['over_floor'][p]:.2f}x the floor   whole run {t['median']:.2f} s")
    if result["mpsync_train_parts"]:
        print("  mpsync_train's start-up, median seconds per part: " + ", ".join(
            f"{k} {v:.2f}" for k, v in result["mpsync_train_parts"].items()))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m mpsync.bench.startup")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
