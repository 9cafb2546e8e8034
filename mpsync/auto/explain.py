"""What ``auto`` did in a comparison, as a table: ``python -m mpsync.auto.explain OUT``.

``OUT`` is an ``mpsync compare`` output directory (``compare.json`` and one directory per
policy with ``repeat*/metrics.json``).  The table sets auto's median time to target beside
the best fixed policy's of the same comparison (the ratio the acceptance of ``auto`` is
about) and lists, per auto run, what it chose and when: each decision that switched (the
server's clock from its first report) and each switch's round and training wall time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["comparison_table", "main"]


def _runs(out: Path, policy: str) -> list[dict]:
    runs = []
    for path in sorted((out / policy).glob("repeat*/metrics.json")):
        runs.append(json.loads(path.read_text()) | {"_dir": path.parent.name})
    one = out / policy / "metrics.json"
    if not runs and one.exists():
        runs.append(json.loads(one.read_text()) | {"_dir": "."})
    return runs


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
                             if d["switch"]) or "none (stayed on bsp)"
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
    except (OSError, ValueError, KeyError) as e:
        print(f"mpsync.auto.explain: cannot read {argv[0]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
