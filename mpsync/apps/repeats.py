"""``mpsync compare --repeats R``: every policy R times, medians with their spread.

Runs are interleaved, p1..pk, p1..pk, ..., so a drift of the machine's speed over the minutes
of a comparison (other jobs, thermal state) hits every policy alike instead of the ones that
happen to run last.  Repeat r uses seed ``--seeds[r]`` (default ``--seed + r``): a different
data order and initialization, the same for every policy within the repeat.

Time to target over the repeats: a run that never reached the target counts as slower than any
run that did (an infinite time), so it moves the median up instead of being dropped; the
median is "not reached" when more than half of the runs missed, and the max is "not reached"
when any run did.  ``reached`` says how many runs made it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

from mpsync.apps.runs import launch_argv, setup_line
from mpsync.config import ConfigError
from mpsync.launch.mpirun import run_with_deadline
from mpsync import policies as registry
from mpsync.apps.report import comparison_figure, format_repeats_table, plot_run, \
    time_to_target

__all__ = ["main", "seeds_of", "summarize_repeats", "common_level"]


def seeds_of(args) -> list[int]:
    if args.seeds:
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            raise ConfigError(f"--seeds: {args.seeds!r} is not a comma list of integers") \
                from None
        if args.repeats not in (None, len(seeds)):
            raise ConfigError(f"--repeats {args.repeats} but --seeds lists {len(seeds)} seeds")
        return seeds
    repeats = 1 if args.repeats is None else args.repeats
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    return [args.seed + r for r in range(repeats)]


def _median_time(times: list[float | None]) -> float | None:
    """Median with misses as +inf (``None`` when the median itself is a miss)."""
    ranked = sorted(math.inf if t is None else t for t in times)
    m = statistics.median(ranked)
    return None if math.isinf(m) else float(m)


def summarize_repeats(runs: dict[str, list[dict]], target: float | None = None) -> list[dict]:
    """``runs``: policy -> the metrics.json of each of its repeats, in order; ``target``: the
    accuracy their times to target refer to (for the speedup's basis)."""
    rows = []
    for policy, ms in runs.items():
        times = [m["time_to_target_s"] for m in ms]
        reached = [t for t in times if t is not None]
        accs = [m["final_acc"] for m in ms if m.get("final_acc") is not None]
        rows.append({
            "policy": policy, "repeats": len(ms), "reached": len(reached),
            "time_to_target_s": _median_time(times),
            "time_to_target_min_s": min(reached) if reached else None,
            "time_to_target_max_s": max(reached) if len(reached) == len(ms) else None,
            "time_to_target_runs_s": times,
            "final_acc": statistics.median(accs) if accs else None,
            "final_acc_min": min(accs) if accs else None,
            "final_acc_max": max(accs) if accs else None,
            "samples_per_s": statistics.median(m["samples_per_s"] for m in ms),
            "wait_fraction": statistics.median(m["wait_fraction"] for m in ms),
            "bytes_per_sample": statistics.median(m["bytes_per_sample"] or 0 for m in ms),
            **{k: _median_or_none([m.get(k) for m in ms])
               for k in ("data_bytes_per_sample", "min_data_bytes_per_sample",
                         "control_bytes_per_sample")},
            "seeds": [m["config"]["seed"] for m in ms],
            "topology": ms[0]["config"]["topology"],
        })
    _speedups(rows, runs, target)
    return rows


def common_level(runs: dict[str, list[dict]]) -> float | None:
    """The highest accuracy that every run reached (its evaluations' best, the lowest over the
    runs), or None if a run has no evaluation."""
    best = [max((e["accuracy"] for e in m.get("evals") or ()), default=None)
            for ms in runs.values() for m in ms]
    return None if not best or None in best else min(best)


def _speedups(rows: list[dict], runs: dict[str, list[dict]], target: float | None) -> None:
    """``speedup_vs_baseline`` of every row and, in ``speedup_basis``, what it compares.

    The baseline's median time to the target over the policy's.  On a busy machine the
    baseline may miss the target in some repeats and its median with them; the speedup then
    compares the medians of the time to the highest accuracy every run reached
    (:func:`common_level`, read from each run's evaluations), which every run has, so the
    column keeps an answer and says which one it is."""
    base = next((r for r in rows if registry.is_baseline(r["policy"])), None)
    goal = "the target" if target is None else f"{target:g}"
    basis, key = f"medians of the time to {goal}", "time_to_target_s"
    level = common_level(runs)
    if base is not None and base[key] is None and level is not None:
        basis = (f"medians of the time to {level:.3g}, the highest accuracy every run reached "
                 f"({base['policy']}'s median missed {goal})")
        key = "time_to_level_s"
        for r in rows:
            r[key] = statistics.median(time_to_target(m["evals"], level)
                                       for m in runs[r["policy"]])
    for r in rows:
        t, b = r[key], None if base is None else base[key]
        r["speedup_vs_baseline"] = b / t if b is not None and t else None
        r["speedup_basis"] = basis


def _plot(runs, rows, path: Path, target: float, setup: str) -> None:
    """Accuracy curves of every run (one colour per policy) and each policy's times to target
    as dots with the median as a bar; misses drawn as crosses above the budget."""
    top = max((m["wall_s"] for ms in runs.values() for m in ms), default=1.0)
    with comparison_figure(path, target, setup) as (plt, ax, bx):
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, (policy, ms) in enumerate(runs.items()):
            for j, m in enumerate(ms):
                ax.plot([e["wall_s"] for e in m["evals"]], [e["accuracy"] for e in m["evals"]],
                        color=colors[i % len(colors)], alpha=0.6, lw=1,
                        label=policy if j == 0 else None)
        for i, r in enumerate(rows):
            times = r["time_to_target_runs_s"]
            hit = [t for t in times if t is not None]
            bx.scatter([i] * len(hit), hit, color=colors[i % len(colors)], zorder=3)
            misses = len(times) - len(hit)
            if misses:
                bx.scatter([i] * misses, [top * 1.05] * misses, marker="x", color="black",
                           zorder=3)
            if r["time_to_target_s"] is not None:
                bx.hlines(r["time_to_target_s"], i - 0.3, i + 0.3, color="black", lw=2)
        bx.set_xticks(range(len(rows)), [r["policy"] for r in rows])
        bx.set_ylabel(f"time to {target:g} accuracy (s); bar: median, x: not reached")


def main(args, policies: list[str], seeds: list[int]) -> int:
    """Run (or, with --from-runs, read) every policy once per seed, interleaved."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.time_budget or (25.0 if args.epochs is None else 0.0)
    timeout = args.timeout or (budget + 240.0 if budget else 900.0)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    failures = []
    for r, seed in enumerate(seeds):
        for policy in policies:
            run_dir = out / policy / f"repeat{r}"
            path = run_dir / "metrics.json"
            if not args.from_runs:
                one = argparse.Namespace(**{**vars(args), "seed": seed})
                res = run_with_deadline(launch_argv(one, policy, run_dir), timeout, env=env)
                if res.returncode != 0 or not path.is_file():
                    why = "timed out" if res.timed_out else f"exit code {res.returncode}"
                    failures.append(f"{policy}#{r}")
                    print(f"mpsync compare: {policy} repeat {r} failed ({why}):\n"
                          f"{res.stderr[-2000:]}", file=sys.stderr)
                    continue
            elif not path.is_file():
                failures.append(f"{policy}#{r}")
                continue
            m = json.loads(path.read_text())
            runs[policy].append(m)
            if not args.json and not args.from_runs:
                ttt = m["time_to_target_s"]
                print(f"[{policy} repeat {r + 1}/{len(seeds)}, seed {seed}] final acc "
                      f"{m['final_acc']:.3f}, time to target "
                      f"{'not reached' if ttt is None else f'{ttt:.1f}s'}", flush=True)
    if not args.from_runs:   # every run's own plots, now that the last one has finished
        for r in range(len(seeds)):
            for policy in policies:
                if (out / policy / f"repeat{r}" / "trace.json").is_file():
                    plot_run(out / policy / f"repeat{r}")
    runs = {p: ms for p, ms in runs.items() if ms}
    rows = summarize_repeats(runs, args.target_acc)
    setup = f"{setup_line(args, {p: ms[0] for p, ms in runs.items()})}, {len(seeds)} " \
            f"repeats (seeds {','.join(map(str, seeds))}), interleaved"
    result = {"rows": rows, "target_acc": args.target_acc, "failed": failures, "setup": setup}
    (out / "compare.json").write_text(json.dumps(result, indent=1) + "\n")
    table = format_repeats_table(rows)
    (out / "table.md").write_text(f"{setup}\n\n{table}\n")
    if runs:
        _plot(runs, rows, out / "compare.png", args.target_acc, setup)
    if args.json:
        keys = ("policy", "time_to_target_s", "time_to_target_min_s", "time_to_target_max_s",
                "reached", "repeats", "final_acc", "final_acc_min", "final_acc_max",
                "samples_per_s", "wait_fraction", "speedup_vs_baseline", "speedup_basis")
        print(json.dumps({"rows": [{k: r[k] for k in keys} for r in rows]}))
    else:
        print(setup)
        print(table)
        print(f"written: {out / 'compare.png'}, {out / 'table.md'}, {out / 'compare.json'}")
    return 1 if failures else 0


def _median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
