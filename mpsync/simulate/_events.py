"""The exact engine: one event at a time, every decision made by the real policy object.

Workers follow the strategies of ``mpsync.torch.strategies`` (compute, report, then on SYNC a
ring collective or a push and a pull through the parameter server, then reset), the server
answers through :class:`~mpsync.simulate._adapter.PolicyDriver`.  Cost: a few µs of Python per
event plus the policy's own work, so it is the reference and the engine for small runs and
trace replays; :mod:`~mpsync.simulate._fast_ring` and :mod:`~mpsync.simulate._fast_ps` are the
ones for thousands of workers.
"""

from __future__ import annotations

import heapq

import numpy as np

from mpsync import policies
from mpsync.server.wire import SYNC
from mpsync.simulate._adapter import PolicyDriver
from mpsync.simulate._stats import Recorder

__all__ = ["run_events"]

# event kinds, ordered so that at equal times a server message is handled before a worker
# acts on a reply sent at that same instant
_SRV_STEP, _SRV_RESET, _SRV_PUSH, _SRV_PULL, _DONE, _REPLY, _AGG_DONE, _PULLED = range(8)
_SERVER_MESSAGES = (_SRV_STEP, _SRV_RESET, _SRV_PUSH, _SRV_PULL)


def run_events(config, speeds, cost, *, iterations=None, duration=None, batch_size=32):
    """Simulate ``config.policy`` on ``speeds`` until ``n * iterations`` worker iterations are
    done in total or the virtual clock reaches ``duration``; returns a :class:`Recorder`."""
    run = _EventRun(config, speeds, cost, batch_size)
    total_target = None if iterations is None else speeds.n * iterations
    t_end = run.play(total_target, duration)
    run.rec.finish(t_end)
    run.rec.policy_state = run.drv.describe()
    return run.rec


class _EventRun:
    """One simulated run: the event heap, the workers' and the server's state, and one
    handler per event kind (workers: ``iteration_done``, ``replied``, ``aggregated``; the
    server: ``server_*``)."""

    def __init__(self, config, speeds, cost, batch_size):
        n = self.n = speeds.n
        self.speeds, self.cost = speeds, cost
        self.drv = PolicyDriver(config, n)
        self.ps = config.topology == "ps"
        self.rec = Recorder(n, ps=self.ps, batch_size=batch_size)
        self.heap: list = []
        self.seq = 0
        self.half = cost.query / 2
        self.k = np.zeros(n, dtype=np.int64)      # iterations done per worker
        self.rnd = np.zeros(n, dtype=np.int64)    # rounds completed per worker
        self.last_c = np.zeros(n)
        self.held: list = []                      # (kind, w, k) replies the policy holds
        self.entered: list = []                   # ring: workers in the current collective
        self.enter_max = 0.0
        self.link_free = 0.0                      # PS: when the server's link is free again
        overlapped = policies.get(config.policy).simulation_model(config.topology) == "overlap"
        self.osp_ics = config.osp_ics_max_fraction if overlapped else 0.0
        self.handlers = {_SRV_STEP: self.server_step, _SRV_RESET: self.server_reset,
                         _SRV_PUSH: self.server_push, _SRV_PULL: self.server_pull,
                         _REPLY: self.replied, _AGG_DONE: self.aggregated,
                         _PULLED: self.aggregated}

    def play(self, total_target, duration) -> float:
        """Handle events in time order until the target or the horizon; returns the end time."""
        for w in range(self.n):
            self.start_iteration(w, 0.0)
        t_end = 0.0
        while self.heap:
            t, kind, _, w, arg = heapq.heappop(self.heap)
            if duration is not None and t > duration:
                return duration
            t_end = t
            if kind == _DONE:
                self.iteration_done(w, t)
                if total_target is not None and self.rec.total_iterations >= total_target:
                    break
                continue
            self.handlers[kind](w, t, arg, kind)
            if self.held and kind in _SERVER_MESSAGES:
                self.retry_held(t)
        return t_end

    # -- scheduling and shared resources ----------------------------------------------------
    def schedule(self, t, kind, w, arg=None):
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, w, arg))

    def start_iteration(self, w, t):
        c = self.speeds.time_of(w, t)
        self.last_c[w] = c
        pause = self.speeds.pause
        if pause is not None and pause[w] > 0:
            self.rec.pause(w, t, pause[w])
            t += pause[w]
        else:
            self.rec.phase(w, "compute", t)
        self.schedule(t + c, _DONE, w)

    def link(self, t):
        """When a transfer through the server's link that is ready at ``t`` is done."""
        if not self.cost.shared_link:
            return t + self.cost.link()
        self.link_free = max(t, self.link_free) + self.cost.link()
        return self.link_free

    def answer(self, w, decision, now):
        action = decision[0]
        if action == SYNC:
            self.rec.sync(w)
        self.schedule(now + self.half, _REPLY, w, action)

    def release_pull(self, w, now):
        self.rec.staleness(self.drv.staleness(w))
        self.schedule(self.link(now) + self.half, _PULLED, w)

    def retry_held(self, now):
        """After each server message, ask the policy again about every held reply."""
        still = []
        for item in self.held:
            kind, w, kw = item
            if kind == _SRV_STEP:
                d = self.drv.retry(w, kw, now)
                if d is None:
                    still.append(item)
                else:
                    self.answer(w, d, now)
            elif self.drv.may_pull(w):
                self.release_pull(w, now)
            else:
                still.append(item)
        self.held = still

    # -- workers ----------------------------------------------------------------------------
    def iteration_done(self, w, t):
        self.k[w] += 1
        self.rec.iteration(w, self.last_c[w])
        self.rec.phase(w, "wait", t)
        self.schedule(t + self.half, _SRV_STEP, w, self.last_c[w])

    def replied(self, w, t, action, _kind):
        if action != SYNC:
            self.rec.local(w)
            self.start_iteration(w, t)
            return
        self.rec.phase(w, "aggregate", t)
        if self.ps:
            self.schedule(self.link(t), _SRV_PUSH, w)
        else:
            self.enter_collective(w, t)

    def enter_collective(self, w, t):
        """Ring: the collective runs once the last worker of the round has entered it."""
        self.entered.append(w)
        self.enter_max = max(self.enter_max, t)
        if len(self.entered) < self.n:
            return
        cost, osp_ics = self.cost, self.osp_ics
        blocking = cost.ring(self.n, 1.0 - osp_ics)
        # OSP's In-Computation Sync overlaps the next iteration; what does not fit under the
        # shortest next compute is paid on top.
        hidden = max(0.0, cost.ring(self.n, osp_ics) - float(self.last_c.min())) \
            if osp_ics else 0.0
        done = self.enter_max + blocking + hidden
        self.rec.aggregation_cost(blocking + hidden, self.n)
        for v in self.entered:
            self.schedule(done, _AGG_DONE, v)
        self.entered, self.enter_max = [], 0.0

    def aggregated(self, w, t, _arg, kind):
        """The collective (ring) or the pull (PS) is done: reset, then the next iteration."""
        self.rnd[w] += 1
        if kind == _PULLED:
            self.rec.aggregation_cost(2 * self.cost.link(), 1)
        self.schedule(t + self.half, _SRV_RESET, w, int(self.rnd[w]))
        self.start_iteration(w, t)
        self.rec.round(w)

    # -- the server -------------------------------------------------------------------------
    def server_step(self, w, t, compute, _kind):
        self.rec.message()
        d = self.drv.step(w, int(self.k[w]), compute, t)
        if d is None:
            self.held.append((_SRV_STEP, w, int(self.k[w])))
        else:
            self.answer(w, d, t)

    def server_reset(self, w, t, rounds, _kind):
        self.rec.message()
        self.drv.reset(w, rounds, t)

    def server_push(self, w, t, _arg, _kind):
        self.rec.message()
        self.drv.push(w, t)
        # the push's reply goes back and the pull request comes in: one query round trip
        self.schedule(t + self.cost.query, _SRV_PULL, w)

    def server_pull(self, w, t, _arg, _kind):
        self.rec.message()
        if self.drv.may_pull(w):
            self.release_pull(w, t)
        else:
            self.held.append((_SRV_PULL, w, 0))
