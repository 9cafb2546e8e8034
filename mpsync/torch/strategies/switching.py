"""``auto`` on the worker: run one policy's strategy, and hand over to another's when the
server says so, at a round every worker takes part in.

The state server (``mpsync.auto.serving``) answers every step under the policy running now
and tags each SYNC with the code of the policy to run after that round (1 + its index in
``mpsync.policies.AUTO_SWITCHABLE``).  A worker switches right after the aggregation whose
SYNC carried another code: on the ring every worker aggregates the same round, so every worker
switches after the same round, from the same weights:

* after a BSP round every replica has applied the same averaged gradients with the same
  optimizer state, so weights and optimizer state are equal;
* after a model-delta round (ESync, ElasticBSP) every replica restarts from the same
  w_{t+1} (ESync Alg. 1 lines 17-22); the optimizer states drifted apart during the local
  steps, so when the next policy averages gradients (BSP, which relies on equal optimizer
  states) they are averaged over the workers first, then made bitwise equal from one worker.

Nothing is lost at the switch: the round that ends one policy aggregates every update made
under it, and the next strategy starts from its result with the same iteration and round
numbers (the server's tables go on counting), the same fusion buffers, counters and wire.
The gradients leave the fusion buffer when a local-step strategy takes over (BSP binds them
into it).

Across topologies (``auto_ps``: the job hosts the parameter server's shards, idle while the
ring runs):

* ring -> PS (ASP, SSP, DSSP), after a ring round as above: worker 0 loads the weights every
  worker holds onto the shards, every worker waits for that, then pushes its deltas from
  them (``ParameterServer.adopt_replicas``).  Each worker keeps its own optimizer state (the
  PS runs the script's optimizer on every worker, ``ps_optimizer='worker'``), its velocity
  divided by n (``share_velocity``): the ring moved the model by the *mean* of the workers'
  steps, the PS moves it by their *sum*, so n velocities carried whole would make the
  model's first PS steps n times the ring's last ones, a jump in the step size at the
  switch that the learning rate was never tuned for.  Divided, the model's velocity is continuous at the switch; it then grows towards the PS's
  own (each worker's momentum accumulates its own gradients), as in a run on the PS from
  the start.
* PS -> ring, through the round the server makes for it (``mpsync.auto.gathering``): every
  worker pushes what it had not, pulls once every push is in (the same weights on every
  worker), and the ring starts from them, its rounds numbered from the highest any worker
  reached (one reset tells the server).  Going to BSP, the optimizer states are averaged and
  made equal as above.
* PS -> PS: the workers' strategy and the shards' weights stay; the server's rules change.

Each switch is recorded in ``switches`` (iteration, round, from, to, and a digest of
the weights: every worker's must be equal).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
import time
from collections import deque

import torch

from mpsync.config import parse_auto_plan, refuse_ps_plan
from mpsync.torch.strategies.gradient_pairs import GradientPairs
from mpsync.policies import AUTO_ROLLBACK, AUTO_TARGETS, auto_start_code, auto_target, \
    hosts_shards
from mpsync.server.shard_plan import shards_unavailable
from mpsync.torch.strategies.base import Strategy, spec_of

__all__ = ["Switching", "RATE_CHANGE", "learning_rates", "rates_changed", "share_velocity",
           "weights_digest"]

# What the optimizer and the trainer set on a strategy: kept here and given to each new one.
_CARRIED = ("wire", "op_sum", "peers", "skip_aggregation")


# How often a worker reports its mean training loss to the server, which watches that a
# policy it switched to does not undo the run's progress (``mpsync.auto.stability``).
LOSS_REPORT_EVERY_S = 0.1
# On the PS, a copy of the weights every SNAPSHOT_EVERY_S, the last SNAPSHOTS kept, each with
# the mean training loss of the iterations that started from it: a switch back to the ring
# that leaves a diverging run (the server's AUTO_ROLLBACK) restarts from the one with the
# lowest (the server sees a rise after a window of 1 s and two checks 0.5 s apart, so 4 s
# reach back to before it).  The phase's first snapshot (the weights the ring handed over) is
# kept whatever its age: a PS that diverged from its first steps, before the loss watch could
# judge it, is left when its measured progress refutes it, seconds later, and every snapshot
# of the last 4 s is then of diverged weights (a run restarted from them stayed at chance on
# the ring for 25 s).
SNAPSHOT_EVERY_S, SNAPSHOTS = 1.0, 4

# The optimizer states that carry a step's direction from one step to the next: SGD's
# momentum, Adam's (and AdamW's) first moment.  Second moments are scale-free in the step.
VELOCITY_STATES = ("momentum_buffer", "exp_avg")


def _velocities(optimizer):
    """Every velocity state tensor of ``optimizer`` (``VELOCITY_STATES``)."""
    for state in optimizer.state.values():
        for key in VELOCITY_STATES:
            value = state.get(key)
            if torch.is_tensor(value) and value.is_floating_point():
                yield value


def learning_rates(optimizer) -> tuple:
    """The learning rate of each parameter group (a tensor's as a number; None: the group
    has none, as an optimizer that sets its own step sizes)."""
    return tuple(None if g.get("lr") is None else float(g["lr"])
                 for g in optimizer.param_groups)


# A learning rate this many times larger or smaller than the one the server last heard of
# is a change ``auto`` judges its candidates again for (``note_progress``): a step schedule's
# drop (typically 10x) is one, a warm-up or a cosine schedule a few over a run, not one per
# step (which would re-rank every check and re-admit a diverging candidate each time).
RATE_CHANGE = 1.5


def rates_changed(told: tuple, now: tuple) -> bool:
    """Has any group's learning rate moved by ``RATE_CHANGE`` or more since ``told``?"""
    if len(told) != len(now):
        return True
    for a, b in zip(told, now):
        if a is None or b is None:
            if a is not b:
                return True
        elif a <= 0 or b <= 0:
            if (a > 0) != (b > 0):
                return True
        elif max(a / b, b / a) >= RATE_CHANGE:
            return True
    return False


def share_velocity(optimizer, n_workers: int) -> None:
    """Divide every velocity state of ``optimizer`` by ``n_workers``: going from averaged
    steps (the ring) to summed ones (the PS), the model keeps its velocity (module doc)."""
    for value in _velocities(optimizer):
        value.div_(n_workers)


def weights_digest(buffers) -> str:
    """sha256 of the parameters in fusion-buffer order (equal digests: equal weights)."""
    h = hashlib.sha256()
    for buf in buffers:
        for p in buf.params:
            h.update(p.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class Switching(Strategy):
    """The strategy of policy ``auto`` (module doc); everything not defined here is the
    running strategy's (``inner``)."""

    # (On the PS it also keeps SNAPSHOTS copies of the weights, for a rollback.)
    memory_target = "at most one parameter copy beyond the fusion buffer on the ring"
    # op=Sum would mean nothing once a model-delta policy runs: refused from the start.
    aggregates_gradients = False

    def __init__(self, optimizer, buffers, backend, client, counters, config):
        # No Strategy.__init__: each inner strategy sets up its own plumbing.
        self.__dict__.update(optimizer=optimizer, buffers=buffers, backend=backend,
                             client=client, counters=counters, config=config, switches=[],
                             _carried=dict(wire=None, op_sum=False, peers=None,
                                           skip_aggregation=False))
        self.__dict__["ring_only"] = None
        # The training loss since the last report to the server (``note_progress``), and the
        # learning rates the server last heard of (``rates_changed``).
        self.__dict__["_loss"] = [0.0, 0, time.perf_counter()]
        self.__dict__["_rates"] = None
        # Same-weights gradient pairs (DistributedOptimizer.probe_gradient_noise), sent with
        # the loss reports (the server's estimate of the job's gradient noise scale:
        # mpsync.auto.noise), and the step test along this worker's own steps
        # (mpsync.auto.curvature), n of them: a round of the parameter server's full updates.
        self.__dict__["_pairs"] = GradientPairs(
            [p for buf in buffers for p in buf.params], optimizer=optimizer,
            steps_ahead=lambda: getattr(self.inner, "n_workers", 1))
        # [perf_counter, tensors, sum and count of the losses noted from them]
        self.__dict__["_told_adaptive"] = False
        self.__dict__["_snapshots"] = deque(maxlen=SNAPSHOTS)
        self.__dict__["_first_snapshot"] = None      # the PS phase's first, kept (above)
        if hosts_shards(config):
            self._ring_only_if(shards_unavailable(dtypes=[str(b.dtype) for b in buffers]))
        # The server starts on the same code (AutoPolicy): one rule for both.
        self.__dict__["inner"] = self._make(
            auto_start_code(bool(parse_auto_plan(config.auto_plan))), None)

    def _ring_only_if(self, reason: str | None) -> None:
        """A model the parameter server cannot hold (``reason``; None: it can): the server's
        auto drops its PS candidates before the first step, and worker 0 says so once."""
        if reason is None:
            return
        refuse_ps_plan(self.config.auto_plan, reason)
        self.__dict__.update(ring_only=reason,
                             config=dataclasses.replace(self.config, auto_ps=False))
        if self.client is not None:
            self.client.ring_only()
        if self.backend is None or self.backend.rank == 0:
            print(f"mpsync: policy auto switches on the ring only: {reason} (auto_ps is off "
                  f"for this run)", file=sys.stderr, flush=True)

    # -- the running strategy's state, read and written through ---------------------------------
    def __getattr__(self, name):
        if name == "inner":   # (not set yet: __init__ failed)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in _CARRIED:
            self._carried[name] = value
        if name in self.__dict__ or name == "inner":
            self.__dict__[name] = value
        else:
            setattr(self.inner, name, value)

    @property
    def aggregates_every_step(self) -> bool:
        return self.inner.aggregates_every_step

    @property
    def policy(self) -> str:
        """The policy running now."""
        return auto_target(self.inner.code)[0]

    @property
    def topology(self) -> str:
        """Where it runs now: ``ring`` or ``ps``."""
        return auto_target(self.inner.code)[1]

    # -- switching ------------------------------------------------------------------------------
    def _make(self, code: int, previous: Strategy | None) -> Strategy:
        policy, topology = auto_target(code)
        config = dataclasses.replace(self.config, policy=policy, topology=topology,
                                     esync_delayed_ack=False)
        config.validate()
        cls = spec_of(config).strategy_class(topology)
        for buf in self.buffers:
            # A strategy lays out its header before gradient averaging binds the gradients.
            self._unbind_grads(buf)
        inner = cls.from_config(config, self.optimizer, self.buffers, self.backend,
                                self.client, self.counters,
                                worker_rank=self.backend.rank if self.backend else 0)
        inner.code = code
        for name, value in self._carried.items():
            setattr(inner, name, value)
        if previous is not None:
            inner.iteration, inner.round = previous.iteration, previous.round
            inner.last_active = previous.last_active
        return inner

    @staticmethod
    def _unbind_grads(buf) -> None:
        if not buf.grads_bound:
            return
        with torch.no_grad():
            for p in buf.params:
                if p.grad is not None:
                    p.grad = p.grad.detach().clone()
        buf.grads_bound = False

    def _switch_if_told(self) -> bool:
        old = self.inner
        if not old.switch_pending():
            return False
        code = old.last_decision.extra
        rollback = code > AUTO_ROLLBACK
        code -= AUTO_ROLLBACK if rollback else 0
        if not 0 < code <= len(AUTO_TARGETS):
            raise RuntimeError(f"policy auto: the server named policy code {code}, which this "
                               f"worker does not know (server and workers of one version?)")
        (was, leaving), (policy, topology) = auto_target(old.code), auto_target(code)
        t0 = time.perf_counter()
        if leaving == topology == "ps":
            # The server's rules changed (its timeline records it; a worker told after a
            # later switch never hears of it); pushes, pulls and the shards' weights stay.
            old.code = code
            return False
        new = self._make(code, old)
        rolled_back = None
        if leaving == "ps" and topology == "ring":
            self._start_rounds_together(new)
            if rollback:
                rolled_back = self._roll_back(new)
            self._snapshots.clear()
            self.__dict__["_first_snapshot"] = None
        if topology == "ps" and leaving == "ring":
            new.adopt_replicas()
            share_velocity(self.optimizer, new.n_workers)
        if not old.aggregates_every_step and new.aggregates_every_step:
            self._average_optimizer_state(min(old.last_active))
        took = time.perf_counter() - t0    # (the digest below is bookkeeping, not the switch)
        self.switches.append({"iteration": old.iteration, "round": new.round,
                              "from": was, "to": policy, "from_topology": leaving,
                              "to_topology": topology,
                              "weights_sha256": weights_digest(self.buffers),
                              "at_clock": time.time(),
                              "took_s": round(took, 5)})
        if rolled_back is not None:
            self.switches[-1]["rolled_back_s"] = rolled_back
        self.counters.event("switch", t0, t0 + took)
        self.__dict__["inner"] = new
        return True

    def _start_rounds_together(self, new: Strategy) -> None:
        """The ring's rounds after the PS's: numbered from the highest round any worker
        reached (each counted its own pulls), which the server took as the switch round."""
        rounds = torch.zeros(new.n_workers, dtype=torch.float64)
        rounds[new.me] = new.round
        self.backend.allreduce_sum_(rounds, "rounds at the switch to the ring")
        common = int(rounds.max())
        if common != new.round and self.client is not None:
            new.round = common
            new.reset(0.0)

    def _snapshot_if_due(self) -> None:
        if self.topology != "ps":
            return
        now = time.perf_counter()
        if self._snapshots and now - self._snapshots[-1][0] < SNAPSHOT_EVERY_S:
            return
        with torch.no_grad():
            self._snapshots.append([now, [p.detach().clone() for buf in self.buffers
                                          for p in buf.params], 0.0, 0])
        if self._first_snapshot is None:
            self.__dict__["_first_snapshot"] = self._snapshots[-1]

    def _roll_back(self, new: Strategy) -> float | None:
        """The server left the PS because the training diverged there: every worker takes
        the weights of the lowest active worker's snapshot (the last SNAPSHOTS and the phase's
        first) under which that worker's loss was lowest, and every velocity state is zeroed
        (it carries the diverging steps).  Returns the snapshot's age in seconds (None: the
        root had none with a loss noted: nothing rolled back)."""
        root, now = min(new.last_active), time.perf_counter()
        kept = list(self._snapshots)
        if self._first_snapshot is not None and all(s is not self._first_snapshot
                                                    for s in kept):
            kept.insert(0, self._first_snapshot)
        noted = [s for s in kept if s[3] > 0 and math.isfinite(s[2])]
        chosen = min(reversed(noted), key=lambda s: s[2] / s[3]) if noted else None
        age = torch.tensor([-1.0 if chosen is None else now - chosen[0]], dtype=torch.float64)
        self.backend.broadcast_(age, root, "rollback snapshot age")
        if age.item() < 0:
            return None
        with torch.no_grad():
            if new.me == root:
                params = [p for buf in self.buffers for p in buf.params]
                for p, saved in zip(params, chosen[1]):
                    p.copy_(saved)
            new._broadcast_model(root)
            for value in _velocities(self.optimizer):
                value.zero_()
        return round(float(age.item()), 3)

    def _average_optimizer_state(self, root: int) -> None:
        """The optimizer states drifted apart during local steps: average every floating
        state tensor over the workers, then give every worker root's bits (BSP's replicas stay
        equal only from equal optimizer states)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for _key, value in sorted(self.optimizer.state.get(p, {}).items()):
                    if not (torch.is_tensor(value) and value.is_floating_point()):
                        continue
                    flat = value.view(-1)
                    if flat.numel() > 1:
                        self.backend.allreduce_average_(flat, "optimizer state")
                    self.backend.broadcast_(flat, root, "optimizer state")

    # -- the interface -------------------------------------------------------------------------
    def step(self, compute_time, closure=None):
        loss = self.inner.step(compute_time, closure)
        self._switch_if_told()
        self._snapshot_if_due()
        return loss

    def idle_step(self) -> bool:
        did = self.inner.idle_step()
        self._switch_if_told()
        return did

    def join(self) -> None:
        """The running strategy's join; a switch told during it hands the rest of the join to
        the next strategy (ESync's first query is its capability test, as at any start)."""
        while True:
            self.inner.join()
            if not self._switch_if_told():
                return
            inner = self.inner
            if getattr(inner, "capability_test", False):
                inner._test_capability(inner._pace())

    def synchronize(self) -> None:
        # The join first, on the topology running now: a switch from the ring to the PS can
        # reach this worker inside it (the others' rounds go on), and the join then ends as
        # the PS's (no switch is told during a PS join: ``mpsync.auto.gathering``).  What
        # follows it is the topology's the join ended on, or this worker would broadcast the
        # ring's final model while the others wait in the PS's final-push barrier.
        self.join()
        inner = self.inner
        if self.topology == "ps":
            return inner.settle_joined()    # its final push and pull
        inner._broadcast_model(min(inner.last_active))
        inner.last_active = list(range(inner.n_workers))
        inner.settled = True

    def finish(self) -> None:
        if not self.inner.settled:
            self.synchronize()

    def synchronize_gradients(self) -> None:
        self.inner.synchronize_gradients()

    def probe_noise(self, second) -> bool:
        """A same-weights gradient pair, if one is due (``gradient_pairs``)."""
        return self._pairs.probe(second)

    def note_progress(self, epoch: int, loss: float) -> None:
        """The running strategy's (OSP's epoch and loss), and the server's: every
        ``LOSS_REPORT_EVERY_S`` the mean loss since the last report (the server watches that a
        policy it switched to does not undo the run's progress: ``mpsync.auto.stability``)."""
        self.inner.note_progress(epoch, loss)
        if self._snapshots:
            self._snapshots[-1][2] += loss if math.isfinite(loss) else math.inf
            self._snapshots[-1][3] += 1
        acc = self._loss
        acc[0] += loss
        acc[1] += 1
        now = time.perf_counter()
        if self.client is not None and (now - acc[2] >= LOSS_REPORT_EVERY_S
                                        or not math.isfinite(loss)):
            rates = learning_rates(self.optimizer)
            mean = acc[0] / acc[1]
            # (from the first report: a schedule may set the rate after the optimizer's start)
            changed = self._rates is not None and rates_changed(self._rates, rates)
            if self._rates is None:
                self.__dict__["_rates"] = rates
            self.client.report_loss(mean, acc[1], self._pairs.take(), lr_changed=changed)
            stride = self._pairs.take_stride()
            if stride[0]:
                self.client.report_stride(*stride)
            elif self._pairs.adaptive and not self._told_adaptive:
                # No step test (not SGD): said once, as a report of no pairs (wire.STRIDE).
                self.client.report_stride(0, 0.0, 0.0, 0.0)
                self.__dict__["_told_adaptive"] = True
            if changed and not (math.isfinite(mean) and mean < 0):   # (not sent: not told)
                self.__dict__["_rates"] = rates
            acc[:] = [0.0, 0, now]

    def zero_grad(self, set_to_none: bool = True) -> bool:
        return self.inner.zero_grad(set_to_none)

    def close(self) -> None:
        self.inner.close()
