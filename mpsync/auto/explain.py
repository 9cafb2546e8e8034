"""What ``auto`` did in a comparison, as a table: ``python -m mpsync.auto.explain OUT``.

``OUT`` is an ``mpsync compare`` output directory (``compare.json`` and one directory per
policy with ``repeat*/metrics.json``).  The table sets auto's median time to target beside
the best fixed policy's of the same comparison (the ratio the acceptance of ``auto`` is
about) and lists, per auto run, what it chose and when: each decision that switched (the
server's clock from its first report) and each switch's round and training wall time; and
checks the efficiency model: each policy's measured samples to the target against BSP's,
beside the efficiency auto's run predicted for it and the one the model in this checkout
predicts from the comparison's BSP runs (``rank_candidates`` on each one's ``metrics.json``:
the check of a model changed since the comparison ran).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpsync import policies
from mpsync.auto.measurements import Measurements
from mpsync.auto.ranking import Candidate, rank_candidates

__all__ = ["comparison_table", "efficiency_check", "main"]


def _runs(out: Path, policy: str) -> list[dict]:
    runs = []
    for path in sorted((out / policy).glob("repeat*/metrics.json")):
        runs.append(json.loads(path.read_text()) | {"_dir": path.parent.name})
    one = out / policy / "metrics.json"
    if not runs and one.exists():
        runs.append(json.loads(one.read_text()) | {"_dir": "."})
    return runs


def _samples_to_target(m: dict) -> float | None:
    target = (m.get("config") or {}).get("target_acc")
    return next((float(e["samples"]) for e in m.get("evals") or ()
                 if target is not None and e.get("accuracy", 0) >= target), None)


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2


def _model_now(out: Path, rows: list[dict]) -> dict:
    """Per policy, the median efficiency this checkout's model predicts on the comparison's
    BSP runs, for the topology each policy ran on."""
    base = next((r["policy"] for r in rows if policies.is_baseline(r["policy"])), None)
    topology = {}
    for r in rows:
        run = next(iter(_runs(out, r["policy"])), None)
        if run and r["policy"] != policies.AUTO:
            topology[r["policy"]] = (run.get("config") or {}).get("topology") or "ring"
    candidates = [Candidate(p, t) for p, t in topology.items()]
    found: dict = {}
    for run in _runs(out, base) if base else ():
        for r in rank_candidates(Measurements.from_metrics(run), candidates, engine="exact"):
            found.setdefault(r.candidate.policy, []).append(r.efficiency)
    return {p: _median(e) for p, e in found.items()}


def efficiency_check(out) -> str:
    """Markdown: each policy's measured progress per sample (BSP's median samples to the
    target over its own) beside the efficiency auto's first ranking gave it and the one the
    model predicts now."""
    out = Path(out)
    summary = json.loads((out / "compare.json").read_text())
    samples = {r["policy"]: _median(_samples_to_target(m) for m in _runs(out, r["policy"]))
               for r in summary["rows"]}
    now = _model_now(out, summary["rows"])
    predicted = {}
    for m in _runs(out, "auto"):
        ranked = next((d["ranking"] for d in m.get("decisions") or () if d.get("ranking")), [])
        for r in ranked:
            if r["settings"] == [] and r.get("wire", "fp32") == "fp32":
                predicted.setdefault(r["policy"], []).append(r["efficiency"])
    base = next((n for p, n in samples.items() if policies.is_baseline(p)), None)
    lines = ["| policy | samples to target, median | measured progress per sample (BSP = 1) "
             "| auto's predicted efficiency (in its run) | the model's now |",
             "|---|---|---|---|---|"]
    for p, n in samples.items():
        if p == policies.AUTO:
            continue
        eff = f"{base / n:.2f}" if base and n else "-"
        pred = predicted.get(p)
        lines.append(f"| {p} | {'-' if n is None else f'{n:.0f}'} | {eff} | "
                     f"{'-' if not pred else f'{_median(pred):.2f}'} | "
                     f"{'-' if now.get(p) is None else f'{now[p]:.2f}'} |")
    return "\n".join(lines)


def comparison_table(out) -> str:
    """Markdown: the medians, auto against the best fixed policy, and auto's choices."""
    out = Path(out)
    summary = json.loads((out / "compare.json").read_text())
    rows = {r["policy"]: r for r in summary["rows"]}
    fixed = {p: r for p, r in rows.items() if p != "auto" and r.get("time_to_target_s")}
    lines = ["| policy | reached | time to target, median (runs) |", "|---|---|---|"]
    for p, r in rows.items():
        runs = ", ".join("-" if t is None else f"{t:.1f}"
                         for t in r.get("time_to_target_runs_s") or [])
        median = r.get("time_to_target_s")
        lines.append(f"| {p} | {r.get('reached')}/{r.get('repeats')} | "
                     f"{'-' if median is None else f'{median:.1f} s'} ({runs}) |")
    auto = rows.get("auto")
    if fixed and auto and auto.get("time_to_target_s"):
        best = min(fixed, key=lambda p: fixed[p]["time_to_target_s"])
        ratio = auto["time_to_target_s"] / fixed[best]["time_to_target_s"]
        lines += ["", f"auto / best fixed policy ({best}): **{ratio:.2f}x** "
                      f"(medians {auto['time_to_target_s']:.1f} s / "
                      f"{fixed[best]['time_to_target_s']:.1f} s)"]
    lines += ["", "| auto run | time to target | decisions that switched (server clock) | "
                  "switches (after round, training wall) | rankings |", "|---|---|---|---|---|"]
    for m in _runs(out, "auto"):
        switched = "; ".join(f"{d['at_s']:.1f} s: {d['previous']} -> {d['chosen']} "
                             f"({d['trigger']})" for d in m.get("decisions") or ()
                             if d["switch"]) or \
            f"none (stayed on {(m.get('policy_timeline') or [{}])[0].get('policy', '?')})"
        if m.get("auto_ring_only"):     # the job could not host the PS: ring candidates only
            switched = f"ring only ({m['auto_ring_only']}); {switched}"
        switches = "; ".join(f"{s['from']} -> {s['to']} after round {s['round']} at "
                             f"{s['wall_s']:.1f} s" for s in m.get("switches") or ()) or "-"
        ttt = m.get("time_to_target_s")
        lines.append(f"| {m['_dir']} | {'-' if ttt is None else f'{ttt:.1f} s'} | {switched} | "
                     f"{switches} | {len(m.get('decisions') or ())} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m mpsync.auto.explain COMPARE_OUT_DIR", file=sys.stderr)
        return 2
    try:
        print(comparison_table(argv[0]))
        print()
        print(efficiency_check(argv[0]))
    except (OSError, ValueError, KeyError) as e:
        print(f"mpsync.auto.explain: cannot read {argv[0]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
