"""What ``auto`` did, as tables: ``python -m mpsync.auto.explain OUT``.

``OUT`` is an ``mpsync train`` output directory (its ``metrics.json``: :func:`run_table`
lists every decision of an ``auto`` run, when, on what and why, and the last ranking's
candidates with the target their predicted times are to) or an ``mpsync compare`` output
directory (``compare.json`` and one directory per policy, with ``repeat*/metrics.json`` where
it repeated).  For a comparison, the table sets auto's median time to target beside
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
import math
import sys
from pathlib import Path

from mpsync import policies
from mpsync.auto.measurements import Measurements
from mpsync.auto.ranking import Candidate, rank_candidates

__all__ = ["comparison_table", "efficiency_check", "run_table", "main"]


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


def _measured_in_run(runs) -> dict:
    """Per policy, the efficiencies auto's runs settled on after measuring the policy's
    progress (the confirmations that judged it: ``mpsync.auto.progress``)."""
    found: dict = {}
    for m in runs:
        for d in m.get("decisions") or ():
            eff = (d.get("measurements") or {}).get("efficiency")
            if d.get("trigger") == "confirmation" and eff is not None:
                found.setdefault(d["previous"].split("/")[0], []).append(eff)
    return found


def _own(r: dict, m: dict) -> bool:
    """Is the ranked candidate ``r`` its policy as the comparison ran it: the run's own
    settings (an SSP candidate at the run's bound), the fp32 wire?"""
    config = m.get("config") or {}
    return r.get("wire", "fp32") == "fp32" and all(config.get(k) == v for k, v in r["settings"])


def _first_ranking(runs) -> dict:
    """Per policy, the efficiencies of each auto run's first ranking (``_own`` candidates)."""
    found: dict = {}
    for m in runs:
        ranked = next((d["ranking"] for d in m.get("decisions") or () if d.get("ranking")), [])
        for r in ranked:
            if _own(r, m):
                found.setdefault(r["policy"], []).append(r["efficiency"])
    return found


def _gain_in_run(runs) -> tuple[dict, dict]:
    """Per policy applying updates in full on the PS: (the efficiency the fitted constants give
    it, the one the full-update gain the run measured gives it), each auto run's.

    Both from the run's last ranking, so on the same measured speeds: its efficiency is the
    gain it ranked with over a staleness factor (``efficiency.ps_efficiency``), and the
    factor is kept while the gain is replaced by the fitted constant or by the gain the run
    measured by its end (``auto_gradient_noise``: the noise scale with the constant as its
    prior).  The ranking itself uses a measured gain only below the constant
    (``ranked_gain``); this shows what the measurement said either way."""
    from mpsync.auto.efficiency import PS_FULL_UPDATE_GAIN, ranked_gain

    fitted: dict = {}
    measured: dict = {}
    for m in runs:
        noise = m.get("auto_gradient_noise") or {}
        last = next((d for d in reversed(m.get("decisions") or ()) if d.get("ranking")), None)
        if last is None or noise.get("measured") is None:
            continue
        g = last.get("measurements") or {}
        used = ranked_gain(g.get("ps_gain"), g.get("ps_gain_sd") or 0.0, g.get("ps_gain_lo"),
                           g.get("ps_gain_hi"), g.get("ps_stride_gain"),
                           g.get("ps_stride_gain_sd") or 0.0,
                           capped=g.get("ps_gain_capped", True))
        for r in last["ranking"]:
            spec = policies.get(r["policy"])
            if not _own(r, m) or r["topology"] != "ps" or spec.ps_average:
                continue
            fitted.setdefault(r["policy"], []).append(
                r["efficiency"] * PS_FULL_UPDATE_GAIN / used)
            measured.setdefault(r["policy"], []).append(r["efficiency"] * noise["gain"] / used)
    return fitted, measured


def _closer(measured, in_run, prior) -> str:
    """Which of two estimates is nearer the measured progress per sample, on a log scale (an
    efficiency twice too high is as far off as one half too low)."""
    if measured is None or in_run is None or prior is None:
        return "-"
    off_run, off_prior = abs(math.log(in_run / measured)), abs(math.log(prior / measured))
    if abs(off_run - off_prior) < 1e-9:
        return "same"
    return "the run's" if off_run < off_prior else "the constants'"


def _cell(xs, count: bool = False) -> str:
    if not xs:
        return "-"
    return f"{_median(xs):.2f} ({len(xs)})" if count else f"{_median(xs):.2f}"


def efficiency_check(out) -> str:
    """Markdown: each policy's measured progress per sample (BSP's median samples to the
    target over its own) beside what auto estimated for it: its first ranking's efficiency;
    for a policy applying updates in full on the PS, the efficiency the fitted constants give
    it and the one the gain auto measured in its run gives it (``_gain_in_run``); the one it
    settled on after measuring the policy's progress in its run (a confirmed switch); and
    the one the model predicts now on the comparison's BSP runs.  The last column: which of
    the run's estimate (settled, else the measured gain's) and the fitted constants' is
    nearer the measured progress ("-" where the run measured nothing of that policy)."""
    out = Path(out)
    summary = json.loads((out / "compare.json").read_text())
    samples = {r["policy"]: _median(_samples_to_target(m) for m in _runs(out, r["policy"]))
               for r in summary["rows"]}
    now = _model_now(out, summary["rows"])
    auto_runs = _runs(out, "auto")
    first = _first_ranking(auto_runs)
    fitted, with_gain = _gain_in_run(auto_runs)
    settled_all = _measured_in_run(auto_runs)
    base = next((n for p, n in samples.items() if policies.is_baseline(p)), None)
    lines = ["| policy | samples to target, median | measured progress per sample (BSP = 1) "
             "| auto's first ranking | the fitted constants' (auto's runs) | with the gain "
             "auto measured (runs) | auto's after measuring its progress (runs) "
             "| the model's now | nearer the measured |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p, n in samples.items():
        if p == policies.AUTO:
            continue
        measured = base / n if base and n else None
        settled, gained = settled_all.get(p), with_gain.get(p)
        run_estimate = _median(settled) if settled else (_median(gained) if gained else None)
        prior = _median(fitted[p]) if fitted.get(p) else now.get(p)
        lines.append(f"| {p} | {'-' if n is None else f'{n:.0f}'} | "
                     f"{'-' if measured is None else f'{measured:.2f}'} | "
                     f"{_cell(first.get(p))} | {_cell(fitted.get(p))} | "
                     f"{_cell(gained, True)} | {_cell(settled, True)} | "
                     f"{'-' if now.get(p) is None else f'{now[p]:.2f}'} | "
                     f"{_closer(measured, run_estimate, prior)} |")
    return "\n".join(lines)


def comparison_table(out) -> str:
    """Markdown: the medians, auto against the best fixed policy, and auto's choices."""
    out = Path(out)
    summary = json.loads((out / "compare.json").read_text())
    rows = {r["policy"]: r for r in summary["rows"]}
    fixed = {p: r for p, r in rows.items() if p != "auto" and r.get("time_to_target_s")}
    lines = ["| policy | reached | time to target, median (runs) |", "|---|---|---|"]
    for p, r in rows.items():
        median = r.get("time_to_target_s")
        # A comparison without repeats ran each policy once: its row has the one time only.
        once = r.get("repeats") is None
        runs = ", ".join("-" if t is None else f"{t:.1f}"
                         for t in (r.get("time_to_target_runs_s") or [median] if not once
                                   else [median]))
        reached = (median is not None) if once else r.get("reached")
        lines.append(f"| {p} | {int(reached)}/{1 if once else r['repeats']} | "
                     f"{'-' if median is None else f'{median:.1f} s'} ({runs}) |")
    auto = rows.get("auto")
    if fixed and auto and auto.get("time_to_target_s"):
        best = min(fixed, key=lambda p: fixed[p]["time_to_target_s"])
        ratio = auto["time_to_target_s"] / fixed[best]["time_to_target_s"]
        lines += ["", f"auto / best fixed policy ({best}): **{ratio:.2f}x** "
                      f"(medians {auto['time_to_target_s']:.1f} s / "
                      f"{fixed[best]['time_to_target_s']:.1f} s)"]
    auto_runs = _runs(out, "auto")
    if not auto_runs:
        return "\n".join(lines + ["", "no auto run in this comparison"])
    lines += ["", "| auto run | time to target | decisions that switched (server clock) | "
                  "switches (after round, training wall) | rankings |", "|---|---|---|---|---|"]
    for m in auto_runs:
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


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def run_table(out) -> str:
    """Markdown: one ``mpsync train`` run (``OUT/metrics.json``): its result, and for an
    ``auto`` run each decision (server clock, what triggered it, what ran before and after,
    why) and the last ranking's candidates, best first, with the target their times are to."""
    out = Path(out)
    m = json.loads((out / "metrics.json").read_text())
    c = m.get("config") or {}
    if "workers" not in m or not c:
        raise ValueError("metrics.json has no 'config'/'workers' section (is this an "
                         "mpsync train output?)")
    target = c.get("target_acc")
    reached = "no target accuracy given (--target-acc)" if target is None else \
        f"time to {target} accuracy {_ms(m.get('time_to_target_s'))}"
    lines = [f"{c.get('policy', '?')}/{c.get('topology', '?')} on {len(m['workers'])} "
             f"workers: {reached}, final accuracy {m.get('final_acc', float('nan')):.3f}, "
             f"{m.get('samples_per_s', 0):.0f} samples/s, wall {_ms(m.get('wall_s'))}"]
    decisions = m.get("decisions") or []
    if not decisions:
        lines += ["", "no decisions in this run (only --policy auto decides)"]
        return "\n".join(lines)
    lines += ["", "| at (server clock) | trigger | before -> after | switch | why |",
              "|---|---|---|---|---|"]
    for d in decisions:
        lines.append(f"| {d['at_s']:.1f} s | {d['trigger']} | {d['previous']} -> "
                     f"{d['chosen']} | {'yes' if d['switch'] else 'no'} | {d['reason']} |")
    for s in m.get("switches") or ():
        lines.append(f"\nswitched {s['from']} -> {s['to']} after round {s['round']} at "
                     f"{s['wall_s']:.1f} s of training")
    last = next((d for d in reversed(decisions) if d.get("ranking")), None)
    if last is not None:
        target = (last.get("measurements") or {}).get("target_samples")
        to = "?" if target is None else f"{target:,.0f} BSP-equivalent samples"
        lines += ["", f"the last ranking (at {last['at_s']:.1f} s; predicted time to {to}):",
                  "", "| # | candidate | predicted time | samples/s | efficiency |",
                  "|---|---|---|---|---|"]
        for i, r in enumerate(last["ranking"], 1):
            lines.append(f"| {i} | {r['candidate']} | {r['predicted_time_to_target_s']:.1f} s"
                         f" | {r['samples_per_s']:.0f} | {r['efficiency']:.2f} |")
        note = (last.get("measurements") or {}).get("ps_gain_note")
        if note:
            lines += ["", f"the parameter server's full-update gain it ranked with: {note}"]
        bracket = (last.get("measurements") or {}).get("ps_progress_note")
        if bracket:
            lines += ["", f"bounded by the progress measured on the parameter server: {bracket}"]
    for p in m.get("auto_progress") or ():
        lines += ["", f"the progress measured after the switch, at {p['at_s']:.1f} s: {p['note']}"]
    noise = m.get("auto_gradient_noise")
    if noise:
        lines += ["", f"the gain at the end of the run: {noise['note']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m mpsync.auto.explain OUT (an mpsync train or mpsync compare "
              "output directory)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    try:
        if (out / "compare.json").is_file():
            print(comparison_table(out))
            print()
            print(efficiency_check(out))
        elif (out / "metrics.json").is_file():
            print(run_table(out))
        else:
            print(f"mpsync.auto.explain: {out} has neither compare.json (mpsync compare) nor "
                  f"metrics.json (mpsync train)", file=sys.stderr)
            return 1
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"mpsync.auto.explain: cannot read {out}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
