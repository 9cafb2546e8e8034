"""Policies of the state server: small objects over per-worker numpy tables.

A policy answers three questions for the serve loop, each from the tables alone (no MPI here):

* ``on_step(w, k, compute, now)``: worker ``w`` finished local iteration ``k``; reply
  ``(SYNC | LOCAL, local_iters, extra)``, or ``None`` to hold the reply until the tables change
  (the loop retries held replies after every message).
* ``on_reset(w, round, now)``: ``w`` finished an aggregation and is in round ``round``.
* ``may_pull(w)``: parameter-server topology: may ``w``'s pull be answered now (staleness)?

Worker indices ``w`` are 0..n-1 (the loop maps communicator ranks to them).  Workers that shut
down or were taken out of the computation (silent, ZipLine paper §4) are excluded from every
decision through ``WorkerTable.active``.
"""

from __future__ import annotations

import numpy as np

from mpsync import sched
from mpsync.server import rules
from mpsync.server.wire import LOCAL, SYNC

__all__ = ["WorkerTable", "Policy", "make_policy"]


class WorkerTable:
    """What the server knows of each worker, on its own clock (``MPI.Wtime`` on receipt).

    The cells every message touches are ``cells`` (a :class:`rules.Tables`, the arrays the
    per-message rules of both serve loops write); the same arrays are attributes here for the
    policies' whole-table work.  The rest changes only on PS and membership messages.
    """

    def __init__(self, n: int):
        self.n = n
        self.cells = rules.new_tables(n)
        (self.iteration, self.last_event, self.interval, self.compute, self.round,
         self.removed, self.last_heard, self.waiting, self.in_sync) = self.cells
        self.pushes = np.zeros(n, dtype=np.int64)           # PS: updates applied (DSSP t_i)
        self.push_table = np.zeros((n, 2), dtype=np.float64)  # PS: two latest push times
        self.registered = np.zeros(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)                 # sent shutdown
        self.final_pushed = np.zeros(n, dtype=bool)         # PS: sent its last update

    @property
    def active(self) -> np.ndarray:
        return ~(self.done | self.removed)

    def record_report(self, w: int, k: int, compute: float, now: float) -> None:
        rules.record_report(self.cells, w, k, compute, now)


class Policy:
    """The base policy: every step is answered SYNC (the decisions of the PS policies are
    made at push and pull time).  Which of the compiled loop's rule families serves a policy
    is the registry's ``fast_path`` (``mpsync.policies``)."""

    takes_importance = False      # OSP's importance reports

    def __init__(self, table: WorkerTable, config):
        self.t = table
        self.config = config

    def on_step(self, w: int, k: int, compute: float, now: float, delayed_ack: bool = False,
                rtt: float = 0.0):
        return SYNC, 0, 0

    def on_reset(self, w: int, round_: int, now: float) -> None:
        rules.record_reset(self.t.cells, w, round_, now)

    def on_push(self, w: int, now: float) -> None:
        t = self.t
        t.pushes[w] += 1
        t.push_table[w, 0] = t.push_table[w, 1] if t.pushes[w] > 1 else now
        t.push_table[w, 1] = now

    def warm_up(self) -> None:
        """Run this policy's kernels once on tiny inputs, so the first real decision does not
        pay Numba's cache load (~0.3 s) while every worker waits."""

    def decide_held(self, w: int, k: int, now: float):
        """Decide again on a report whose reply was held (its bookkeeping is done)."""
        return SYNC, 0, 0

    def may_pull(self, w: int) -> bool:
        return True

    def on_membership_change(self) -> None:
        """A worker shut down or was taken out: decisions must not wait for it any more."""

    def on_rejoin(self, w: int) -> None:
        """A worker taken out for silence reports again (PS topology)."""

    def describe(self) -> dict:
        return {}


class BSP(Policy):
    """Everyone synchronizes every iteration (Horovod's behaviour).  On the PS topology a pull
    waits until every active worker has pushed as often (SSP with s = 0)."""


    def may_pull(self, w):
        return _ssp_ok(self.t, w, 0)

    def warm_up(self):
        _warm_ssp()


class ASP(Policy):
    """Never wait (DSSP §I.A): every iteration pushes and pulls whatever is current."""



def _warm_ssp():
    sched.ssp_may_continue(np.zeros(2, dtype=np.int64), 0, 0)


class SSP(Policy):
    """A worker may be at most ``staleness`` pushes ahead of the slowest active one."""


    def may_pull(self, w):
        return _ssp_ok(self.t, w, self.config.staleness)

    def warm_up(self):
        _warm_ssp()


class DSSP(Policy):
    """DSSP Alg. 1 on each push (``sched.dssp_on_push``) with the Alg. 2 controller granting
    the fastest worker up to ``s_U - s_L`` extra iterations; a pull that Alg. 1 line 17 holds is
    answered once ``ssp_may_continue(s_L)`` holds again."""


    def __init__(self, table, config):
        super().__init__(table, config)
        self.r_extra = np.zeros(table.n, dtype=np.int64)
        self.held = np.zeros(table.n, dtype=bool)
        self.granted = np.zeros(table.n, dtype=np.int64)   # controller grants, for stats
        self.extra_runs = np.zeros(table.n, dtype=np.int64)
        self.grants: list[dict] = []

    def on_push(self, w, now):
        super().on_push(w, now)
        iters, table, idx = _active_view(self.t)
        if w not in idx:  # a push after its last one (a second synchronize): nothing to decide
            self.held[w] = False
            return
        p = int(np.flatnonzero(idx == w)[0])
        r_before = int(self.r_extra[w])
        # Departure from Alg. 1 line 12: the listing calls the controller with the full r_max
        # each time the fastest worker is beyond s_L with no extra iterations left, so repeated
        # grants could carry it past s_U.  We pass the allowance that is left, s_U - gap + 1
        # (the OK sent now counts as the first extra iteration), so the gap never exceeds s_U.
        gap = int(iters[p] - iters.min())
        r_max = max(0, min(self.config.staleness_high - self.config.staleness_low,
                           self.config.staleness_high - gap + 1))
        ok, r_new = sched.dssp_on_push(iters, r_before, table, p, self.config.staleness_low,
                                       r_max)
        if ok and r_before == 0 and not sched.ssp_may_continue(iters, p, self.config.staleness_low):
            self.granted[w] += 1
            self.extra_runs[w] += r_new + 1
            if len(self.grants) < 500:
                self.grants.append({"worker": int(w), "pushes": int(self.t.pushes[w]),
                                    "push_table": table.tolist(), "p": p,
                                    "slowest": int(sched.dssp_slowest(iters)), "r_max": r_max,
                                    "r_star": int(r_new + 1)})
        self.r_extra[w] = r_new
        self.held[w] = not ok

    def warm_up(self):
        _warm_ssp()
        sched.dssp_on_push(np.ones(2, dtype=np.int64), 0, np.array([[0.0, 1.0], [0.0, 2.0]]),
                           0, 1, 1)

    def may_pull(self, w):
        if not self.held[w]:
            return True
        if _ssp_ok(self.t, w, self.config.staleness_low):
            self.held[w] = False
            return True
        return False

    def describe(self):
        return {"controller_grants": self.granted.tolist(),
                "extra_iterations": self.extra_runs.tolist(), "grants": self.grants}


class ElasticBSP(Policy):
    """ElasticBSP (ZipLine paper §3-4): after each barrier the server predicts the next ``R``
    iterations of every worker and imposes the barrier with the least waiting (``zipline``).

    Intervals are learned from the server's own timestamps: the time from a worker's previous
    report (or from its reset after the last aggregation) to its report is one iteration.  Plan
    ``e + 1`` is made when the last active worker has completed the barrier of plan ``e`` (its
    reset), with ``last_push`` = each worker's latest report or reset time; the first plan once
    every worker has two reports (the monitoring phase, answered LOCAL).  Worker p then runs
    ``z[p] + 1`` local iterations after its latest report and synchronizes.  A worker that
    completed its barrier before the others waits for the plan (its first report's reply is
    held), i.e. for the aggregation to finish everywhere.

    Departure: the paper predicts from the two latest *push* timestamps; with the ring there
    are no pushes, so the reset that ends an aggregation plays that role.  With equal speeds
    the optimum is z = 0 for everyone (ties go to the earliest barrier, §4.2 Thm. 1): the same
    number of iterations for everyone in every round, i.e. BSP.

    A step with its barrier planned is answered by ``rules.ebsp_decide`` (in both loops);
    planning and the monitoring phase stay here.
    """


    def __init__(self, table, config):
        super().__init__(table, config)
        n = table.n
        # target: iteration at which w synchronizes (-1: none planned); held: w's report waits
        # for the next plan, so its next iterations start when the plan releases it.
        self.cells = rules.new_ebsp_tables(n)
        self.target, self.reports, self.held = self.cells
        self.epoch = -1                                 # plans made so far - 1
        self.completed = np.full(n, -1, dtype=np.int64)  # last plan whose barrier w passed
        self.plans: list[dict] = []
        self.max_plans_kept = 2000

    def warm_up(self):
        M = sched.predict(np.zeros(2), np.ones(2), 2)
        sched.zipline(M, self.config.zipline_variant)

    def _try_plan(self, now: float | None = None) -> None:
        t = self.t
        # Every live worker, registered yet or not: a plan made before a slow starter has
        # registered would leave it out of the barrier, and on the ring the others would then
        # wait for it in the aggregation while it waits for the next plan (a deadlock seen
        # with zero-length iterations).  A worker that never starts is taken out for silence.
        ws = np.flatnonzero(t.active)
        if ws.size == 0:
            return
        if self.epoch < 0:
            if np.any(self.reports[ws] < 2):
                return
        elif np.any(self.completed[ws] != self.epoch):
            return
        if np.any(np.isnan(t.interval[ws])):
            return
        last = t.last_event[ws].copy()
        # A held worker resumes when this plan releases it (now); predicting from its held
        # report would place its pushes a whole wait too early and, with equal speeds, make
        # ZipLine pick unequal barriers for workers that are in fact in step.
        released = self.held[ws]
        if released.any():
            last[released] = np.nanmax(last) if now is None else now
        interval = np.maximum(t.interval[ws], 1e-9)
        res = sched.zipline(sched.predict(last, interval, self.config.lookahead),
                            self.config.zipline_variant)
        self.epoch += 1
        self.target[:] = -1
        self.target[ws] = t.iteration[ws] + res.z + 1
        if len(self.plans) < self.max_plans_kept:
            self.plans.append({"round": self.epoch, "workers": ws.tolist(),
                               "last_push": last.tolist(), "interval": interval.tolist(),
                               "z": res.z.tolist(), "d": float(res.d),
                               "t_sync": float(res.t_sync),
                               "base_iteration": t.iteration[ws].tolist(),
                               "target_iteration": self.target[ws].tolist()})

    def on_step(self, w, k, compute, now, delayed_ack=False, rtt=0.0):
        if self.epoch < 0:
            self.reports[w] += 1
            self._try_plan(now)
            if self.target[w] < 0:
                return LOCAL, 0, 0          # monitoring phase: learning intervals
            return self.decide_held(w, k, now)
        if self.target[w] < 0:
            self._try_plan(now)
        return _held_or(rules.ebsp_step(self.cells, w, k))

    def decide_held(self, w, k, now):
        if self.target[w] < 0:
            self._try_plan(now)
        return _held_or(rules.ebsp_decide(self.cells, w, k))

    def on_reset(self, w, round_, now):
        super().on_reset(w, round_, now)
        self.completed[w] = self.epoch
        self.target[w] = -1
        self._try_plan(now)

    def on_membership_change(self):
        self._try_plan()

    def on_rejoin(self, w):
        # Back from a stall (PS): it joins the next plan.
        self.completed[w] = self.epoch
        self.target[w] = -1

    def describe(self):
        return {"plans": self.plans}


class ESync(Policy):
    """ESync State Server (ESync Alg. 2, ``sched.esync_query_state``): READY (SYNC) or NOT-READY
    (LOCAL) per query; capability = the worker's last iteration time; t_e = receipt time on the
    server clock.  In delayed-ACK mode (§4.2) NOT-READY is never sent (``None`` with
    ``silent_local``) and capability includes the query round trip."""


    def __init__(self, table, config):
        super().__init__(table, config)
        n = table.n
        self.cells = rules.new_esync_tables(n)
        self.k, self.capability, self.last_finish, self.ready, self.rounds, self.rtt = \
            self.cells[:6]
        self.local_per_round: list[list[int]] = [[] for _ in range(n)]
        self._members_cache = None

    def members(self) -> np.ndarray:
        """The active workers, recomputed only when the membership changes (a shutdown, a
        removal, a rejoin), not on every query."""
        if self._members_cache is None:
            self._members_cache = np.flatnonzero(self.t.active).astype(np.int64)
        return self._members_cache

    def on_membership_change(self):
        self._members_cache = None

    def warm_up(self):
        es = rules.new_esync_tables(2, 1)
        rules.esync_step(es, np.arange(2), 0, 1.0, 0.0, 0.0, False, 0.0)
        rules.esync_step(es, np.arange(1), 0, 1.0, 0.0, 0.0, True, 0.0)
        rules.esync_new_round(es, 0, 0.0)

    def on_step(self, w, k, compute, now, delayed_ack=False, rtt=0.0):
        action = rules.esync_step(self.cells, self.members(), w, compute, now,
                                  self.config.esync_slack, delayed_ack, rtt)
        if self.cells.ready_count[0] == len(self.cells.ready_log):
            self.drain_ready_log()
        return action, 0, 0

    def drain_ready_log(self) -> None:
        """The READY decisions the rules logged, into the per-worker lists (``describe``)."""
        log, count = self.cells.ready_log, self.cells.ready_count
        for w, k in log[:count[0]].tolist():
            self.local_per_round[w].append(k)
        count[0] = 0

    def on_reset(self, w, round_, now):
        super().on_reset(w, round_, now)
        rules.esync_new_round(self.cells, w, now)

    def on_rejoin(self, w):
        self._members_cache = None
        act = self.t.active
        self.rounds[w] = self.rounds[act].max() if act.any() else self.rounds[w]
        self.k[w] = 0
        self.ready[w] = False

    def describe(self):
        self.drain_ready_log()
        return {"local_iterations_per_round": self.local_per_round,
                "query_rtt_s": self.rtt.tolist()}


class OSP(Policy):
    """OSP (§3-4) on the ring: every iteration synchronizes (Routine Sync + In-Computation
    Sync); the server turns the workers' layer importance into the Gradient Importance Bitmap
    of the next iteration (``sched.osp_bitmap``), the same bitmap for every worker.

    The bitmap for iteration k+1 is computed once, at the first importance report of
    iteration k, from the mean importance of all workers' reports of iteration k-1 (the first
    reporter's own when there is none) — every worker must get the same bitmap or the ring's
    collectives would not match.  Budget: ``osp_ics_max_fraction`` of the model (the U_max cap
    of §4.1.2); with the loss reported by workers, Alg. 1's S(G^u) schedule scales it.
    Departure: U_max's bandwidth term needs a link model the server does not have; the cap is
    used instead (set the fraction to tune it).
    """

    takes_importance = True

    def __init__(self, table, config):
        super().__init__(table, config)
        self.sum_importance: dict[int, np.ndarray] = {}
        self.count: dict[int, int] = {}
        self.bitmaps: dict[int, np.ndarray] = {}
        self.first_loss = None
        self.ics_layers = 0

    def warm_up(self):
        sched.osp_bitmap(np.ones(2), np.ones(2, dtype=np.int64), 1.0)
        sched.osp_ics_size(2, 1.0, 2.0, 1.0)

    def bitmap_for(self, k: int, importance: np.ndarray, layer_sizes: np.ndarray,
                   loss: float | None = None, epoch: int = 0) -> np.ndarray:
        key = k + 1
        if key not in self.bitmaps:
            prev = self.sum_importance.get(k - 1)
            basis = prev / self.count[k - 1] if prev is not None else importance
            budget = self.config.osp_ics_max_fraction * float(layer_sizes.sum())
            if loss is not None and epoch >= 1:
                if self.first_loss is None and epoch == 1:
                    self.first_loss = loss
                if self.first_loss:
                    budget = sched.osp_ics_size(epoch, loss, self.first_loss, budget)
            self.bitmaps[key] = sched.osp_bitmap(basis, layer_sizes.astype(np.int64), budget)
            self.ics_layers += int(self.bitmaps[key].sum())
            for old in [x for x in self.bitmaps if x < key - 4]:
                del self.bitmaps[old]
            for old in [x for x in self.sum_importance if x < k - 4]:
                del self.sum_importance[old], self.count[old]
        if k in self.sum_importance:
            self.sum_importance[k] += importance
            self.count[k] += 1
        else:
            self.sum_importance[k] = importance.copy()
            self.count[k] = 1
        return self.bitmaps[key]

    def describe(self):
        return {"ics_layers_total": self.ics_layers}


def make_policy(config, n_workers: int) -> Policy:
    """The server policy of ``config.policy``, from the policy registry (mpsync.policies)."""
    from mpsync import policies

    spec = policies.get(config.policy)
    spec.check_topology(config.topology)  # PolicyError is a ValueError naming the policy
    cls = spec.server_class()
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise policies.PolicyError(f"policy {config.policy!r}: {spec.server} is not a "
                                   f"mpsync.server Policy subclass")
    return cls(WorkerTable(n_workers), config)


def _held_or(decision):
    """A rule's ``(action, local_iters)`` as a policy decision; None (held) for ``HOLD``."""
    action, local_iters = decision
    if action == rules.HOLD:
        return None                     # hold until the others finished the barrier
    return int(action), int(local_iters), 0


def _active_view(t: WorkerTable):
    idx = np.flatnonzero(t.active & ~t.final_pushed)
    return t.pushes[idx].copy(), t.push_table[idx].copy(), idx


def _ssp_ok(t: WorkerTable, w: int, s: int) -> bool:
    idx = np.flatnonzero(t.active & ~t.final_pushed)
    if w not in idx:
        return True
    p = int(np.flatnonzero(idx == w)[0])
    return bool(sched.ssp_may_continue(t.pushes[idx], p, s))
