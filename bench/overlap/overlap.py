"""Buckets during backward, across a network: BSP's samples/s with the gradients' allreduces
started during backward, against the same run's whole-model-at-``step()`` path and Horovod on
the same script.

    mpsync cluster --name el up --nodes 5 --bandwidth 1gbit
    python bench/overlap/overlap.py --cluster el --batch 768 --repeats 3

The script (this file, ``--as-rank LIB``) is one Horovod-style training loop run unchanged
under ``import horovod.torch as hvd`` and ``import mpsync.torch as hvd``: the built-in
``big-mlp`` (51 MB of float32 gradients), SGD with momentum through ``DistributedOptimizer``,
synthetic inputs of the digits' 64 features (no data loading in the loop), one thread per
rank.  Two workers, each on its own node of the virtual cluster, so every allreduce crosses a
1 Gbit/s link; mpsync's dedicated state server is a third rank, alone on node1 (the default
placement).  The variants, interleaved in each repeat (the machine's load drifts):

* ``mpsync``: BSP on the ring, 25 MB buckets started from the gradient hooks during backward
  (the default);
* ``mpsync-step``: the same with ``MPSYNC_OVERLAP=0``: the whole model reduced in ``step()``;
* ``colocated``, ``colocated-step``: the two with the state server as a thread of worker 0's
  rank (``MPSYNC_SERVER=colocated``): two processes, as Horovod's job has;
* ``gloo``, ``gloo-step``: the colocated pair with ``MPSYNC_BACKEND=gloo``: the buckets
  reduced by a ``torch.distributed`` gloo group of the workers, whose transfers run on gloo's
  own threads and sleep in the kernel while bytes are on the wire (Open MPI's blocking calls
  spin);
* ``horovod``: Horovod 0.28.1 (its own hooks and fusion buffer, which also overlap).

On this machine every node of the virtual cluster shares the same two cores, and a blocking
MPI call spins while it waits for bytes (Open MPI's progress loop), so a third process (the
dedicated server, mostly asleep) takes CPU time from the kernel's and the ranks' TCP work:
see ``README.md`` for what that costs and why the colocated rows are the like-for-like ones.

Each rank also times, before training, what overlapping has to hide: the forward and backward
of the same model without any hook (``compute_s``, median of 5) and one allreduce of all of
its gradients as one tensor through the library's ``allreduce`` (``allreduce_s``, median of
3).  Reported per variant: the median samples/s over the repeats (all workers' samples per
second of the timed steps), and the ratios to ``mpsync-step`` and ``horovod`` of the same
run.  One JSON line per launch is appended to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# variant: (library, buckets during backward, mpsync's state server, mpsync's ring backend)
VARIANTS = {"mpsync": ("mpsync", True, "dedicated", "mpi"),
            "mpsync-step": ("mpsync", False, "dedicated", "mpi"),
            "colocated": ("mpsync", True, "colocated", "mpi"),
            "colocated-step": ("mpsync", False, "colocated", "mpi"),
            "gloo": ("mpsync", True, "colocated", "gloo"),
            "gloo-step": ("mpsync", False, "colocated", "gloo"),
            "horovod": ("horovod", None, None, None)}
FEATURES, CLASSES = 64, 10


def rank_main(args) -> None:
    """One rank of the training loop (under mpirun)."""
    import torch
    import torch.nn.functional as F

    if args.as_rank == "horovod":
        import horovod.torch as hvd
    else:
        import mpsync.torch as hvd
    from mpsync.apps.models import build_model

    hvd.init()   # mpsync's dedicated server rank serves inside and never returns
    torch.set_num_threads(1)
    model = build_model((FEATURES,), CLASSES, 0, "big-mlp")
    plain = build_model((FEATURES,), CLASSES, 0, "big-mlp")   # no hooks: compute alone
    gen = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(args.batch, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (args.batch,), generator=gen)

    def median_time(fn, reps: int) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def plain_pass():
        plain.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()

    def barrier():
        hvd.allreduce(torch.zeros(1), name="barrier")

    plain_pass()
    compute_s = median_time(plain_pass, 5)
    grads = torch.zeros(sum(p.numel() for p in model.parameters()))
    hvd.allreduce(grads, name="warm")
    barrier()
    allreduce_s = median_time(lambda: hvd.allreduce(grads, name="whole"), 3)
    del grads

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step() -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss)

    for _ in range(args.warmup):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    barrier()
    elapsed = time.perf_counter() - start
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({
            "samples_per_s": args.steps * args.batch * hvd.size() / elapsed,
            "step_s": elapsed / args.steps, "compute_s": compute_s, "allreduce_s": allreduce_s,
            "gradient_mb": sum(p.numel() for p in model.parameters()) * 4 / 1e6,
            "workers": hvd.size(), "loss": loss}), flush=True)
    if args.as_rank != "horovod":
        hvd.shutdown()


def launch(variant: str, args) -> dict:
    """One launch of ``variant`` on the cluster: its RESULT line, with the launch's times."""
    from mpsync.launch.cluster import cluster_mpirun_argv
    from mpsync.launch.mpirun import run_with_deadline

    lib, overlap, server, backend = VARIANTS[variant]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MPSYNC_POLICY="bsp",
               MPSYNC_OVERLAP="1" if overlap else "0", MPSYNC_SERVER=server or "dedicated",
               MPSYNC_BACKEND=backend or "mpi")
    ranks = args.np + (server == "dedicated")   # + the dedicated server's rank
    command = [sys.executable, str(Path(__file__).resolve()), "--as-rank", lib,
               "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    argv = cluster_mpirun_argv(ranks, command, args.cluster,
                               forward_env=("PYTHONPATH", "OMP_NUM_THREADS", "MPSYNC_POLICY",
                                            "MPSYNC_OVERLAP", "MPSYNC_SERVER",
                                            "MPSYNC_BACKEND"))
    if args.hostfile:
        argv[argv.index("--hostfile") + 1] = args.hostfile
    started = time.time()
    res = run_with_deadline(argv, args.timeout, env=env)
    lines = [ln for ln in res.stdout.splitlines() if "RESULT " in ln]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"{variant}: mpirun ended with "
                           f"{'a timeout' if res.timed_out else res.returncode} and no result:"
                           f"\n{res.stdout[-1500:]}\n{res.stderr[-2500:]}")
    row = json.loads(lines[-1].split("RESULT ", 1)[1])
    row.update(variant=variant, batch=args.batch, steps=args.steps, cluster=args.cluster,
               wall_s=time.time() - started, at=time.strftime("%Y-%m-%d %H:%M:%S"),
               load_average=os.getloadavg()[0])
    return row


def driver(args) -> int:
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        print(f"overlap.py: unknown variant(s) {', '.join(unknown)}; choose from "
              f"{', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants:
            row = launch(variant, args)
            row["repeat"] = repeat
            rows[variant].append(row)
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"repeat {repeat} {variant:12s} {row['samples_per_s']:8.1f} samples/s  "
                  f"step {row['step_s']:.3f} s  compute {row['compute_s']:.3f} s  "
                  f"allreduce {row['allreduce_s']:.3f} s", flush=True)
    median = {v: statistics.median(r["samples_per_s"] for r in rows[v]) for v in variants}
    print(f"\nmedian samples/s over {args.repeats} repeats (batch {args.batch} per worker, "
          f"{args.np} workers):")
    for v in variants:
        others = "  ".join(f"{median[v] / median[o]:.2f}x {o}" for o in variants if o != v)
        print(f"  {v:12s} {median[v]:8.1f}   {others}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--as-rank", choices=("mpsync", "horovod"), default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--cluster", default="el", help="the virtual cluster's name")
    p.add_argument("--np", type=int, default=2, help="workers, one per node (default 2)")
    p.add_argument("--batch", type=int, default=768, help="samples per worker per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--hostfile", default=None,
                   help="another hostfile for the cluster's mpirun (which nodes the ranks use)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=str(Path(__file__).with_name("overlap.jsonl")))
    args = p.parse_args()
    if args.as_rank:
        rank_main(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
