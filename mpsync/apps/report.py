"""What a run leaves behind: metrics.json, accuracy.png, timeline.png and trace.json.

``metrics.json`` schema (version 1)::

    {"schema": 1, "config": {...}, "evals": [{"wall_s","samples","accuracy","loss"}],
     "workers": {"<rank>": {"iterations","samples","rounds","compute_s","wait_s",
                            "aggregation_s","bytes_sent","slept_s","host"}},
     "total_samples", "wall_s", "final_acc", "final_loss", "time_to_target_s" (null if not
     reached), "samples_per_s", "wait_fraction", "bytes_per_sample", "data_bytes_per_sample",
     "min_data_bytes_per_sample", "control_bytes_per_sample", "server": {...}}

``wait_fraction`` is the share of worker time not spent computing: server waits plus
aggregation (which includes waiting for slower peers in a collective), over compute + those.
"""

from __future__ import annotations

import contextlib
import json
import textwrap
import os
from pathlib import Path

from mpsync import policies as registry

__all__ = ["summarize", "write_metrics", "plot_accuracy", "plot_timeline", "write_trace",
           "time_to_target", "format_table", "format_repeats_table", "comparison_figure",
           "plot_run", "pyplot"]

EVENT_COLORS = {"compute": "#4c72b0", "wait_server": "#dd8452", "aggregate": "#c44e52",
                "ics_wait": "#8172b3"}


def time_to_target(evals: list[dict], target: float | None) -> float | None:
    if target is None:
        return None
    for e in evals:
        if e["accuracy"] >= target:
            return float(e["wall_s"])
    return None


def summarize(metrics: dict, target: float | None) -> dict:
    """Fill in the derived fields from ``evals`` and ``workers``."""
    workers = metrics["workers"].values()
    total = sum(w["samples"] for w in workers)
    busy = sum(w["compute_s"] for w in workers)
    idle = sum(w["wait_s"] + w["aggregation_s"] for w in workers)
    wall = metrics["wall_s"]
    last = metrics["evals"][-1] if metrics["evals"] else {"accuracy": None, "loss": None}
    metrics.update(
        total_samples=total,
        final_acc=last["accuracy"], final_loss=last["loss"],
        time_to_target_s=time_to_target(metrics["evals"], target),
        samples_per_s=total / wall if wall > 0 else None,
        wait_fraction=idle / (busy + idle) if busy + idle > 0 else 0.0,
        bytes_per_sample=sum(w["bytes_sent"] for w in workers) / total if total else None,
        **_bytes_per_sample(workers, total),
    )
    return metrics


def _bytes_per_sample(workers, total: int) -> dict:
    """Bytes moved per sample, each byte once (at its sender): the data plane (a worker's
    sends, and the shard server it hosts: the pulls it answers) and the control plane (a
    worker's messages to the state server and the replies), and the analytic minimum of the
    data plane for the synchronizations done (ring 2(n-1)/n·B per worker and round, sharded
    PS 2·B per worker and push+pull).  A worker's push to the shard on its own rank counts
    though it crosses no link.  None for runs that did not count them."""
    workers = list(workers)
    if not total or not all("data_sent" in w for w in workers):
        return {"data_bytes_per_sample": None, "min_data_bytes_per_sample": None,
                "control_bytes_per_sample": None}
    data = sum(w["data_sent"] + w.get("shard_sent", 0) for w in workers)
    return {"data_bytes_per_sample": data / total,
            "min_data_bytes_per_sample": sum(w["data_min"] for w in workers) / total,
            "control_bytes_per_sample": sum(w["control_sent"] + w["control_received"]
                                            for w in workers) / total}


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_metrics(metrics: dict, out: Path) -> Path:
    path = Path(out) / "metrics.json"
    _atomic_write_text(path, json.dumps(metrics, indent=1, default=float) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot drawing to files (Agg); imported on first use: it is heavy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mark_switches(ax, marks) -> None:
    """Policy auto: a vertical line at each switch, labelled with the policy that runs from
    there (``marks``: [(x, label)])."""
    for x, label in marks or ():
        ax.axvline(x, color="black", ls=":", lw=1)
        ax.annotate(label, (x, 0.02), xycoords=("data", "axes fraction"), rotation=90,
                    va="bottom", ha="right", fontsize=8)


def plot_accuracy(series: dict[str, list[dict]], path: Path, *, target: float | None = None,
                  title: str = "", restarts: list[dict] | None = None, marks=None) -> Path:
    """Accuracy vs wall time, one line per run (``series``: label -> evals); ``restarts``
    (metrics.json's): a dotted line where each restart resumed from; ``marks``: policy
    switches (auto)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _mark_switches(ax, marks)
    for label, evals in series.items():
        ax.plot([e["wall_s"] for e in evals], [e["accuracy"] for e in evals], marker=".",
                label=label)
    if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:g}")
    for r in restarts or []:
        if r.get("resumed_from"):
            ax.axvline(r["resumed_from"]["wall_s"], color="red", ls=":", lw=1,
                       label=f"restart: {r['workers_before']} -> {r['workers_after']} workers")
    ax.set_xlabel("wall time (s, evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_run(out: Path) -> None:
    """``accuracy.png`` and ``timeline.png`` of the run in ``out``, from its
    ``metrics.json`` and ``trace.json`` (``mpsync train`` calls it at its end, or, with
    ``--no-plots``, the caller does once every run is over: ``mpsync compare`` plots all its
    runs in one process instead of importing matplotlib once per run)."""
    out = Path(out)
    metrics = json.loads((out / "metrics.json").read_text())
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    events: dict[int, list] = {}
    for e in trace:
        if e.get("ph") == "X":
            a = e["ts"] * 1e-6
            events.setdefault(int(e["tid"]), []).append((e["name"], a, a + e["dur"] * 1e-6))
    c = metrics["config"]
    title = f"{c['policy']} on {c['topology']}, {c['heterogeneity']}"
    switches = metrics.get("switches") or []
    plot_accuracy({c["policy"]: metrics["evals"]}, out / "accuracy.png",
                  target=c.get("target_acc"), title=title, restarts=metrics.get("restarts"),
                  marks=[(s["wall_s"], f"{s['from']} -> {s['to']}") for s in switches])
    at = [a for name, a, _ in events.get(0, ()) if name == "switch"]
    plot_timeline(events, out / "timeline.png", t0=0.0, title=title,
                  marks=[(a, s["to"]) for a, s in zip(at, switches)])


def plot_timeline(events: dict[int, list], path: Path, *, t0: float, title: str = "",
                  marks=None) -> Path:
    """Per worker, compute / server-wait / aggregation bars over wall time (``events``:
    worker -> [(name, start, end)] in wall-clock seconds); ``marks``: policy switches."""
    plt = pyplot()
    workers = sorted(events)
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(workers) + 1.6))
    _mark_switches(ax, [(x - t0, label) for x, label in marks or ()])
    for row, w in enumerate(workers):
        by_name: dict[str, list] = {}
        for name, a, b in events[w]:
            by_name.setdefault(name, []).append((a - t0, max(b - a, 1e-4)))
        for name, spans in by_name.items():
            ax.broken_barh(spans, (row - 0.35, 0.7), color=EVENT_COLORS.get(name, "#999999"),
                           label=name if row == 0 or name not in _seen(ax) else None)
    ax.set_yticks(range(len(workers)), [f"worker {w}" for w in workers])
    ax.set_xlabel("wall time (s)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in EVENT_COLORS.values()]
    ax.legend(handles, list(EVENT_COLORS), ncol=4, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _seen(ax) -> set:
    return {c.get_label() for c in ax.collections}


def write_trace(events: dict[int, list], evals: list[dict], path: Path, *, t0: float) -> Path:
    """Chrome trace event format (chrome://tracing, ui.perfetto.dev): one thread per worker."""
    out = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "mpsync workers"}}]
    for w in sorted(events):
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": int(w),
                    "args": {"name": f"worker {w}"}})
        for name, a, b in events[w]:
            out.append({"name": name, "ph": "X", "pid": 0, "tid": int(w),
                        "ts": round((a - t0) * 1e6, 1), "dur": round(max(b - a, 0) * 1e6, 1)})
    for e in evals:
        out.append({"name": f"eval acc={e['accuracy']:.3f}", "ph": "i", "s": "g", "pid": 0,
                    "tid": 0, "ts": round(e.get("wall_clock", t0) - t0, 6) * 1e6})
    _atomic_write_text(Path(path), json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    return Path(path)


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _baseline() -> str:
    """The baseline's name as the tables print it (``BSP``)."""
    return registry.BASELINE.upper()


def format_table(rows: list[dict]) -> str:
    """The compare table (Markdown, so it pastes into a README)."""
    head = ["policy", "time to target (s)", "final acc", "samples/s", "wait fraction",
            BYTES_HEAD, "control bytes/sample", f"speedup vs {_baseline()}"]
    return _markdown(head, [
        [r["policy"], _fmt(r["time_to_target_s"], ".1f", "not reached"),
         _fmt(r["final_acc"], ".3f"), _fmt(r["samples_per_s"], ".0f"),
         _fmt(r["wait_fraction"], ".2f"), _data_bytes(r),
         _si(r.get("control_bytes_per_sample")), _speedup(r)]
        for r in rows])


# Data bytes moved per sample (each byte once), measured, and the analytic minimum for the
# topology in parentheses (``_bytes_per_sample``).
BYTES_HEAD = "data bytes/sample (min)"


def _si(v) -> str:
    if v is None:
        return "-"
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.{0 if abs(v) >= 100 * size else 1}f}{unit}"
    return f"{v:.0f}"


def _data_bytes(r: dict) -> str:
    if r.get("data_bytes_per_sample") is None:
        return "-"
    return f"{_si(r['data_bytes_per_sample'])} ({_si(r.get('min_data_bytes_per_sample'))})"


def format_repeats_table(rows: list[dict]) -> str:
    """The table of ``mpsync compare --repeats``: medians with their min–max."""
    head = ["policy", "reached", "time to target (s): median (min–max)",
            "final acc: median (min–max)", "samples/s", "wait fraction", BYTES_HEAD,
            f"speedup vs {_baseline()} "
            f"({rows[0].get('speedup_basis', 'medians') if rows else 'medians'})"]
    out = []
    for r in rows:
        ttt = (f"{_fmt(r['time_to_target_s'], '.1f', 'not reached')} "
               f"({_fmt(r['time_to_target_min_s'], '.1f')}–"
               f"{_fmt(r['time_to_target_max_s'], '.1f', 'not reached')})")
        acc = (f"{_fmt(r['final_acc'], '.3f')} ({_fmt(r['final_acc_min'], '.3f')}–"
               f"{_fmt(r['final_acc_max'], '.3f')})")
        out.append([r["policy"], f"{r['reached']}/{r['repeats']}", ttt, acc,
                    f"{r['samples_per_s']:.0f}", f"{r['wait_fraction']:.2f}", _data_bytes(r),
                    _speedup(r)])
    return _markdown(head, out)


def _speedup(r: dict) -> str:
    if r.get("speedup_vs_baseline") is not None:
        return f"{r['speedup_vs_baseline']:.2f}x"
    if r.get("speedup_at_least") is not None:
        return f"> {r['speedup_at_least']:.1f}x ({_baseline()} missed the target)"
    return "-"


@contextlib.contextmanager
def comparison_figure(path: Path, target: float, setup: str):
    """The two panels of a comparison's plot, written to ``path`` on leaving: yields pyplot,
    the accuracy-over-time axes (the caller draws the curves) and the times-to-target axes."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    try:
        yield plt, ax, bx
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        bx.grid(alpha=0.3, axis="y")
        # The setup line names every setting: wrapped, or the figure cuts it at both ends.
        fig.suptitle(textwrap.fill(setup, 180), fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
