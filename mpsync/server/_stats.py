"""Server-side counters, a bounded event log, and the stats/trace writers.

Memory stays flat under any load: counters are fixed per-worker arrays and events go into a
fixed-size ring of rows (the newest ``capacity`` events are kept).

Tables touched once per message are ``array.array`` objects, each with a numpy view of the
same memory (:func:`mirrored`): the per-message path reads and writes single cells through
the ``array.array`` (about 0.1 µs a cell), the numpy view serves whole-table operations.  A
numpy scalar read or write costs 0.4-1 µs, and a step touched more than twenty of them.
"""

from __future__ import annotations

import array
import json
import os
import tempfile

import numpy as np

__all__ = ["ServerCounters", "EventLog", "mirrored", "write_stats_json", "write_chrome_trace"]

_NUMPY_TYPE = {"d": np.float64, "q": np.int64, "b": np.bool_}


def mirrored(typecode: str, n: int, fill=0) -> tuple[array.array, np.ndarray]:
    """``n`` cells as an ``array.array`` (typecode ``d`` float64, ``q`` int64, ``b`` bool)
    and a numpy view of the same memory (module doc)."""
    cells = array.array(typecode, [fill]) * n
    return cells, np.frombuffer(cells, dtype=_NUMPY_TYPE[typecode])

# "pull": a PS pull answered (value: the worker's pushes so far); "held": a PS pull held back
# by the staleness rule (same value).  Together they show which iterations ran without waiting.
EVENT_KINDS = ("register", "report", "sync", "reset", "push", "shutdown", "removed", "pull",
               "held", "resume")


class ServerCounters:
    """Per-worker counters, as ``array.array`` (module doc: one message updates several)."""

    def __init__(self, n: int):
        self.steps = array.array("q", [0]) * n
        self.syncs = array.array("q", [0]) * n
        self.locals = array.array("q", [0]) * n
        self.rounds = array.array("q", [0]) * n
        self.pushes = array.array("q", [0]) * n
        self.pulls = array.array("q", [0]) * n
        self.held_pulls = array.array("q", [0]) * n
        self.compute_s = array.array("d", [0.0]) * n
        self.wait_server_s = array.array("d", [0.0]) * n   # as reported by the worker
        self.aggregation_s = array.array("d", [0.0]) * n
        self.rejected = 0
        self.max_gap = 0  # PS: largest push-count lead over the slowest at a pull


class EventLog:
    """(time since server start, worker index, kind, value) rows in a ring buffer."""

    def __init__(self, capacity: int = 200_000):
        # Filled now (not left to lazy zero pages) so the log's memory is paid at start.
        self._cells, flat = mirrored("d", 4 * capacity, -1.0)
        self.rows = flat.reshape(capacity, 4)
        self.capacity = capacity
        # Events written so far, in a cell the server's compiled path also writes (_fastpath).
        self._count, self.count_cell = mirrored("q", 1)
        self._kind = {k: i for i, k in enumerate(EVENT_KINDS)}

    @property
    def count(self) -> int:
        return self._count[0]

    def add(self, t: float, w: int, kind: str, value: int) -> None:
        count = self._count[0]
        i = 4 * (count % self.capacity)
        cells = self._cells
        cells[i] = t
        cells[i + 1] = w
        cells[i + 2] = self._kind[kind]
        cells[i + 3] = value
        self._count[0] = count + 1

    def as_list(self, ranks) -> list:
        n = min(self.count, self.capacity)
        start = self.count - n
        out = []
        for i in range(start, self.count):
            t, w, kind, value = self.rows[i % self.capacity].tolist()
            # Nanoseconds: enough to rebuild the server's decisions from its events exactly.
            out.append([round(t, 9), int(ranks[int(w)]), EVENT_KINDS[int(kind)], int(value)])
        return out


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
