"""The one place the simulator calls into the state server's policy objects.

Every call the event engine makes on a policy goes through :class:`PolicyDriver`, in the order
and with the bookkeeping the serve loop (``mpsync.server``'s handlers) does around them: a step
report is recorded in the worker table (``rules.record_report``) before ``on_step`` (with the
delayed-ACK flag and the round trip the worker measured, ESync §4.2); a held reply is decided
again with ``decide_held`` after every message and, when released, the worker's last event is
moved to the release time; a SYNC puts the worker in the aggregation (``rules.record_answer``'s
cell); pushes go to ``on_push`` and pulls ask ``may_pull``; an aggregation's end is
``on_reset``; OSP's importance report goes to ``bitmap_for``.  If the server's per-message rules
move to another module, this file is what changes.
"""

from __future__ import annotations

import numpy as np

from mpsync.server import rules
from mpsync.server.policies import make_policy
from mpsync.server.wire import SYNC

__all__ = ["PolicyDriver"]


class PolicyDriver:
    """A policy object and its worker table, driven on a virtual clock."""

    def __init__(self, config, n: int, start: float = 0.0):
        self.policy = make_policy(config, n)
        self.table = self.policy.t
        self.policy.warm_up()
        # Every worker registered at ``start`` (the serve loop's _on_register).
        self.table.registered[:] = True
        self.table.last_event[:] = start

    @property
    def takes_importance(self) -> bool:
        return bool(self.policy.takes_importance)

    def step(self, w: int, k: int, compute: float, now: float, delayed: bool = False,
             rtt: float = 0.0):
        """Worker ``w`` reported iteration ``k`` (compute seconds); the decision or None (held).
        ``delayed``: a report in ESync's delayed-ACK mode with the round trip ``rtt``."""
        rules.record_report(self.table.cells, w, k, compute, now)
        if delayed:
            decision = self.policy.on_step(w, k, compute, now, delayed_ack=True, rtt=rtt)
        else:
            decision = self.policy.on_step(w, k, compute, now)
        return self._answered(w, decision)

    def _answered(self, w: int, decision):
        if decision is not None and decision[0] == SYNC:
            self.table.in_sync[w] = True
        return decision

    def retry(self, w: int, k: int, now: float):
        """A held step decided again at ``now``; on release the worker resumes from ``now``."""
        decision = self.policy.decide_held(w, k, now)
        if decision is not None:
            self.table.last_event[w] = now
        return self._answered(w, decision)

    def reset(self, w: int, round_: int, now: float) -> None:
        self.policy.on_reset(w, round_, now)

    def push(self, w: int, now: float) -> None:
        self.policy.on_push(w, now)

    def may_pull(self, w: int) -> bool:
        return bool(self.policy.may_pull(w))

    def importance(self, w: int, k: int, epoch: int, loss: float, u_max: float,
                   layer_sizes: np.ndarray) -> float:
        """OSP: ``w``'s importance report of iteration ``k`` (the serve loop's
        ``_on_importance``); returns the fraction of the model the bitmap of ``k`` puts in the
        In-Computation Sync.  Every layer equally important: the bitmap's size, not which
        layers it picks, is what costs time."""
        bitmap = self.policy.bitmap_for(k, np.ones(layer_sizes.size), layer_sizes, loss,
                                        epoch, u_max, w)
        return float(layer_sizes[bitmap].sum() / layer_sizes.sum())

    def staleness(self, w: int) -> int:
        """How far ``w`` is ahead of the slowest worker in pushes (the serve loop's gap)."""
        p = self.table.pushes
        return int(p[w] - p.min())

    def describe(self) -> dict:
        return self.policy.describe()
