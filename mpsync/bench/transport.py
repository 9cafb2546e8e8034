"""``mpsync bench transport --cluster [NAME]``: Open MPI's defaults against the transport
settings mpsync launches with (``mpsync.transport``), in one run, interleaved.

One rank per node of a virtual cluster.  For each link rate and node count, ``--rounds``
rounds; each round runs the ring job of ``bench allreduce`` (raw mpi4py ``Allreduce``, mpsync's
BSP path on the mpi backend, raw ``hvd.allreduce_`` and mpsync's BSP path on the horovod
backend; interleaved within the job) once under Open MPI's defaults and once under the tuned
settings, the order alternating from round to round, so load from other work on the machine
falls on both alike.  Each figure is bus bandwidth over the link rate (``bench.nodes``:
busbw = bytes/time x 2(n-1)/n, the link rate when the links are the only limit), the median
over rounds with its min-max; ``tuned_vs_defaults`` is the ratio of the two medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from mpsync import transport
from mpsync.bench._timing import byte_sizes, report_json
from mpsync.bench.nodes import (add_cluster_arguments, cluster_argv, cluster_at_rate,
                                link_fraction, parse_list, run_job, set_rate)
from mpsync.cluster.layout import parse_rate
from mpsync.launch import python_argv

__all__ = ["add_arguments", "run", "summarize", "format_table", "SETTINGS", "METHODS"]

MB = 1 << 20
DEFAULT_SIZES = (1 * MB, 4 * MB, 16 * MB, 64 * MB)
SETTINGS = ("defaults", "tuned")      # mpsync.transport specs: none, and the tuned set
METHODS = {"mpi": "raw mpi4py Allreduce", "mpsync_mpi": "mpsync BSP path, mpi backend",
           "horovod": "raw hvd.allreduce_", "mpsync": "mpsync BSP path, horovod backend"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p, rates="1gbit", nodes="4")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of (defaults, tuned) jobs, order alternating (default 3)")
    p.add_argument("--sizes", default=None, help="bytes, comma-separated (default 1, 4, 16, 64 MB)")
    p.add_argument("--max-repeats", type=int, default=5)
    p.add_argument("--seconds-per-point", type=float, default=2.0)
    p.add_argument("--tuning", default="tuned",
                   help="the settings compared with Open MPI's defaults (mpsync.transport "
                        "spec; default: tuned, what mpsync launches with)")
    p.add_argument("--out", default=None, help="write transport.json into this dir")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0, help="per job (s)")


def run(args: argparse.Namespace) -> int:
    if args.cluster is None:
        raise SystemExit("bench transport runs across nodes: give --cluster [NAME]")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    try:
        specs = {"defaults": "none", "tuned": args.tuning}
        options = {k: transport.describe(v) for k, v in specs.items()}
    except transport.TransportError as e:
        raise SystemExit(f"--tuning: {e}") from None
    rates = parse_list(args.cluster_rates, "rates")
    for r in rates:
        parse_rate(r)
    counts = sorted({int(x) for x in parse_list(args.cluster_nodes, "nodes")})
    if counts[0] < 2:
        raise SystemExit(f"--cluster-nodes: at least 2 nodes per run, got {counts}")
    sizes = byte_sizes(args.sizes, DEFAULT_SIZES)
    started = time.time()
    runs = []
    with cluster_at_rate(max(counts), rates[0], args.cluster) as state:
        for rate in rates:
            set_rate(args.cluster, rate)
            for n in counts:
                samples = _measure(args, state.name, n, rate, sizes, specs)
                runs.append({"rate": rate, "nodes": n,
                             "rows": summarize(samples, sizes, n, rate)})
    result = {"settings": options, "rounds": args.rounds, "sizes": sizes,
              "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
              "elapsed_s": round(time.time() - started, 1), "runs": runs}
    if not report_json(result, args.out, "transport.json", args.json):
        for r in runs:
            print(f"\n{r['nodes']} nodes, links at {r['rate']}, {args.rounds} rounds")
            print(format_table(r["rows"]))
    return 0


def _measure(args, name: str, n: int, rate: str, sizes, specs) -> dict:
    """samples[setting][bytes][method] -> list of ms, one per round."""
    common = ["--sizes", ",".join(map(str, sizes)), "--max-repeats", str(args.max_repeats),
              "--seconds-per-point", str(args.seconds_per_point)]
    samples: dict = {s: {b: {} for b in sizes} for s in SETTINGS}
    for rnd in range(args.rounds):
        order = SETTINGS if rnd % 2 == 0 else SETTINGS[::-1]
        for setting in order:
            print(f"[transport] {n} nodes at {rate}, round {rnd + 1}/{args.rounds}: "
                  f"{setting}", file=sys.stderr, flush=True)
            argv = cluster_argv(n, python_argv("mpsync.bench.allreduce", "--child", "ring",
                                               *common), name, tuning=specs[setting])
            for row in run_job(argv, args.timeout, f"ring {setting}, {n} nodes at {rate}"):
                for method in METHODS:
                    if f"{method}_ms" in row:
                        samples[setting][row["bytes"]].setdefault(method, []).append(
                            row[f"{method}_ms"])
    return samples


def summarize(samples: dict, sizes, n: int, rate: str) -> list[dict]:
    """One row per (size, method): link fraction median, min and max per setting, and the
    ratio of the medians (tuned over defaults)."""
    bits = parse_rate(rate)
    rows = []
    for nbytes in sizes:
        for method in METHODS:
            row = {"bytes": nbytes, "method": method}
            for setting in SETTINGS:
                ms = samples.get(setting, {}).get(nbytes, {}).get(method, [])
                if not ms:
                    continue
                fr = [link_fraction(nbytes, t / 1e3, n, bits) for t in ms]
                row[setting] = {"ms": ms, "median": statistics.median(fr), "min": min(fr),
                                "max": max(fr)}
            if all(s in row for s in SETTINGS):
                row["tuned_vs_defaults"] = row["tuned"]["median"] / row["defaults"]["median"]
            if len(row) > 2:
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    out = ["| MB | method | defaults: busbw / link (min-max) | tuned (min-max) | tuned / defaults |",
           "|---:|---|---:|---:|---:|"]
    for r in rows:
        cells = []
        for s in SETTINGS:
            v = r.get(s)
            cells.append(f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})" if v else "")
        ratio = f"{r['tuned_vs_defaults']:.2f}x" if "tuned_vs_defaults" in r else ""
        out.append(f"| {r['bytes'] / MB:g} | {METHODS[r['method']]} | {cells[0]} | {cells[1]} "
                   f"| {ratio} |")
    return "\n".join(out)
