"""Server-side counters, a bounded event log, and the stats/trace writers.

Memory stays flat under any load: counters are fixed per-worker arrays and events go into a
fixed-size ring of rows (the newest ``capacity`` events are kept).  The arrays a message
touches are the per-message rules' named tuples (``rules.Counters``, ``rules.Events``), written
by the same rules from both serve loops.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from mpsync.server import rules
from mpsync.server.rules import EVENT_KINDS

__all__ = ["ServerCounters", "EventLog", "EVENT_KINDS", "write_stats_json", "write_chrome_trace",
           "jsonable", "rss_kb"]


class ServerCounters:
    """Per-worker counters: ``cells`` (``rules.Counters``: steps, syncs, locals, rounds and
    the time totals, also attributes here) and the parameter server's."""

    def __init__(self, n: int):
        self.cells = rules.new_counters(n)
        (self.steps, self.syncs, self.locals, self.rounds, self.compute_s, self.wait_server_s,
         self.aggregation_s) = self.cells
        self.pushes = np.zeros(n, dtype=np.int64)
        self.pulls = np.zeros(n, dtype=np.int64)
        self.held_pulls = np.zeros(n, dtype=np.int64)
        self.rejected = 0
        self.max_gap = 0  # PS: largest push-count lead over the slowest still pushing, at a pull


class EventLog:
    """(time since server start, worker index, kind, value) rows in a ring buffer."""

    def __init__(self, capacity: int = 200_000):
        self.cells = rules.new_events(capacity)
        self.rows = self.cells.rows
        self.capacity = capacity
        self._kind = {k: i for i, k in enumerate(EVENT_KINDS)}

    @property
    def count(self) -> int:
        return int(self.cells.count[0])

    def add(self, t: float, w: int, kind: str, value: int) -> None:
        rules.log_event(self.cells, t, w, self._kind[kind], value)

    def as_list(self, ranks) -> list:
        n = min(self.count, self.capacity)
        start = self.count - n
        out = []
        for i in range(start, self.count):
            t, w, kind, value = self.rows[i % self.capacity].tolist()
            # Nanoseconds: enough to rebuild the server's decisions from its events exactly.
            out.append([round(t, 9), int(ranks[int(w)]), EVENT_KINDS[int(kind)], int(value)])
        return out


def rss_kb() -> int:
    """This process's resident memory in KiB (-1 where /proc is unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def jsonable(x):
    """``x`` with numpy arrays and scalars turned into lists and Python numbers."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x


def _atomic_write(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_stats_json(stats: dict, path: str) -> None:
    """The stats dict as JSON (written to a temporary file, then renamed)."""
    _atomic_write(path, json.dumps(stats, indent=1))


def write_chrome_trace(stats: dict, path: str) -> None:
    """The server's view of each worker as a Chrome trace (chrome://tracing, Perfetto).

    One row (tid) per worker rank: "compute" spans between a worker's consecutive reports or
    from a reset to the next report, "sync" spans from a SYNC decision to the worker's reset,
    and instant events for registration, removal and shutdown.  Times are the server's clock.
    """
    # Every event, metadata too, carries ph/ts/pid/tid: some trace readers require all four.
    trace = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "ts": 0,
              "args": {"name": "mpsync server"}}]
    last: dict[int, float] = {}
    sync_start: dict[int, float] = {}
    for t, rank, kind, value in stats.get("events", []):
        us = t * 1e6
        if rank not in last:
            trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "ts": 0,
                          "args": {"name": f"worker rank {rank}"}})
        if kind == "report" and rank in last:
            trace.append({"name": "compute", "ph": "X", "pid": 0, "tid": rank, "ts": last[rank],
                          "dur": max(us - last[rank], 0.0), "args": {"iteration": value}})
        elif kind == "sync":
            sync_start[rank] = us
        elif kind == "reset" and rank in sync_start:
            start = sync_start.pop(rank)
            trace.append({"name": "sync", "ph": "X", "pid": 0, "tid": rank, "ts": start,
                          "dur": max(us - start, 0.0), "args": {"round": value}})
        elif kind in ("register", "removed", "shutdown", "push", "pull", "held", "resume"):
            trace.append({"name": kind, "ph": "i", "s": "t", "pid": 0, "tid": rank, "ts": us,
                          "args": {"value": value}})
        last[rank] = us
    _atomic_write(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
