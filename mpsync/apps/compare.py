"""``mpsync compare``: run every policy under mpirun on the same task and compare
time-to-accuracy (one table, one combined plot, every run's own outputs kept).

Each policy runs in its own ``mpirun``, one after the other so runs do not compete for cores
(on this host, on ``-H``/``--hostfile`` hosts, in the scheduler's allocation or on the virtual
cluster):
``--np`` workers plus the dedicated state server's rank, or ``--np`` ranks with
``--server colocated`` (the server is a thread of rank 0, which also trains).  Without
``--topology`` each policy runs on its own default topology (its entry in
:mod:`mpsync.policies`); ``--topology`` puts every policy on one.
All flags are validated by the train parser before the first launch, so an impossible pair
(``--topology ring`` with ssp) fails before anything starts.  The results go to a new folder
under ``runs/`` unless ``--out`` says where: a comparison never rewrites the result sets
committed under ``bench/`` (``make bench-compare`` refreshes ``bench/compare`` on purpose).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mpsync import cluster
from mpsync import policies as registry
from mpsync.apps import repeats, train
from mpsync.apps.report import comparison_figure, format_table, plot_run
from mpsync.apps.runs import default_slowdown, fresh_run_dir, launch_argv, ranks, setup_line, \
    train_argv
from mpsync.bench.nodes import cluster_at_rate
from mpsync.cluster.layout import ClusterError, parse_rate
from mpsync.config import DEFAULTS, OPTIMIZERS, ConfigError, check_output_dir, print_user_error
from mpsync.launch.cluster import add_cluster_arguments
from mpsync.apps.devices import check_device_flag
from mpsync.launch.command import add_launch_arguments
from mpsync.launch.mpirun import run_with_deadline

__all__ = ["add_arguments", "main", "table_rows", "DEMO_POLICIES"]

# Every registered policy, the baseline first (registration order).
DEMO_POLICIES = ",".join(registry.names())


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_launch_arguments(p, np_default=4, np_help="number of workers (a server rank is "
                                                   "added with --server dedicated)")
    p.add_argument("--policies", default=DEMO_POLICIES,
                   help=f"comma-separated (default: every policy, {DEMO_POLICIES})")
    p.add_argument("--topology", default=None,
                   help="ring | ps for every policy (default: each policy's own)")
    p.add_argument("--server", default=DEFAULTS.server,
                   help="dedicated (an extra rank serves) | colocated (a server thread on "
                        "rank 0; --np ranks, all train)")
    p.add_argument("--slowdown", default=None,
                   help="per-worker slowdown factors, one per worker (default: half the "
                        "workers at 1, a quarter at 2, a quarter at 4: 1,1,2,4 for 4, "
                        "1,2 for 2, 1,1,1,1,2,2,4,4 for 8); empty: none")
    p.add_argument("--slowdown-schedule", default=None)
    p.add_argument("--iter-time", type=float, default=0.05,
                   help="emulated device time of one iteration at slowdown 1 (s)")
    p.add_argument("--comm-delay", type=float, default=0.0)
    p.add_argument("--target-acc", type=float, default=0.9)
    p.add_argument("--stop-at-target", action="store_true",
                   help="end each run at its first evaluation at or above --target-acc (the "
                        "budget still caps a run that never reaches it); the final accuracy "
                        "is then the accuracy at the stop")
    p.add_argument("--epochs", type=float, default=None)
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="per policy (default 25 s when --epochs is not given)")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--partition", default="iid")
    p.add_argument("--backend", default=DEFAULTS.backend,
                   help="the ring's transport, as mpsync train's --backend (mpi, horovod, gloo, "
                        f"nccl; default {DEFAULTS.backend})")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda, as mpsync train's --device (default auto: CUDA "
                        "where present, one GPU per worker)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                   help="every run's optimizer (mpsync train --optimizer; default: "
                        "$MPSYNC_OPTIMIZER or sgd); its other settings via --train-args, "
                        "e.g. '--weight-decay 1e-4'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="directory for the table, plots and every run (default: a new "
                        "runs/compare-<date>-<time>; runs/ is ignored by git)")
    p.add_argument("--json", action="store_true", help="print only the JSON rows")
    p.add_argument("--timeout", type=float, default=None,
                   help="per-run hard limit (default: budget + 240 s)")
    p.add_argument("--ps-shards", default=None, metavar="N|auto",
                   help="parameter-server shards for the PS policies (default: "
                        "$MPSYNC_PS_SHARDS or auto: one per node, 2 on one host)")
    p.add_argument("--train-args", default="", help="extra flags passed to every train run")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="each run restarts up to N times after a failed rank, from its newest "
                        "checkpoint on the workers that remain (mpsync train --max-restarts; "
                        "checkpoints every --checkpoint-every rounds)")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="K",
                   help="with --max-restarts: checkpoint every K rounds (default 10)")
    p.add_argument("--from-runs", action="store_true",
                   help="do not train: rebuild the table and plot from the runs under --out")
    p.add_argument("--repeats", type=int, default=None,
                   help="run every policy R times, interleaved; medians with min-max")
    p.add_argument("--seeds", default=None,
                   help="comma list, one seed per repeat (default: --seed, --seed+1, ...)")
    add_cluster_arguments(p)
    p.add_argument("--bandwidth", default=None, metavar="RATE",
                   help="with --cluster: every node's link at RATE (e.g. 1gbit) for the "
                        "comparison; the cluster is made with one node per rank if it is not "
                        "up (and removed after), else its rates are restored after")


def _validate(args) -> list[str]:
    """Every flag checked before the first launch; fills in the defaults that depend on
    others (the slowdown for --np workers, a fresh --out)."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies: empty list")
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:
        raise ConfigError(f"--policies {args.policies}: {', '.join(twice)} given twice; "
                          f"name each policy once (--repeats R runs each R times)")
    if args.np < 1:
        raise ConfigError(f"--np must be >= 1 worker, got {args.np}")
    check_device_flag(args.device)
    if args.slowdown is None:
        args.slowdown = default_slowdown(args.np)
    if args.out is None:
        if args.from_runs:
            raise ConfigError("--from-runs needs --out DIR: the directory of the runs to "
                              "tabulate")
        args.out = fresh_run_dir("compare")
    check_output_dir("--out", args.out)
    if args.epochs is not None and args.time_budget is not None:
        raise ConfigError("give only one of --epochs or --time-budget")
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    for p in policies:  # an unknown policy or topology is named by the train parser's checks
        try:
            train.validate(parser.parse_args(train_argv(args, p, Path(args.out) / p)), args.np)
        except ConfigError as e:
            raise ConfigError(f"--policies {p}: {e}") from None
    return policies


def main(args) -> int:
    bandwidth = getattr(args, "bandwidth", None)
    if bandwidth is None or args.from_runs:
        return _compare(args)
    if getattr(args, "cluster", None) is None:
        print("mpsync compare: error: --bandwidth sets the links of a virtual cluster; "
              "give --cluster [NAME] too", file=sys.stderr)
        return 2
    try:
        parse_rate(bandwidth)
        _validate(args)
    except (ConfigError, ClusterError) as e:
        print_user_error("mpsync compare", e)
        return 2
    with cluster_at_rate(ranks(args), bandwidth, args.cluster or None):
        return _compare(args)


def _compare(args) -> int:
    try:
        policies = _validate(args)
        if args.repeats is not None or args.seeds:
            seeds = repeats.seeds_of(args)
    except ConfigError as e:
        print_user_error("mpsync compare", e)
        return 2
    if getattr(args, "cluster", None) is not None and not args.from_runs:
        if cluster.load_state(args.cluster or None) is None:
            print(f"mpsync compare: error: cluster {args.cluster or cluster.default_name()!r} "
                  f"is not up (mpsync cluster up --nodes N)", file=sys.stderr)
            return 2
    if args.repeats is not None or args.seeds:
        return repeats.main(args, policies, seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.time_budget or (25.0 if args.epochs is None else 0.0)
    timeout = args.timeout or (budget + 240.0 if budget else 900.0)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs: dict[str, dict] = {}
    failures = []
    for policy in policies:
        run_dir = out / policy
        if args.from_runs:
            if (run_dir / "metrics.json").is_file():
                runs[policy] = json.loads((run_dir / "metrics.json").read_text())
            else:
                failures.append(policy)
            continue
        argv = launch_argv(args, policy, run_dir)
        if not args.json:
            print(f"[{policy}] {' '.join(argv[-len(train_argv(args, policy, run_dir)) - 3:])}",
                  flush=True)
        res = run_with_deadline(argv, timeout, env=env)
        metrics_path = run_dir / "metrics.json"
        if res.returncode != 0 or not metrics_path.is_file():
            why = "timed out" if res.timed_out else f"exit code {res.returncode}"
            failures.append(policy)
            print(f"mpsync compare: {policy} failed ({why} after {res.elapsed:.0f}s):\n"
                  f"{res.stderr[-2000:]}", file=sys.stderr)
            continue
        runs[policy] = json.loads(metrics_path.read_text())
        if not args.json:
            m = runs[policy]
            print(f"[{policy}] done in {res.elapsed:.0f}s (training {m['wall_s']:.1f}s): "
                  f"final acc {m['final_acc']:.3f}", flush=True)
    if not args.from_runs:   # every run's own plots, now that the last one has finished
        for policy in runs:
            if (out / policy / "trace.json").is_file():
                plot_run(out / policy)
    rows = table_rows(runs)
    result = {"rows": rows, "target_acc": args.target_acc, "failed": failures,
              "setup": setup_line(args, runs)}
    (out / "compare.json").write_text(json.dumps(result, indent=1) + "\n")
    table = format_table(rows)
    (out / "table.md").write_text(f"{result['setup']}\n\n{table}\n")
    if runs:
        _plot(runs, rows, out / "compare.png", args.target_acc, result["setup"])
    if args.json:
        print(json.dumps({"rows": [{k: r[k] for k in ("policy", "time_to_target_s", "final_acc",
                                                      "samples_per_s", "wait_fraction",
                                                      "speedup_vs_baseline")} for r in rows]}))
    else:
        print(result["setup"])
        print(table)
        print(f"written: {out / 'compare.png'}, {out / 'table.md'}, {out / 'compare.json'}, "
              f"and one directory per policy")
    return 1 if failures else 0


def table_rows(runs: dict[str, dict]) -> list[dict]:
    baseline = next((m for p, m in runs.items() if registry.is_baseline(p)), {})
    base = baseline.get("time_to_target_s")
    base_wall = baseline.get("wall_s")
    rows = []
    for policy, m in runs.items():
        ttt = m["time_to_target_s"]
        rows.append({"policy": policy, "time_to_target_s": ttt, "final_acc": m["final_acc"],
                     "samples_per_s": m["samples_per_s"], "wait_fraction": m["wait_fraction"],
                     "bytes_per_sample": m["bytes_per_sample"],
                     **{k: m.get(k) for k in ("data_bytes_per_sample", "min_data_bytes_per_sample",
                                              "control_bytes_per_sample")},
                     "speedup_vs_baseline": (base / ttt if base is not None and ttt else None),
                     # The baseline missed the target within its run: the speedup is at least this.
                     "speedup_at_least": (base_wall / ttt if base is None and base_wall and ttt
                                          else None),
                     "topology": m["config"]["topology"]})
    return rows


def _plot(runs, rows, path: Path, target: float, setup: str) -> None:
    with comparison_figure(path, target, setup) as (_, ax, bx):
        for policy, m in runs.items():
            ax.plot([e["wall_s"] for e in m["evals"]], [e["accuracy"] for e in m["evals"]],
                    marker=".", label=policy)
        names = [r["policy"] for r in rows]
        values = [r["time_to_target_s"] if r["time_to_target_s"] is not None else 0
                  for r in rows]
        bars = bx.bar(names, values, color="#4c72b0")
        for b, r in zip(bars, rows):
            if r["time_to_target_s"] is None:
                bx.text(b.get_x() + b.get_width() / 2, 0, "not\nreached", ha="center",
                        va="bottom", fontsize=8)
        bx.set_ylabel(f"time to {target:g} accuracy (s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="mpsync compare")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
