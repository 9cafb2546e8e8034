"""``mpsync bench simulate``: the simulator against real runs (validation).

For every policy's run of ``mpsync compare`` (default: the runs under ``bench/compare``, or
fresh ones with ``--run``), replay its per-worker iteration times (``--speeds trace:``) with
the event engine, which drives the server's policy objects, for the run's wall time, and
compare the simulated wait fraction and samples/s with what the run measured.  Targets:
|Δ wait fraction| <= 0.05, samples/s within 10 %.

Span: the replay runs for the time the run trained, the most any worker booked in its
counters (compute + server waits + aggregation).  ``wall_s`` of ``mpsync train`` is shorter: it
leaves out worker 0's evaluations (up to 15 % of a 12 s run on a loaded machine), so its
samples/s (total / wall_s) is higher than the rate over the span; the table compares rates over
the span and keeps the reported figure in the JSON.  What a worker's counters miss of the span
(worker 0's evaluations, the loop's own work) is replayed as a pause per iteration, booked in
none of the fractions, as in the run.

What the replay takes from the run, and nothing else: each worker's mean iteration time
(compute_s / iterations), the spread of iteration times the server saw between consecutive
LOCAL reports (runs whose policy synchronizes every iteration have none: they get the median
of the other runs of the same set, same machine and emulated device), the aggregation cost of
one round as the worker that waits least for its peers measured it, and the median query
round trip; for OSP, the epoch length and the losses of its evaluations (what Alg. 1 sizes the
In-Computation Sync from).  Ablations show what each modelling choice is worth: without the
per-iteration spread, without the pauses, (PS) with the measured cost as a link the workers
queue for, and with the baseline's rules (the registry's ``BASELINE``) in place of the policy's:
the error a wrong algorithm would show, so a replay within the targets says the policy's
rules, not only its costs, were right.

Writes ``validation.json`` and ``validation.md`` to ``--out``; ``--json`` prints the rows.

``--speed`` times the simulator instead (:func:`run_speed`): ``mpsync simulate`` per policy
and worker count, each in a fresh process, beside a ``--baseline`` source tree in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mpsync import policies as registry
from mpsync.config import SyncConfig

__all__ = ["add_arguments", "run", "run_speed", "time_simulate", "validate_runs", "WAIT_TARGET",
           "SAMPLES_TARGET"]

WAIT_TARGET = 0.05       # |simulated - measured| wait fraction
SAMPLES_TARGET = 0.10    # |simulated / measured - 1| samples/s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", default="bench/compare",
                   help="directory of a compare run (one sub-directory per policy)")
    p.add_argument("--run", action="store_true",
                   help="first run mpsync compare (4 workers, slowdown 1,1,2,4) into "
                        "OUT/compare-runs")
    p.add_argument("--policies", default=None,
                   help="comma list (default: every registered policy)")
    p.add_argument("--budget", type=float, default=25.0, help="per policy, with --run (s)")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--slowdown", default="1,1,2,4")
    p.add_argument("--out", default="bench/simulate")
    p.add_argument("--json", action="store_true")
    g = p.add_argument_group("speed (--speed): how long mpsync simulate takes per policy")
    g.add_argument("--speed", action="store_true",
                   help="time `mpsync simulate` per policy instead of validating "
                        "(writes speed.json and speed.md to --out)")
    g.add_argument("--workers", default="4096:10000,65536:1000",
                   help="comma list of worker counts, each N or N:ITERATIONS (default: "
                        "the two sizes the simulator is held to, 60 CPU s a policy)")
    g.add_argument("--iterations", type=int, default=10000,
                   help="per worker, where --workers does not say")
    g.add_argument("--speeds", default="lognormal:0.3")
    g.add_argument("--repeats", type=int, default=1)
    g.add_argument("--baseline", default=None,
                   help="a source tree of mpsync (e.g. `git worktree add DIR REV`) timed in "
                        "the same run, interleaved with this one")


def _ablations(policy: str, topology: str) -> list[str]:
    return ["no_jitter", "no_pauses"] + (["queued_link"] if topology == "ps" else []) + \
        ([] if registry.is_baseline(policy) else ["as_baseline"])


def validate_runs(runs: Path, policies: list[str], ablations: tuple | None = None) -> list[dict]:
    """One row per policy found under ``runs``: measured vs simulated, and the replay under
    each of ``ablations`` (default: all that apply)."""
    import numpy as np

    from mpsync.simulate import (CostModel, TrainingModel, parse_speeds,  # numba
                                 read_trace, simulate)

    found = []   # (policy, metrics.json): one run per policy, or its repeats (compare --repeats)
    for p in policies:
        paths = [runs / p / "metrics.json"] + sorted((runs / p).glob("repeat*/metrics.json"))
        found += [(p, path) for path in paths if path.is_file()]
    traces = [(p, path, read_trace(path)) for p, path in found]
    # runs without LOCAL reports take the spread of the others of the set (same machine,
    # same emulated device)
    pooled = [f for _, _, t in traces for f in (t["spread"] or [])]
    set_spread = pooled or None
    measured = [t["jitter"] for _, _, t in traces if t["jitter"]]
    set_jitter = float(np.median(measured)) if measured else 0.0
    rows = []
    for policy, path, tr in traces:
        config = _run_config(policy, tr)
        spec = f"trace:{path}"
        jitter = tr["jitter"] if tr["jitter"] else set_jitter
        spread = tr["spread"] or set_spread
        training = TrainingModel.from_trace(tr)

        def replay(jitter_, queued=False, pauses=True, config=config):
            cost = CostModel(query=tr["query_s"], fixed_aggregation=tr["aggregation_s"])
            if queued:
                # the measured push+pull as a link everyone queues for
                cost = CostModel(query=tr["query_s"], model_bytes=tr["aggregation_s"] / 2,
                                 bandwidth=1.0, latency=0.0)
            speeds = parse_speeds(spec, None, jitter=jitter_,
                                  spread=spread if jitter_ else None)
            if pauses:
                speeds = dataclasses.replace(speeds, pause=np.array(tr["pause"]))
            return simulate(config, speeds, cost, duration=tr["span_s"], engine="exact",
                            batch_size=tr["batch_size"] or 32, training=training)

        sim = replay(jitter)
        measured_rate = tr["samples"] / tr["span_s"]
        row = {"policy": policy, "topology": tr["topology"], "run": str(path.parent),
               "measured_wait_fraction": tr["wait_fraction"],
               "simulated_wait_fraction": sim["wait_fraction"],
               "delta_wait_fraction": sim["wait_fraction"] - tr["wait_fraction"],
               "measured_samples_per_s": measured_rate,
               "reported_samples_per_s": tr["samples_per_s"],
               "simulated_samples_per_s": sim["samples_per_s"],
               "samples_error": sim["samples_per_s"] / measured_rate - 1,
               "span_s": tr["span_s"], "pause_s_per_iteration": tr["pause"],
               "jitter": jitter, "jitter_source": "run" if tr["jitter"] else "set median",
               "query_s": tr["query_s"], "aggregation_s": tr["aggregation_s"],
               "wall_s": tr["wall_s"], "iterations_per_worker_measured": tr["iterations"],
               "iterations_per_worker_simulated": sim["iterations_per_worker"]}
        row["within_targets"] = bool(abs(row["delta_wait_fraction"]) <= WAIT_TARGET and
                                     abs(row["samples_error"]) <= SAMPLES_TARGET)
        baseline = SyncConfig(policy=registry.BASELINE, topology=tr["topology"])
        for name in _ablations(policy, tr["topology"]):
            if ablations is not None and name not in ablations:
                continue
            alt = {"no_jitter": lambda: replay(0.0),
                   "no_pauses": lambda: replay(jitter, pauses=False),
                   "queued_link": lambda: replay(jitter, queued=True),
                   "as_baseline": lambda: replay(jitter, config=baseline)}[name]()
            row[name] = {"delta_wait_fraction": alt["wait_fraction"] - tr["wait_fraction"],
                         "samples_error": alt["samples_per_s"] / measured_rate - 1}
        rows.append(row)
    return rows


def _run_config(policy: str, trace_: dict):
    """The run's own configuration: the policy's parameters as the run recorded them."""
    recorded = trace_.get("config") or {}
    kw = {name: recorded[name] for name in registry.get(policy).options if name in recorded}
    return SyncConfig(policy=policy, topology=trace_["topology"], **kw).validate()


def format_table(rows: list[dict]) -> str:
    head = ("| policy | topology | wait fraction measured | simulated | Δ | samples/s measured | "
            "simulated | error | within targets | without spread: Δ wait, error | without "
            "pauses: Δ wait, error | queued PS link: Δ wait, error | with the baseline's "
            f"({registry.BASELINE}) rules: Δ wait, error |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        name = Path(r["run"]).name
        label = r["policy"] if name == r["policy"] else f"{r['policy']} ({name})"

        def alt(name):
            a = r.get(name)
            return "-" if a is None else \
                f"{a['delta_wait_fraction']:+.3f}, {a['samples_error']:+.1%}"

        lines.append(
            f"| {label} | {r['topology']} | {r['measured_wait_fraction']:.3f} | "
            f"{r['simulated_wait_fraction']:.3f} | {r['delta_wait_fraction']:+.3f} | "
            f"{r['measured_samples_per_s']:.0f} | {r['simulated_samples_per_s']:.0f} | "
            f"{r['samples_error']:+.1%} | {'yes' if r['within_targets'] else 'NO'} | "
            f"{alt('no_jitter')} | {alt('no_pauses')} | {alt('queued_link')} | "
            f"{alt('as_baseline')} |")
    return "\n".join(lines)


def run(args) -> int:
    if args.speed:
        return run_speed(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in (args.policies or ",".join(registry.names())).split(",")
                if p.strip()]
    runs = Path(args.runs)
    started = time.time()
    if args.run:
        runs = out / "compare-runs"
        argv = [sys.executable, "-m", "mpsync.apps.compare", "--np", str(args.np),
                "--slowdown", args.slowdown, "--policies", ",".join(policies),
                "--time-budget", str(args.budget), "--out", str(runs), "--json"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(argv, capture_output=True, text=True, env=env,
                           timeout=len(policies) * (args.budget + 300))
        if r.returncode != 0:
            print(f"mpsync bench simulate: compare failed ({r.returncode}):\n{r.stderr[-3000:]}",
                  file=sys.stderr)
            return 1
    rows = validate_runs(runs, policies)
    if not rows:
        print(f"mpsync bench simulate: no metrics.json under {runs}/<policy>/", file=sys.stderr)
        return 1
    load = os.getloadavg()
    result = {"rows": rows, "runs": str(runs), "targets": {"wait_fraction": WAIT_TARGET,
                                                           "samples_per_s": SAMPLES_TARGET},
              "load_average": load, "seconds": round(time.time() - started, 1)}
    (out / "validation.json").write_text(json.dumps(result, indent=1) + "\n")
    table = format_table(rows)
    (out / "validation.md").write_text(
        f"Replayed runs: {runs} (4 workers, slowdown {args.slowdown}); load average "
        f"{load[0]:.1f} when validated.\n\n{table}\n")
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(table)
    return 0 if all(r["within_targets"] for r in rows) else 1


# -- speed -----------------------------------------------------------------------------------

def _run_measured(argv: list[str], env: dict, cwd: str, timeout: float):
    """Run ``argv`` to its end: (exit code, stdout, stderr, wall s, CPU s, peak resident MB),
    the CPU time (user + system) and the peak from the kernel's account of the child
    (``wait4``), so other jobs on the machine do not count; None when it ran past ``timeout``
    (then it is killed)."""
    import threading

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    timer = threading.Timer(timeout, proc.kill)
    t0 = time.perf_counter()
    timer.start()
    try:
        out = proc.stdout.read()
        reader.join()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    proc.stderr.close()
    if wall >= timeout and proc.returncode < 0:
        return None
    # ru_maxrss is in KiB on Linux
    return (proc.returncode, out, err[0] if err else "", wall,
            usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024.0)


def time_simulate(tree: str, policy: str, workers: int, iterations: int, speeds: str,
                  timeout: float = 3600.0) -> dict:
    """``mpsync simulate`` of one policy in a fresh process running the sources in ``tree``:
    the simulation's own wall and CPU seconds (its row's ``runtime_s``, ``cpu_s``), the whole
    command's wall and CPU seconds (imports, Numba's cache load) and its peak resident memory,
    and the load average around it."""
    argv = [sys.executable, "-m", "mpsync.cli", "simulate", "--workers", str(workers),
            "--speeds", speeds, "--iterations", str(iterations), "--policies", policy, "--json"]
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
    load_before = os.getloadavg()[0]
    done = _run_measured(argv, env, tree, timeout)
    if done is None:
        return {"policy": policy, "workers": workers, "iterations": iterations,
                "error": f"over {timeout:.0f} s"}
    code, out, err, wall, cpu, peak_mb = done
    if code != 0:
        return {"policy": policy, "workers": workers, "iterations": iterations,
                "error": (err.strip().splitlines() or ["?"])[-1]}
    row = json.loads(out.strip().splitlines()[-1])["rows"][0]
    return {"policy": policy, "workers": workers, "iterations": iterations,
            "engine": row.get("engine"), "topology": row.get("topology"),
            "simulation_s": row["runtime_s"], "simulation_cpu_s": row["cpu_s"],
            "command_s": round(wall, 2), "command_cpu_s": round(cpu, 2),
            "peak_mb": round(peak_mb, 1),
            "load": [round(load_before, 1), round(os.getloadavg()[0], 1)]}


def run_speed(args) -> int:
    """Every policy at each worker count, this tree and (interleaved) the baseline's, each
    run in its own process after one small run per tree has filled Numba's cache."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # auto is no policy of its own to simulate: it chooses among the others as a run goes
    simulated = [p for p in registry.names() if p != registry.AUTO]
    policies = [p.strip() for p in (args.policies or ",".join(simulated)).split(",")
                if p.strip()]
    here = str(Path(__file__).resolve().parents[2])
    trees = [("after", here)] + ([("before", args.baseline)] if args.baseline else [])
    for _, tree in trees:
        for policy in policies:      # compile (or load) every engine once
            time_simulate(tree, policy, 8, 20, args.speeds)
    rows = []
    for repeat in range(args.repeats):
        for n, iterations in _sizes(args.workers, args.iterations):
            for policy in policies:
                order = trees if repeat % 2 == 0 else trees[::-1]
                for label, tree in order:
                    r = dict(time_simulate(tree, policy, n, iterations, args.speeds),
                             tree=label, repeat=repeat)
                    rows.append(r)
                    if not args.json:
                        print(json.dumps(r), file=sys.stderr, flush=True)
    result = {"rows": rows, "speeds": args.speeds, "iterations": args.iterations,
              "baseline": args.baseline, "cpus": os.cpu_count()}
    (out / "speed.json").write_text(json.dumps(result, indent=1) + "\n")
    table = format_speed(rows)
    (out / "speed.md").write_text(table + "\n")
    print(json.dumps(result) if args.json else table)
    return 0 if all("error" not in r for r in rows) else 1


def _sizes(text: str, iterations: int) -> list[tuple[int, int]]:
    out = []
    for item in str(text).split(","):
        n, _, k = item.strip().partition(":")
        out.append((int(n), int(k) if k else iterations))
    return out


def format_speed(rows: list[dict]) -> str:
    """One line per (workers, policy): per tree, the simulation's CPU seconds (median over
    repeats: on a shared machine its wall time says more about the other jobs), the peak
    resident memory of the whole command (imports included), the simulation's and the
    command's wall seconds, and the load average over its runs."""
    import statistics

    trees = sorted({r["tree"] for r in rows}, key=lambda t: t != "before")
    head = "| workers | iterations | policy | engine | " + " | ".join(
        f"{t}: simulation CPU (s) | {t}: peak memory (MB) | {t}: simulation / command wall (s) "
        f"| {t}: load" for t in trees) + " |"
    if len(trees) == 2:
        head += " after / before (CPU) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    keys = sorted({(r["workers"], r.get("iterations"), r["policy"]) for r in rows},
                  key=lambda k: (-k[0], -(k[1] or 0), k[2]))
    for n, iterations, policy in keys:
        cells, cpu = [], {}
        engine = "-"
        for t in trees:
            mine = [r for r in rows if (r["workers"], r["iterations"], r["policy"], r["tree"]) ==
                    (n, iterations, policy, t)]
            ok = [r for r in mine if "error" not in r]
            if not ok:
                why = mine[0]["error"] if mine else "not run"
                cells.append(f"failed ({why}) | - | - | -")
                continue
            engine = ok[0]["engine"] or engine
            med = {k: statistics.median(r[k] for r in ok)
                   for k in ("simulation_s", "simulation_cpu_s", "command_s")}
            peak = max(r.get("peak_mb", 0.0) for r in ok)
            cpu[t] = med["simulation_cpu_s"]
            loads = [x for r in ok for x in r["load"]]
            cells.append(f"{med['simulation_cpu_s']:.2f} | {peak:.0f} | "
                         f"{med['simulation_s']:.2f} / {med['command_s']:.1f} | "
                         f"{min(loads):.0f}-{max(loads):.0f}")
        line = f"| {n} | {iterations} | {policy} | {engine} | " + " | ".join(cells) + " |"
        if len(trees) == 2:
            line += f" {cpu['after'] / cpu['before']:.2f} |" if len(cpu) == 2 and \
                cpu["before"] > 0 else " - |"
        lines.append(line)
    return "\n".join(lines)
