"""Horovod's ``start_timeline`` / ``stop_timeline`` on mpsync's own timeline: the spans each
worker records (``compute``, ``wait_server``, ``aggregate``: ``mps.stats()["local"]["events"]``,
the worker threads of the state server's Chrome trace).  ``stop_timeline`` writes the spans
recorded since ``start_timeline`` as a Chrome trace (chrome://tracing, ui.perfetto.dev) on
worker 0, as Horovod writes its timeline from rank 0 only; it is not collective.
"""

from __future__ import annotations

import json
import os

from mpsync.torch import _runtime

__all__ = ["start_timeline", "stop_timeline"]


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording this worker's spans for ``file_path`` (``mark_cycles`` is accepted for
    Horovod's signature: mpsync has no background cycles to mark)."""
    ctx = _runtime.worker_context("start_timeline")
    if not file_path:
        raise ValueError("start_timeline needs a file path")
    ctx.timeline = (str(file_path), len(ctx.counters.events))


def stop_timeline() -> None:
    """Write the spans since ``start_timeline`` (worker 0) and stop recording."""
    ctx = _runtime.worker_context("stop_timeline")
    started = ctx.timeline
    if started is None:
        return
    ctx.timeline = None
    path, first = started
    if ctx.worker_rank != 0:
        return
    spans = ctx.counters.events[first:]
    t0 = spans[0][1] if spans else 0.0
    out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": f"worker {ctx.worker_rank}"}}]
    out += [{"name": n, "ph": "X", "pid": 0, "tid": 0, "ts": round((a - t0) * 1e6, 1),
             "dur": round(max(b - a, 0.0) * 1e6, 1)} for n, a, b in spans]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
