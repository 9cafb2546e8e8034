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

__all__ = ["add_arguments", "run", "validate_runs", "WAIT_TARGET", "SAMPLES_TARGET"]

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
