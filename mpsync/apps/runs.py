"""One policy's run within ``mpsync compare``: its ``mpsync train`` flags, its ``mpirun``
command line, and the line that says what was compared (shared by the single runs and the
repeats)."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from mpsync import cluster, transport
from mpsync.launch.mpirun import forwarded_env, python_argv
from mpsync.launch.registry import launch_argv as target_argv
from mpsync.launch.runner import build_job

__all__ = ["train_argv", "ranks", "launch_argv", "setup_line", "default_slowdown",
           "fresh_run_dir"]


def train_argv(args, policy: str, out: Path) -> list[str]:
    slowdown = default_slowdown(args.np) if args.slowdown is None else args.slowdown
    argv = ["--policy", policy, "--slowdown", slowdown, "--target-acc", str(args.target_acc),
            "--dataset", args.dataset, "--partition", args.partition, "--backend", args.backend,
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(args.seed),
            "--comm-delay", str(args.comm_delay), "--server", args.server,
            "--device", getattr(args, "device", "auto"),
            "--out", str(out), "--no-progress", "--no-plots"]
    if getattr(args, "stop_at_target", False):
        argv += ["--stop-at-target"]
    if getattr(args, "optimizer", None) is not None:
        argv += ["--optimizer", args.optimizer]
    if args.topology is not None:  # else train picks the policy's own topology
        argv += ["--topology", args.topology]
    if getattr(args, "ps_shards", None) is not None:
        argv += ["--ps-shards", str(args.ps_shards)]
    if args.iter_time:
        argv += ["--iter-time", str(args.iter_time)]
    if args.slowdown_schedule:
        argv += ["--slowdown-schedule", args.slowdown_schedule]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    else:
        argv += ["--time-budget", str(args.time_budget or 25.0)]
    return argv + args.train_args.split()


def ranks(args) -> int:
    """MPI ranks of one run: the workers, plus one for a dedicated server."""
    return args.np + (1 if args.server == "dedicated" else 0)


def launch_argv(args, policy: str, out: Path) -> list[str]:
    """The command line of one policy's run (no launch): on the virtual cluster with
    ``--cluster`` (writing its hostfile for this rank count), else as ``mpsync train --np``
    starts its ranks (this host, ``-H``/``--hostfile``, or the scheduler's allocation)."""
    command = python_argv("mpsync.apps.train", *train_argv(args, policy, out))
    on = getattr(args, "cluster", None)
    if getattr(args, "max_restarts", 0):
        # mpsync train supervises its own jobs (the same launcher, restarted on failure).
        where = ["--cluster", on] if on is not None else []
        for flag, dest in (("-H", "hosts"), ("--hostfile", "hostfile"),
                           ("--mpirun-args", "mpirun_args")):
            if getattr(args, dest, None):
                where += [flag, getattr(args, dest)]
        return command + ["--np", str(args.np), "--max-restarts", str(args.max_restarts),
                          "--checkpoint-every", str(args.checkpoint_every), *where]
    if on is not None:
        return target_argv(ranks(args), command, cluster=on,
                           placement=getattr(args, "cluster_placement", "server-alone"),
                           forward_env=forwarded_env())
    # Open MPI's defaults stand unless the user (or a job script) chose a transport.
    extra = transport.mca_argv() if transport.is_set() else []
    user = shlex.split(getattr(args, "mpirun_args", "") or "")
    return build_job(command, args.np, dedicated_server=args.server == "dedicated",
                     hosts=getattr(args, "hosts", None), hostfile=getattr(args, "hostfile", None),
                     mpirun_args=[*extra, *user]).argv


def default_slowdown(workers: int) -> str:
    """The demo's heterogeneity scaled to ``workers``: half at factor 1, a quarter at 2, a
    quarter at 4 (by position: worker i gets the factor of 1,1,2,4 at i*4//workers)."""
    return ",".join(str((1, 1, 2, 4)[i * 4 // workers]) for i in range(workers))


def fresh_run_dir(kind: str, root: str = "runs") -> str:
    """A new ``runs/<kind>-<date>-<time>`` (a suffix when one exists already): where a
    command writes by default, never over an earlier run or a committed result."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / f"{kind}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path(root) / f"{kind}-{stamp}-{n}"
    return str(path)


def setup_line(args, runs) -> str:
    """One line saying what was compared: where, data, workers, slowdowns, budget, settings."""
    any_run = next(iter(runs.values()), None)
    het = (any_run["config"]["heterogeneity"] if any_run else
           f"slowdown {args.slowdown or 'none'}")
    stop = f"{args.epochs} epochs" if args.epochs is not None else \
        f"{args.time_budget or 25.0:g} s per policy"
    if getattr(args, "stop_at_target", False):
        stop = (f"each run stopped at its first evaluation at or above the target (final acc: "
                f"the model at that stop), else at {stop}")
    server = ("+ 1 server rank" if args.server == "dedicated" else
              "(server thread on rank 0)")
    where = ""
    if getattr(args, "cluster", None) is not None:
        st = cluster.load_state(args.cluster or None)
        if st is not None:
            # --bandwidth sets every link for the comparison; else the rate it was made with.
            rate = getattr(args, "bandwidth", None) or st.bandwidth or "unlimited"
            where = (f"across {len(st.nodes)} nodes (links {rate}, "
                     f"{args.cluster_placement}), ")
    return (f"{where}{args.dataset} ({args.partition}), {args.np} workers {server}, {het}, "
            f"{stop}, batch {args.batch_size}/worker, {_optimizer(args, any_run)}, "
            f"backend {args.backend}, target accuracy {args.target_acc}"
            + (f", train args {args.train_args!r}" if getattr(args, "train_args", None) else ""))


def _optimizer(args, run) -> str:
    """The optimizer the runs trained with and its settings, from a run's configuration
    where there is one (``--train-args`` may set the momentum): ``sgd lr 0.01 momentum 0.9``."""
    c = (run or {}).get("config") or {}
    name = c.get("optimizer") or getattr(args, "optimizer", None) or "sgd"
    words = f"{name} lr {c.get('lr', args.lr)}"
    if name == "sgd" and "momentum" in c:
        words += f" momentum {c['momentum']:g}" + (" nesterov" if c.get("nesterov") else "")
    if c.get("weight_decay"):
        words += f" weight decay {c['weight_decay']:g}"
    return words
