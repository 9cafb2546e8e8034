"""The exact engine: one event at a time, every decision made by the real policy object.

Workers follow the strategies of ``mpsync.torch`` (``strategies``, ``strategies.ps``,
``strategies.two_stage``), chosen as the workers choose them, from the policy registry:

* compute an iteration, report it (one query round trip) and act on the answer: LOCAL goes on
  computing, SYNC aggregates (ring: a collective once every worker has entered it; PS: a push
  then a pull, the pull answered when the policy's staleness rule allows), then a reset;
* ElasticBSP on the PS (registry model ``superstep``, ``strategies.ps.ElasticSuperstep``):
  every iteration pushes and pulls, the SYNC'd one is the barrier (its pull held by the policy
  until every barrier push is in), ZipLine paper §6.2.5;
* ESync (the registry's ``query_state`` family, ``strategies.LocalStepsThenAggregate``): the
  first iteration's report is the capability test of Alg. 1 (k = 0, held by the server until
  every capability is known), then the same iteration is reported as k = 1; in delayed-ACK mode
  (§4.2) a report is not waited for, and a READY that arrived while an iteration ran aborts it
  (its work discarded) and the worker aggregates;
* OSP (a policy that ``takes_importance``, ``two_stage.TwoStageSync``): each report carries
  the epoch, the loss and the worker's Eq. 5 bound (``TrainingModel``), the server's OSP object
  returns the bitmap (Alg. 1), and the collective moves the Routine Sync part blocking and the
  In-Computation Sync part under the next iteration (what does not fit is paid on top).  The
  importance exchange rides on the step's round trip.

The server answers through :class:`~mpsync.simulate._adapter.PolicyDriver`; the PS's shard
servers cost what ``CostModel`` says, pushes and pulls queueing at them.  A few µs of Python per
event plus the policy's own work: the reference, and the engine for small runs and trace
replays; :mod:`~mpsync.simulate._fast_ring` and :mod:`~mpsync.simulate._fast_ps` are the ones
for thousands of workers.
"""

from __future__ import annotations

import heapq

import numpy as np

from mpsync import policies
from mpsync.server.wire import SYNC
from mpsync.simulate._adapter import PolicyDriver
from mpsync.simulate._stats import Recorder
from mpsync.simulate._training import TrainingModel

__all__ = ["run_events", "worker_behaviour"]

# event kinds, ordered so that at equal times a server message is handled before a worker
# acts on a reply sent at that same instant
_SRV_STEP, _SRV_RESET, _SRV_PUSH, _SRV_PULL, _DONE, _REPLY, _AGG_DONE, _PULLED = range(8)
_SERVER_MESSAGES = (_SRV_STEP, _SRV_RESET, _SRV_PUSH, _SRV_PULL)


def worker_behaviour(config) -> dict:
    """What a worker of ``config`` does besides compute-report-aggregate, read from the
    registry as the worker strategies read it: push every iteration (a superstep on the PS),
    the capability test, ESync's delayed ACK."""
    spec = policies.get(config.policy)
    ps = config.topology == "ps"
    query_state = spec.fast_path == "query_state"
    return {"push_every_step": ps and spec.simulation_model("ps") == "superstep",
            "capability_test": query_state,
            "delayed_ack": query_state and spec.reads("esync_delayed_ack") and
            bool(config.esync_delayed_ack)}


def run_events(config, speeds, cost, *, iterations=None, duration=None, batch_size=32,
               training=None):
    """Simulate ``config.policy`` on ``speeds`` until ``n * iterations`` worker iterations are
    done in total or the virtual clock reaches ``duration``; returns a :class:`Recorder`."""
    run = _EventRun(config, speeds, cost, batch_size, training or TrainingModel())
    total_target = None if iterations is None else speeds.n * iterations
    t_end = run.play(total_target, duration)
    run.rec.finish(t_end)
    run.rec.policy_state = run.drv.describe()
    return run.rec


class _EventRun:
    """One simulated run: the event heap, the workers' and the server's state, and one
    handler per event kind (workers: ``iteration_done``, ``replied``, ``aggregated``; the
    server: ``server_*``)."""

    def __init__(self, config, speeds, cost, batch_size, training):
        n = self.n = speeds.n
        self.speeds, self.cost, self.training = speeds, cost, training
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
        self.server_free = 0.0                    # PS: when the shard servers are free again
        b = worker_behaviour(config)
        self.push_every_step, self.delayed = b["push_every_step"], b["delayed_ack"]
        self.captest = np.full(n, b["capability_test"])   # capability test still to run
        self.barrier = np.zeros(n, dtype=bool)    # PS: this push-pull ends a round
        self.local_steps = np.zeros(n, dtype=np.int64)
        self.ready_arrived = np.zeros(n, dtype=bool)   # delayed ACK: a READY came in
        self.ics = 0.0                            # OSP: ICS fraction of the current round
        if self.drv.takes_importance:
            self.layer_sizes = training.layer_sizes(cost.model_bytes)
            agg = cost.ring(n, 1.0)
            self.rate = cost.model_bytes / agg if agg > 0 else 0.0
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

    def transfer(self, t, service):
        """When a push (``service`` = ``cost.push()``) or pull (``cost.link()``) started at
        ``t`` is done: it queues at the shard servers, and takes no less than the worker's own
        link needs."""
        if not self.cost.shared_link:
            return t + service
        self.server_free = max(t, self.server_free) + service
        return max(self.server_free, t + self.cost.worker_link())

    def answer(self, w, decision, now):
        action = decision[0]
        if action == SYNC:
            self.rec.sync(w)
        elif self.delayed and not self.captest[w]:
            self.rec.local(w)
            return      # §4.2: NOT-READY is implicit, nothing is sent
        self.schedule(now + self.half, _REPLY, w, action)

    def release_pull(self, w, now):
        self.rec.staleness(self.drv.staleness(w))
        self.schedule(self.transfer(now, self.cost.link()) + self.half, _PULLED, w)

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
        if self.delayed and self.ready_arrived[w] and self.local_steps[w] > 0:
            # ESync §4.2: READY came in while this iteration ran: its work is discarded
            self.rec.aborted += 1
            self.ready_arrived[w] = False
            self.barrier[w] = True
            self.rec.phase(w, "aggregate", t)
            self.aggregate(w, t)
            return
        self.k[w] += 1
        self.local_steps[w] += 1
        self.rec.iteration(w, self.last_c[w])
        self.rec.phase(w, "wait", t)
        # Alg. 1 line 3: the first iteration's time is the capability test, reported as k = 0
        k = 0 if self.captest[w] else int(self.k[w])
        self.schedule(t + self.half, _SRV_STEP, w, (k, self.last_c[w]))
        if self.delayed and not self.captest[w]:
            self.start_iteration(w, t)

    def replied(self, w, t, action, _kind):
        if self.captest[w]:
            # the test's reply: report the same iteration as the first local one
            self.captest[w] = False
            self.schedule(t + self.half, _SRV_STEP, w, (int(self.k[w]), self.last_c[w]))
            if self.delayed:
                self.start_iteration(w, t)
            return
        if self.delayed:
            self.ready_arrived[w] = action == SYNC
            return
        self.barrier[w] = action == SYNC
        if action != SYNC and not self.push_every_step:
            self.rec.local(w)
            self.start_iteration(w, t)
            return
        if action != SYNC:
            self.rec.local(w)
        self.rec.phase(w, "aggregate", t)
        self.aggregate(w, t)

    def aggregate(self, w, t):
        self.local_steps[w] = 0
        if self.ps:
            self.schedule(self.transfer(t, self.cost.push()), _SRV_PUSH, w)
        else:
            self.enter_collective(w, t)

    def enter_collective(self, w, t):
        """Ring: the collective runs once the last worker of the round has entered it."""
        self.entered.append(w)
        self.enter_max = max(self.enter_max, t)
        if len(self.entered) < self.n:
            return
        cost, ics = self.cost, self.ics
        blocking = cost.ring(self.n, 1.0 - ics)
        # OSP's In-Computation Sync overlaps the next iteration; what does not fit under the
        # shortest next compute is paid on top.
        hidden = max(0.0, cost.ring(self.n, ics) - float(self.last_c.min())) if ics else 0.0
        done = self.enter_max + blocking + hidden
        self.rec.aggregation_cost(blocking + hidden, self.n)
        for v in self.entered:
            self.barrier[v] = True
            self.schedule(done, _AGG_DONE, v)
        self.entered, self.enter_max = [], 0.0

    def aggregated(self, w, t, _arg, kind):
        """The collective (ring) or the pull (PS) is done: reset after a round, then the next
        iteration."""
        if kind == _PULLED:
            self.rec.aggregation_cost(self.cost.push() + self.cost.link(), 1)
        if self.barrier[w]:
            self.barrier[w] = False
            self.rnd[w] += 1
            self.schedule(t + self.half, _SRV_RESET, w, int(self.rnd[w]))
            self.rec.round(w)
        self.start_iteration(w, t)

    # -- the server -------------------------------------------------------------------------
    def server_step(self, w, t, arg, _kind):
        k, compute = arg
        self.rec.message()
        if self.drv.takes_importance and k > 0:
            tr = self.training
            epoch = tr.epoch(k)
            self.ics = self.drv.importance(w, k, epoch, tr.loss(epoch),
                                           tr.u_max(self.rate, compute, self.n),
                                           self.layer_sizes)
        delayed = self.delayed and k > 0
        d = self.drv.step(w, k, compute, t, delayed, self.cost.query if delayed else 0.0)
        if d is None:
            self.held.append((_SRV_STEP, w, k))
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
