"""``mpsync bench zipline``: the ZipLine variants on the paper's synthetic data (ZipLine §6.1).

Data: per worker an iteration interval U[1000, 1500] ms and a start offset U[10, 50] ms
(seeded); the R predicted pushes of worker p are s_p + j·i_p, j = 1..R. For every n in
``--sizes`` and R in ``--Rs`` each variant is timed (median µs per search after warm-up,
including the Python call), next to ``np.sort`` of the same n·R timestamps in the same run.
Writes ``zipline.csv`` and ``zipline.png`` (like the paper's Fig. 10) to ``--out``, plus the
GridScan miss rate and the JIT compile vs cached-start times.

The fast variants' samples are taken in turn with np.sort's, so a change in load reaches
all of them alike.

``--n N --R R --json`` measures one size and prints one JSON object with keys ``n``, ``R``,
``median_us`` (variant -> µs, null if skipped), ``sort_us`` and ``ratio_to_sort`` (variant ->
median / sort; the simulator plans ElasticBSP rounds at n = 4,096 with these kernels).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (4, 10, 100, 200, 400, 600, 800, 1000, 2000, 4096, 5000)
RS = (15, 150)

# Rough cost model in elementary steps, to skip a variant whose single search would take longer
# than --max-call-s (FullGridScan at n=5000, R=150 would take hours).
_COST = {
    "basic": lambda n, R: R * n * n,
    "opt": lambda n, R: R * n * n,
    "optbs": lambda n, R: R * n * max(1.0, math.log2(n)),
    "gridscan": lambda n, R: R * R * n,
    "fullgridscan": lambda n, R: R * R * n * n,
    "window": lambda n, R: R * n * max(1.0, math.log2(n)),
}
_NS_PER_STEP = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, help="measure one size: number of workers")
    parser.add_argument("--R", type=int, help="measure one size: lookahead")
    parser.add_argument("--json", action="store_true", help="print one JSON object (with --n/--R)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="n values of the sweep")
    parser.add_argument("--Rs", default=",".join(map(str, RS)), help="R values of the sweep")
    parser.add_argument("--variants", default=None, help="comma list (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=9, help="timed samples per point (median)")
    parser.add_argument("--max-call-s", type=float, default=3.0, help="skip slower variants")
    parser.add_argument("--miss-trials", type=int, default=200, help="GridScan miss-rate trials")
    parser.add_argument("--out", default="bench/zipline", help="directory for CSV/PNG/JSON")
    parser.add_argument("--no-startup", action="store_true", help="skip the JIT start-up timing")


def paper_data(n: int, R: int, seed: int):
    import numpy as np

    from mpsync.sched import predict

    rng = np.random.default_rng([seed, n, R])
    interval = rng.uniform(1000.0, 1500.0, n)
    start = rng.uniform(10.0, 50.0, n)
    return predict(start, interval, R)


def _median_call_us(fns: dict, samples: int) -> dict:
    """Median µs per call of each ``fns[name]()``; each sample loops enough calls to last
    ~2 ms. The functions' samples are taken in turn, one of each per round, so that a change in
    the machine's load between rounds reaches all of them alike."""
    loops = {}
    for name, fn in fns.items():
        fn()  # warm-up (and compile, if not cached)
        t0 = time.perf_counter()
        fn()
        loops[name] = max(1, int(2e-3 / max(time.perf_counter() - t0, 1e-9)))
    per_call = {name: [] for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(loops[name]):
                fn()
            per_call[name].append((time.perf_counter() - t0) / loops[name])
    return {name: statistics.median(times) * 1e6 for name, times in per_call.items()}


def measure(n: int, R: int, variants, seed: int, samples: int, max_call_s: float) -> dict:
    """The variants' and np.sort's median µs per call on the §6.1 data for (n, R). The fast
    variants are timed interleaved with np.sort of the same n·R timestamps; the slow ones
    (more than 2e8 elementary steps) with 3 samples each, before."""
    import numpy as np

    from mpsync.sched import zipline

    M = paper_data(n, R, seed)
    flat = M.ravel().copy()
    out = {"n": n, "R": R, "median_us": {}, "d": {}, "t_sync": {}}
    fast = {}
    for v in variants:
        if _COST[v](n, R) * _NS_PER_STEP * 1e-9 > max_call_s:
            out["median_us"][v] = out["d"][v] = out["t_sync"][v] = None
            continue
        if _COST[v](n, R) < 2e8:
            fast[v] = lambda v=v: zipline(M, v)
        else:
            out["median_us"][v] = _median_call_us({v: lambda v=v: zipline(M, v)}, 3)[v]
        r = zipline(M, v)
        out["d"][v], out["t_sync"][v] = r.d, r.t_sync
    timed = _median_call_us(fast | {"np.sort": lambda: np.sort(flat)}, samples)
    out["sort_us"] = timed.pop("np.sort")
    out["median_us"] = {v: timed.get(v, out["median_us"].get(v)) for v in variants}
    return out


def gridscan_miss_rate(n: int, R: int, trials: int, seed: int) -> dict:
    from mpsync.sched import FASTEST_EXACT_VARIANT, zipline

    misses, excess = 0, []
    for k in range(trials):
        M = paper_data(n, R, seed + 1000 + k)
        best = zipline(M, FASTEST_EXACT_VARIANT).d
        got = zipline(M, "gridscan").d
        if got > best:
            misses += 1
            excess.append(got - best)
    return {
        "n": n,
        "R": R,
        "trials": trials,
        "miss_rate": misses / trials,
        "mean_excess_ms": sum(excess) / len(excess) if excess else 0.0,
        "max_excess_ms": max(excess) if excess else 0.0,
    }


_STARTUP = r"""
import json, time
t0 = time.perf_counter()
import numpy as np
from mpsync.sched import ZIPLINE_VARIANTS, predict, zipline
t_import = time.perf_counter() - t0
M = predict(np.array([10.0, 20.0, 30.0]), np.array([1000.0, 1100.0, 1200.0]), 4)
first = {}
for v in ZIPLINE_VARIANTS:
    t = time.perf_counter(); zipline(M, v); first[v] = time.perf_counter() - t
print(json.dumps({"import_s": t_import, "first_call_s": first}))
"""


def startup_times() -> dict:
    """Import + first call of each variant in fresh interpreters: with an empty Numba cache
    (compile) and again with the cache it left behind (cached start)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        runs = []
        for _ in range(2):
            res = subprocess.run([sys.executable, "-c", _STARTUP], env=env, capture_output=True,
                                 text=True, check=True)
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    compile_, cached = runs
    return {
        "compile_total_s": compile_["import_s"] + sum(compile_["first_call_s"].values()),
        "cached_total_s": cached["import_s"] + sum(cached["first_call_s"].values()),
        "compile": compile_,
        "cached": cached,
    }


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Rs = sorted({r["R"] for r in rows})
    fig, axes = plt.subplots(1, len(Rs), figsize=(6 * len(Rs), 4.5), squeeze=False)
    for ax, R in zip(axes[0], Rs):
        sub = [r for r in rows if r["R"] == R]
        for name in sorted({r["variant"] for r in sub}, key=lambda s: (s == "np.sort", s)):
            pts = [(r["n"], r["median_us"]) for r in sub if r["variant"] == name and r["median_us"]]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, "k--" if name == "np.sort" else "-o", label=name, ms=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("workers n")
        ax.set_ylabel("µs per search (median)")
        ax.set_title(f"R = {R}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("ZipLine variants on the §6.1 synthetic data (cf. ZipLine paper Fig. 10)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from mpsync.sched import ZIPLINE_VARIANTS

    variants = tuple(args.variants.split(",")) if args.variants else ZIPLINE_VARIANTS
    unknown = [v for v in variants if v not in ZIPLINE_VARIANTS]
    if unknown:
        print(f"unknown variant(s) {unknown}; expected {ZIPLINE_VARIANTS}", file=sys.stderr)
        return 2
    if (args.n is None) != (args.R is None):
        print("--n and --R go together", file=sys.stderr)
        return 2
    if args.n is not None:
        if args.n < 1 or args.R < 1:
            print("--n and --R must be >= 1", file=sys.stderr)
            return 2
        res = measure(args.n, args.R, variants, args.seed, args.samples, args.max_call_s)
        if args.json:
            ratio = {v: None if us is None else us / res["sort_us"]
                     for v, us in res["median_us"].items()}
            print(json.dumps({k: res[k] for k in ("n", "R", "median_us", "sort_us")} |
                             {"d": res["d"], "ratio_to_sort": ratio}))
        else:
            for v, us in res["median_us"].items():
                print(f"{v:>13}: {'skipped' if us is None else f'{us:12.1f} µs'}  d={res['d'][v]}")
            print(f"{'np.sort':>13}: {res['sort_us']:12.1f} µs")
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for R in [int(x) for x in args.Rs.split(",")]:
        for n in [int(x) for x in args.sizes.split(",")]:
            res = measure(n, R, variants, args.seed, args.samples, args.max_call_s)
            exact = [d for v, d in res["d"].items() if d is not None and v != "gridscan"]
            d_star = min(exact) if exact else None
            for v in variants:
                rows.append({"n": n, "R": R, "variant": v, "median_us": res["median_us"][v],
                             "d_ms": res["d"][v], "t_sync_ms": res["t_sync"][v],
                             "optimal": None if res["d"][v] is None or d_star is None
                             else res["d"][v] == d_star})
            rows.append({"n": n, "R": R, "variant": "np.sort", "median_us": res["sort_us"],
                         "d_ms": None, "t_sync_ms": None, "optimal": None})
            line = "  ".join(f"{v}={res['median_us'][v]:.1f}" for v in variants if res["median_us"][v])
            print(f"n={n:5d} R={R:3d}  {line}  np.sort={res['sort_us']:.1f} µs", flush=True)
    with open(out / "zipline.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, out / "zipline.png")
    summary = {"gridscan_miss": [], "startup": None}
    if "gridscan" in variants and args.miss_trials > 0:
        for n, R in ((4, 15), (10, 15), (100, 15), (1000, 15), (4, 150), (100, 150), (1000, 150)):
            m = gridscan_miss_rate(n, R, args.miss_trials if n < 1000 else max(1, args.miss_trials // 10), args.seed)
            summary["gridscan_miss"].append(m)
            print(f"GridScan n={n} R={R}: missed the optimum in {m['miss_rate']:.1%} of {m['trials']} "
                  f"runs, by {m['mean_excess_ms']:.1f} ms on average (max {m['max_excess_ms']:.1f})")
    if not args.no_startup:
        s = startup_times()
        summary["startup"] = s
        print(f"start-up (import + first call of every variant): JIT compile {s['compile_total_s']:.2f} s, "
              f"cached {s['cached_total_s']:.2f} s")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'zipline.csv'}, {out / 'zipline.png'}, {out / 'summary.json'}")
    return 0
