"""A read-only view of a state server, and its stats as JSON-ready data.

Tests, tools and the stats writer read the server through this view, never through its
internals: every array is a read-only numpy view of the live table (a write raises), so looking
cannot change what the server decides.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpsync.server._stats import jsonable, rss_kb

__all__ = ["ServerView"]


def _frozen(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class ServerView:
    """What a :class:`~mpsync.server.StateServer` knows, read-only.

    ``tables``: the per-worker cells of ``rules.Tables`` plus ``done``, ``registered``,
    ``pushes`` and ``final_pushed`` (name -> array indexed by worker); ``counters``: the
    per-worker counters; ``events``: the event rows written so far, oldest first;
    ``held``: the replies held back, as ``(message kind, worker, argument)``; ``rejected``:
    ``{(source rank, reason): count}``; ``ranks``: worker index -> communicator rank.
    """

    def __init__(self, server):
        self._server = server
        t, c = server.table, server.counters
        tables = dict(t.cells._asdict())
        tables.update(done=t.done, registered=t.registered, pushes=t.pushes,
                      final_pushed=t.final_pushed)
        self.tables = {k: _frozen(v) for k, v in tables.items()}
        counters = dict(c.cells._asdict())
        counters.update(pushes=c.pushes, pulls=c.pulls, held_pulls=c.held_pulls)
        self.counters = {k: _frozen(v) for k, v in counters.items()}
        self.ranks = tuple(server.ranks)
        self.policy = server.config.policy
        self.fast_path = server.fast is not None

    @property
    def events(self) -> np.ndarray:
        ev = self._server.events
        n = min(ev.count, ev.capacity)
        order = (np.arange(ev.count - n, ev.count) % ev.capacity)
        return _frozen(ev.rows[order])

    @property
    def held(self) -> tuple:
        from mpsync.server import wire as W

        return tuple((W.TAG_NAMES[tag], w, arg) for tag, _, w, _, arg in self._server.held)

    @property
    def rejected(self) -> dict:
        return dict(self._server.rejected)

    @property
    def ps_version(self) -> int:
        return self._server.weights.version

    def policy_state(self) -> dict:
        return jsonable(self._server.policy.describe())

    def stats(self) -> dict:
        """Per-worker totals, events, the policy's own state, memory samples."""
        s = self._server
        c, t = self.counters, self.tables
        workers = {}
        for w, r in enumerate(self.ranks):
            workers[str(r)] = {
                "iterations": int(c["steps"][w]), "last_iteration": int(t["iteration"][w]),
                "rounds": int(c["rounds"][w]), "compute_s": float(c["compute_s"][w]),
                "wait_server_s": float(c["wait_server_s"][w]),
                "aggregation_s": float(c["aggregation_s"][w]),
                "decisions": {"LOCAL": int(c["locals"][w]), "SYNC": int(c["syncs"][w])},
                "pushes": int(c["pushes"][w]), "pulls": int(c["pulls"][w]),
                "held_pulls": int(c["held_pulls"][w]),
                "removed": bool(t["removed"][w]), "done": bool(t["done"][w]),
                "beat_period_s": float(s.beat_period[w]),
                "beat_gap_max_s": round(float(s.beat_gap[w]), 4),
                "beat_gap_at_iteration": int(s.beat_gap_at[w]),
            }
        now = round(MPI.Wtime() - s.t0, 3)
        return {"policy": s.config.policy, "topology": s.config.topology,
                "server": s.config.server, "server_rank": s.server_rank,
                "workers": workers, "elapsed_s": MPI.Wtime() - s.t0,
                "rejected_messages": int(s.counters.rejected), "messages": dict(s.messages),
                "beats": int(s.beats),
                "max_staleness_gap": int(s.counters.max_gap), "ps_version": self.ps_version,
                "policy_state": self.policy_state(),
                "rss_kb": s.rss_samples + [[now, rss_kb()]],
                "events": s.events.as_list(self.ranks)}
