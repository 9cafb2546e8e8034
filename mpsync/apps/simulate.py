"""``mpsync simulate``: which policy wins on a cluster you do not have (``mpsync.simulate``).

One row per (policy, worker count, PS shards, speed spec): throughput, wait and aggregation
fractions, rounds, staleness (PS policies), local steps per round (ESync, ElasticBSP) and the
server decisions per second the run needs.  ``--workers``, ``--ps-shards`` and ``--speeds``
take lists for a sweep; ``--out`` writes ``simulate.json``, ``table.md`` and one plot per metric
against N.  Every parameter a registered policy reads (its registry ``options``: DSSP's
``--staleness-range``, ESync's ``--esync-delayed-ack``, OSP's
``--osp-ics-size``, ...) is a flag, with ``SyncConfig``'s default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from mpsync import policies as registry
from mpsync.config import DEFAULTS, ConfigError, SyncConfig, check_output_dir, parse_number, \
    parse_staleness_range, print_user_error

__all__ = ["add_arguments", "main", "run_rows", "PLOTTED"]

# Workers when the speed spec does not fix them: mpsync compare's (and the demo's) count.
DEFAULT_WORKERS = 4

PLOTTED = ("samples_per_s", "wait_fraction", "aggregation_fraction", "decisions_per_s",
           "local_steps_mean", "staleness_p99")


def policy_options() -> list[str]:
    """Every SyncConfig field a registered policy reads, in registration order."""
    fields = {f.name for f in dataclasses.fields(SyncConfig)}
    seen: dict = {}
    for spec in registry.specs():
        for name in spec.options:
            if name in fields:
                seen.setdefault(name, spec.name)
    return list(seen)


def _flag_type(name: str):
    default = getattr(DEFAULTS, name)
    if isinstance(default, bool):
        def parse(text):
            v = text.strip().lower()
            if v not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return v in ("1", "true", "yes", "on")
        return parse
    return type(default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", "--np", dest="workers", default=None,
                   help=f"worker count, or a comma list for a sweep (default: the SPEC's own "
                        f"count for groups: and trace:, else {DEFAULT_WORKERS}, as mpsync "
                        f"compare)")
    p.add_argument("--speeds", default="lognormal:0.3",
                   help="lognormal:SIGMA | groups:1x256,1.5x128,3x128 | trace:metrics.json | "
                        "const; ';'-separated list for a sweep")
    # Every registered policy but auto, which runs the others (mpsync advise ranks them).
    simulated = [n for n in registry.names() if n != registry.AUTO]
    p.add_argument("--policies", default=",".join(simulated),
                   help=f"comma list (default: every registered policy, "
                        f"{', '.join(simulated)}; auto: see mpsync advise)")
    p.add_argument("--iterations", type=int, default=None,
                   help="stop after workers x ITERATIONS iterations in total (default 1000)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop at this virtual time instead (s); default for trace: the run's")
    p.add_argument("--iter-time", type=float, default=0.1,
                   help="iteration time at factor 1 / the lognormal median (s)")
    p.add_argument("--jitter", type=float, default=None,
                   help="per-iteration lognormal sigma of every iteration time (default 0, or "
                        "the spread a trace's server measured)")
    p.add_argument("--slowdown-schedule", default=None,
                   help="'T:f0,f1,...;T2:...' factors from virtual time T on (as mpsync train)")
    g = p.add_argument_group("costs")
    g.add_argument("--model-bytes", default="100M", help="bytes aggregated per round")
    g.add_argument("--bandwidth", default="1.25G", help="bytes/s per link (1.25G = 10 Gbit/s)")
    g.add_argument("--latency", type=float, default=5e-6, help="per ring step / PS message (s)")
    g.add_argument("--query-latency", type=float, default=None,
                   help="server query round trip (s); default 1e-4, or the trace's")
    g.add_argument("--aggregation-s", type=float, default=None,
                   help="fixed cost per aggregation round (s) instead of the model; default "
                        "for trace: the run's measured cost")
    g.add_argument("--ps-shards", default="auto",
                   help="parameter-server shards S (a link each), or a comma list for a sweep "
                        "(default auto: one per node, as mpsync train; every simulated "
                        "worker is a node of its own)")
    g.add_argument("--ps-apply-rate", default=None,
                   help="bytes/s a shard server applies a pushed update at (default "
                        "CostModel's)")
    g.add_argument("--ps-optimizer", default=None, choices=("worker", "server"),
                   help="who runs the optimizer on the PS (default "
                        f"{DEFAULTS.ps_optimizer!r}; 'server' costs each push an optimizer "
                        "step, or BSP's round one step; policies that cannot run it keep "
                        "'worker')")
    g.add_argument("--ps-optimizer-rate", default=None,
                   help="bytes/s a shard runs the server-side optimizer at (default: "
                        "CostModel's)")
    g = p.add_argument_group("training (what workers report: OSP's epochs and losses)")
    g.add_argument("--epoch-iterations", type=int, default=None,
                   help="iterations per worker per epoch (default 100, or the trace's)")
    g.add_argument("--loss-decay", type=float, default=None,
                   help="fraction by which the mean loss falls per epoch (default 0.2; a "
                        "trace: its measured losses)")
    g.add_argument("--layers", type=int, default=None,
                   help="equal layers of the model (OSP moves whole layers; default 10)")
    g = p.add_argument_group("policy parameters (SyncConfig's defaults)")
    for name in policy_options():
        # DSSP's range is one flag, as in mpsync train; the two halves stay for old scripts.
        hidden = name in ("staleness_low", "staleness_high")
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=_flag_type(name),
                       default=None, help=argparse.SUPPRESS if hidden else
                       f"default {getattr(DEFAULTS, name)!r}")
    g.add_argument("--staleness-range", default=None, metavar="sL,sU",
                   help=f"DSSP [s_L, s_U] (default {DEFAULTS.staleness_low},"
                        f"{DEFAULTS.staleness_high}), as mpsync train")
    p.add_argument("--topology", default=None, help="ring | ps (default: each policy's own)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--engine", default="auto", help="auto | exact | fast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--out", default=None, help="directory for simulate.json, table.md, plots")


def _topology(args, policy: str) -> str:
    return args.topology or registry.default_topology(policy)


def _config(args, policy: str) -> SyncConfig:
    kw = {"policy": policy, "topology": args.topology or ""}  # empty: the policy's own
    for name in policy_options():
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    spec = registry.get(policy)
    if getattr(args, "ps_optimizer", None) == "server" and spec.ps_server_optimizer and \
            (args.topology or spec.default_topology) == "ps":
        kw["ps_optimizer"] = "server"
    if getattr(args, "staleness_range", None) is not None:
        kw["staleness_low"], kw["staleness_high"] = parse_staleness_range(args.staleness_range)
    try:
        return SyncConfig(**kw).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _shards(text: str, n: int) -> int:
    if text.strip() == "auto":
        return n
    return parse_number("--ps-shards", text, int, at_least=1)


def _training(args, trace: dict):
    from mpsync.simulate import TrainingModel  # numba: compiled on first use

    kw = {name: getattr(args, name) for name in ("epoch_iterations", "loss_decay", "layers")
          if getattr(args, name) is not None}
    return TrainingModel.from_trace(trace, **kw)


def run_rows(args, log=None) -> list[dict]:
    """Every (speed spec, worker count, policy) of the arguments; one row each."""
    from mpsync.simulate import parse_speeds  # numba

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p == registry.AUTO:
            raise ConfigError("--policies auto: auto chooses among the others as a run goes; "
                              "to see what it would choose, run mpsync advise (or simulate "
                              "the policies it chooses among)")
        if p not in registry.names():
            raise ConfigError(f"unknown policy {p!r} in --policies; choose from "
                              f"{', '.join(registry.names())}")
    if not policies:
        raise ConfigError("--policies: empty list")
    specs = [s.strip() for s in args.speeds.split(";") if s.strip()]
    if not specs:
        raise ConfigError(f"--speeds {args.speeds!r}: no speed spec; e.g. lognormal:0.3")
    if args.workers is not None:
        counts = [_count(x) for x in str(args.workers).split(",")]
    elif any(s.partition(":")[0] in ("lognormal", "const") for s in specs):
        counts = [DEFAULT_WORKERS]    # these specs say nothing of the count
    else:
        counts = [None]               # groups: and trace: have their own
    if args.iterations is not None and args.iterations < 1:
        raise ConfigError(f"--iterations must be >= 1, got {args.iterations}")
    if args.iterations is not None and args.duration is not None:
        raise ConfigError("give only one of --iterations or --duration")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    rows = []
    for spec in specs:
        for n in counts:
            speeds0 = parse_speeds(spec, n, args.iter_time, args.seed, args.jitter,
                                   args.slowdown_schedule)
            trace = speeds0.trace or {}
            iterations, duration = args.iterations, args.duration
            if iterations is None and duration is None:
                if trace.get("wall_s"):
                    duration = float(trace["wall_s"])
                else:
                    iterations = 1000
            batch = trace.get("batch_size") or args.batch_size
            training = _training(args, trace)
            for i, shards_text in enumerate(str(args.ps_shards).split(",")):
                cost = _cost(args, trace, _shards(shards_text, speeds0.n))
                for policy in policies:
                    if i and _topology(args, policy) != "ps":
                        continue    # shards change nothing on the ring
                    rows.append(_row(args, policy, spec, n, cost, training, iterations,
                                     duration, batch, log))
    return rows


def _cost(args, trace: dict, shards: int):
    from mpsync.simulate import CostModel, parse_rate  # numba

    kw = {} if args.ps_apply_rate is None else \
        {"apply_rate": parse_rate(args.ps_apply_rate, "--ps-apply-rate")}
    if getattr(args, "ps_optimizer_rate", None) is not None:
        kw["optimizer_rate"] = parse_rate(args.ps_optimizer_rate, "--ps-optimizer-rate")
    return CostModel(model_bytes=parse_rate(args.model_bytes, "--model-bytes"),
                     bandwidth=parse_rate(args.bandwidth, "--bandwidth"),
                     latency=args.latency,
                     query=args.query_latency if args.query_latency is not None
                     else trace.get("query_s", 1e-4),
                     fixed_aggregation=args.aggregation_s
                     if args.aggregation_s is not None else trace.get("aggregation_s"),
                     ps_shards=shards, **kw)


def _row(args, policy, spec, n, cost, training, iterations, duration, batch, log):
    from mpsync.simulate import parse_speeds, simulate  # numba

    config = _config(args, policy)
    # a fresh speed model per policy: every policy sees the same draws
    speeds = parse_speeds(spec, n, args.iter_time, args.seed, args.jitter,
                          args.slowdown_schedule)
    try:
        row = simulate(config, speeds, cost, iterations=iterations, duration=duration,
                       engine=args.engine, batch_size=batch, training=training)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    row["speeds"] = spec
    row["ps_shards"] = cost.ps_shards
    row["cost_model"] = cost.describe()
    row["config"] = dict(config.choice.parameters)
    if log:
        log(f"[{policy} n={row['workers']} S={cost.ps_shards} {spec}] {row['runtime_s']:.1f}s: "
            f"{row['samples_per_s']:.0f} samples/s, wait {row['wait_fraction']:.3f}")
    return row


def _count(text: str) -> int:
    return parse_number("--workers", text, int, at_least=1)


def _flat(row: dict) -> dict:
    """The plotted metrics of a row, nested distributions flattened."""
    local = row.get("local_steps_per_round") or {}
    stale = row.get("staleness") or {}
    return {**row, "local_steps_mean": local.get("mean"), "staleness_p99": stale.get("p99")}


def format_table(rows: list[dict]) -> str:
    head = ["policy", "topology", "N", "PS shards", "speeds", "samples/s", "iterations/s", "wait fraction",
            "aggregation fraction", "rounds", "local steps/round (mean, max)",
            "staleness (p50/p99/max)", "decisions/s", "engine, run time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        local = r.get("local_steps_per_round")
        stale = r.get("staleness")
        local_text = f"{local['mean']:.2f}, {local['max']}" if local else "-"
        stale_text = f"{stale['p50']}/{stale['p99']}/{stale['max']}" if stale else "-"
        cells = [r["policy"], r["topology"], str(r["workers"]),
                 str(r.get("ps_shards", 1)) if r["topology"] == "ps" else "-", r["speeds"],
                 f"{r['samples_per_s']:.0f}", f"{r['iterations_per_s']:.1f}",
                 f"{r['wait_fraction']:.3f}", f"{r['aggregation_fraction']:.3f}",
                 f"{r['rounds']:.0f}", local_text, stale_text, f"{r['decisions_per_s']:.0f}",
                 f"{r['engine']}, {r['runtime_s']:.1f}s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> list[Path]:
    """One PNG per metric: the metric against N, a line per (policy, speeds)."""
    from mpsync.apps.report import pyplot  # matplotlib, only to draw

    plt = pyplot()
    flat = [_flat(r) for r in rows]
    policies = list(dict.fromkeys(r["policy"] for r in flat))
    for r in flat:   # a line per (speeds, shards): the PS's shard count is part of the setup
        if r["topology"] == "ps" and len({x.get("ps_shards", 1) for x in flat}) > 1:
            r["speeds"] = f"{r['speeds']}, S={r.get('ps_shards', 1)}"
    specs = list(dict.fromkeys(r["speeds"] for r in flat))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    paths = []
    for metric in PLOTTED:
        series: dict = {}
        for r in flat:
            if r.get(metric) is not None:
                series.setdefault((r["policy"], r["speeds"]), []).append((r["workers"],
                                                                           r[metric]))
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        # colour = policy, line style = speed distribution
        for (policy, spec), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    color=colors[policies.index(policy) % len(colors)],
                    ls=styles[specs.index(spec) % len(styles)],
                    label=f"{policy} ({spec})" if len(specs) > 1 else policy)
        ax.set_xscale("log", base=2)
        if metric in ("samples_per_s", "decisions_per_s"):
            ax.set_yscale("log")
        ax.set_xlabel("workers N")
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(args) -> int:
    log = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        if args.out:
            check_output_dir("--out", args.out)
        rows = run_rows(args, log)
    except ConfigError as e:
        print_user_error("mpsync simulate", e)
        return 2
    result = {"rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "simulate.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "table.md").write_text(format_table(rows) + "\n")
        plot(rows, out)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(rows))
        if args.out:
            print(f"written: {args.out}/simulate.json, table.md and one plot per metric")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="mpsync simulate")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
