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
    answered once ``ssp_may_continue(s_L)`` holds again.

    Departure from Alg. 1 line 12: the controller is given the allowance that is left, not
    the full r_max, so repeated grants never carry the fastest worker past s_U (``on_push``).
    """


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
    """ElasticBSP (ZipLine paper §3, Fig. 5, §6.2.5): supersteps of asynchronous iterations
    ended by a barrier that the server places with ZipLine.

    Each superstep has the two phases of Fig. 5.  *Monitoring*: after a worker passed a barrier
    (its reset), its steps are answered LOCAL until it has reported ``MONITOR_REPORTS`` times,
    which gives the server its current iteration interval (the time between its two latest
    reports, on the server's clock).  *Prediction*: once every active worker has passed the
    last barrier and been monitored, the server predicts ``R`` iterations of each from its
    latest report and interval (``sched.predict``) and ZipLine picks the barrier with the least
    total waiting; worker p synchronizes at iteration ``z[p] + 1`` after its latest report.
    Steps with a barrier planned are answered by ``rules.ebsp_step`` in both serve loops.

    What a LOCAL step does is the topology's:

    * PS (the paper's setting, §6.2): the worker pushes its update and pulls the current
      weights every iteration (ASP within the superstep, §6.2.5); at the barrier its pull is
      held until every active worker's barrier push is in (BSP at the barrier: everyone
      restarts from the same weights).
    * Ring (an adaptation: no server holds the weights, so an iteration cannot publish an
      update without everyone taking part): local SGD between barriers, the model deltas
      averaged at the barrier.  Both variants synchronize at the same ZipLine barriers.

    Departures: the paper times iterations by *push* timestamps; here by step reports, which
    on the PS precede each push by the report's round trip, and on the ring are the only
    per-iteration event.  With equal speeds the optimum is z = 0 (ties go to the earliest
    barrier, §4.2 Thm. 1): a superstep is then the monitoring iterations plus one.
    """

    MONITOR_REPORTS = rules.EBSP_MONITOR_REPORTS   # Fig. 5: "at least two push requests"

    def __init__(self, table, config):
        super().__init__(table, config)
        n = table.n
        self.cells = rules.new_ebsp_tables(n)
        self.target, self.reports, self.barrier_pushed = self.cells
        self.epoch = -1                                 # plans made so far - 1
        self.completed = np.full(n, -1, dtype=np.int64)  # last plan whose barrier w passed
        self.pushes_in_superstep = np.zeros(n, dtype=np.int64)
        self.plans: list[dict] = []
        self.supersteps: list[dict] = []
        self.max_plans_kept = 2000

    def warm_up(self):
        M = sched.predict(np.zeros(2), np.ones(2), 2)
        sched.zipline(M, self.config.zipline_variant)
        rules.ebsp_new_superstep(rules.new_ebsp_tables(1), 0)

    def monitored(self, ws: np.ndarray) -> bool:
        """Has every worker of ``ws`` passed the last barrier and reported often enough?"""
        if self.epoch >= 0 and np.any(self.completed[ws] != self.epoch):
            return False
        return bool(np.all(self.reports[ws] >= self.MONITOR_REPORTS))

    def _try_plan(self, now: float | None = None) -> None:
        t = self.t
        # Every live worker, registered yet or not: a plan made before a slow starter has
        # registered would leave it out of the barrier, and on the ring the others would then
        # wait for it in the aggregation.  A worker that never starts is taken out for silence.
        ws = np.flatnonzero(t.active)
        if ws.size == 0 or np.any(self.target[ws] >= 0) or not self.monitored(ws):
            return
        if np.any(np.isnan(t.interval[ws])):
            return
        last = t.last_event[ws].copy()
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
                               "monitor_reports": self.reports[ws].tolist(),
                               "base_iteration": t.iteration[ws].tolist(),
                               "target_iteration": self.target[ws].tolist()})

    def on_step(self, w, k, compute, now, delayed_ack=False, rtt=0.0):
        decision = rules.ebsp_step(self.cells, w, k)
        if self.target[w] < 0:
            self._try_plan(now)
            if self.target[w] >= 0:
                decision = rules.ebsp_decide(self.cells, w, k)
        return int(decision[0]), int(decision[1]), 0

    def decide_held(self, w, k, now):
        action, local = rules.ebsp_decide(self.cells, w, k)
        return int(action), int(local), 0

    def on_push(self, w, now):
        super().on_push(w, now)
        self.pushes_in_superstep[w] += 1
        if self.t.in_sync[w]:
            self.barrier_pushed[w] = True

    def may_pull(self, w):
        """PS: a pull within the superstep is answered at once (ASP); the pull at the barrier
        once every active worker has pushed at its barrier or passed it (BSP)."""
        if not self.t.in_sync[w]:
            return True
        t = self.t
        ws = np.flatnonzero(t.active & ~t.final_pushed)
        return bool(np.all(self.barrier_pushed[ws] | (self.completed[ws] == self.epoch)))

    def on_reset(self, w, round_, now):
        super().on_reset(w, round_, now)
        if self.epoch >= 0 and self.completed[w] != self.epoch and \
                len(self.supersteps) < self.max_plans_kept:
            self.supersteps.append({"superstep": int(self.epoch), "worker": int(w),
                                    "barrier_iteration": int(self.t.iteration[w]),
                                    "pushes": int(self.pushes_in_superstep[w])})
        self.pushes_in_superstep[w] = 0
        self.completed[w] = self.epoch
        rules.ebsp_new_superstep(self.cells, w)
        self._try_plan(now)

    def on_membership_change(self):
        self._try_plan()

    def on_rejoin(self, w):
        # Back from a stall (PS): it joins the next plan after its monitoring phase.
        self.completed[w] = self.epoch
        rules.ebsp_new_superstep(self.cells, w)

    def superstep_metrics(self) -> list[dict]:
        """Per superstep: the ZipLine plan (z, the barrier iteration it set per worker) and,
        per worker, the barrier iteration it synchronized at and the pushes it made in the
        superstep (PS; 0 on the ring, where iterations between barriers are local)."""
        out = []
        for plan in self.plans:
            e = plan["round"]
            done = [x for x in self.supersteps if x["superstep"] == e]
            out.append({"superstep": e, "z": plan["z"], "workers": plan["workers"],
                        "monitor_reports": plan["monitor_reports"],
                        "planned_barrier_iteration": plan["target_iteration"],
                        "barrier_iteration": {str(x["worker"]): x["barrier_iteration"]
                                              for x in done},
                        "pushes": {str(x["worker"]): x["pushes"] for x in done}})
        return out

    def describe(self):
        return {"plans": self.plans, "supersteps": self.supersteps,
                "metrics": {"ebsp_supersteps": self.superstep_metrics()}}


class ESync(Policy):
    """ESync State Server (ESync Alg. 2, ``sched.esync_query_state``): READY (SYNC) or NOT-READY
    (LOCAL) per query; capability = the worker's last iteration time; t_e = receipt time on the
    server clock.  In delayed-ACK mode (§4.2) NOT-READY is never sent and capability includes
    the query round trip.

    A report of iteration 0 is Alg. 1 line 3's capability test (RUN-BATCH-DATA-TEST) and the
    first QUERY-STATE with k = 0: always NOT-READY, and held until every worker's capability is
    known (``rules.esync_capability_test``).

    Synchronous rounds on the PS (Alg. 1 lines 17-22: every replica restarts from the same
    w_{t+1}): a pull is answered once every active worker has pushed its delta of the round
    (SSP with s = 0 over pushes, one push per round), and a READY is given only once every
    worker has pulled (``rules.esync_step``), so the PS computes what the ring's allreduce of
    deltas computes.

    Departures: t_e is the server's receipt time, not the device's clock (the paper's
    comparison of a device's time with the server's assumes synchronized clocks); a READY
    waits for every device's pull of the last round, where Alg. 2 line 5 names only the
    slowest (on the ring the two agree, see ``rules.esync_step``); the capability test's
    reply is held until every capability is known (Alg. 1 does not say how the first
    queries meet: without it the first reporter would find no slower device).
    """


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
        _warm_ssp()
        es = rules.new_esync_tables(2, 1)
        rules.esync_capability_test(es, np.arange(2), 0, 1.0, 0.0)
        rules.esync_step(es, np.arange(2), 0, 1.0, 0.0, 0.0, False, 0.0)
        rules.esync_step(es, np.arange(1), 0, 1.0, 0.0, 0.0, True, 0.0)
        rules.esync_new_round(es, 0, 0.0)

    def on_step(self, w, k, compute, now, delayed_ack=False, rtt=0.0):
        if k == 0:
            return self.decide_held(w, k, now, compute)
        action = rules.esync_step(self.cells, self.members(), w, compute, now,
                                  self.config.esync_slack, delayed_ack, rtt)
        if self.cells.ready_count[0] == len(self.cells.ready_log):
            self.drain_ready_log()
        return action, 0, 0

    def decide_held(self, w, k, now, compute=None):
        """The capability test's reply (the only ESync reply ever held), released with t_e =
        the release time: the worker's first iteration starts then (Alg. 1 line 4)."""
        c = self.capability[w] if compute is None else compute
        action = rules.esync_capability_test(self.cells, self.members(), w, c, now)
        return None if action == rules.HOLD else (int(action), 0, 0)

    def may_pull(self, w):
        return _ssp_ok(self.t, w, 0)

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
    Sync); the server returns the Gradient Importance Bitmap (GIB, §3.2), the same for every
    worker, from the importance reports.

    * GIB with the paper's one-iteration lag (§3.2): the bitmap of iteration k is computed at
      the first report of iteration k, from the importance of the *global* gradients of
      iteration k-1 that the report carries (Eq. 4 on the averaged gradients, which every
      worker holds once iteration k-1's ICS has landed), and given to every worker of k.
    * U_max (Eq. 5, Alg. 1 lines 1-2): each report carries the bound its worker measured,
      b·T_c/N in model elements, b the aggregation rate the worker measured (N times its
      bytes per second: the rate at which a parameter server would take N workers' pushes),
      T_c its compute time; the server uses the smallest (every worker's ICS must land
      within its own next computation), capped at ``osp_ics_max_fraction`` (0.8) of the
      model.  ``osp_ics_size="fixed"``: U_max is that fraction of the model instead.
    * S(G^u) (Alg. 1 lines 3-12): 0 in epoch 1, whose mean reported loss becomes L; in epoch
      i > 1, (1 - loss_i / L)·U_max with loss_i the mean loss reported in epoch i so far.

    Departures: the loss rate lr of Eq. 5 is not measured (the measured rate already includes
    retransmissions), so lr = 0; loss_i is the running mean of epoch i (the epoch's loss is
    known only at its end), so S(G^u) moves within an epoch; the GIB is computed when the
    first report of an iteration arrives, inside that step's round trip, not overlapped with
    the computation as on the paper's PS (a ring has no PS to compute it meanwhile).
    """

    takes_importance = True

    def __init__(self, table, config):
        super().__init__(table, config)
        self.bitmaps: dict[int, np.ndarray] = {}
        self.u_max_reported = np.full(table.n, np.inf)
        self.loss_sum: dict[int, float] = {}
        self.loss_count: dict[int, int] = {}
        self.first_loss: float | None = None        # L of Alg. 1
        self.ics_layers = 0
        self.ics_log: list[dict] = []               # per iteration: epoch, U_max, S(G^u), ICS size

    def warm_up(self):
        sched.osp_bitmap(np.ones(2), np.ones(2, dtype=np.int64), 1.0)
        sched.osp_ics_size(2, 1.0, 2.0, 1.0)

    def u_max(self, model_size: float) -> float:
        """Alg. 1 lines 1-2: U_max in model elements."""
        cap = self.config.osp_ics_max_fraction * model_size
        if self.config.osp_ics_size == "fixed":
            return cap
        measured = float(np.min(self.u_max_reported))
        return min(measured, cap) if np.isfinite(measured) else 0.0

    def ics_size(self, epoch: int, model_size: float) -> float:
        """S(G^u) of Alg. 1 for ``epoch`` (1-based; 0: the worker did not say: epoch 1)."""
        u = self.u_max(model_size)
        if epoch <= 1:
            return 0.0
        if self.first_loss is None:
            # Epoch 1's loss ends when epoch 2 begins.
            n = self.loss_count.get(1, 0)
            self.first_loss = self.loss_sum[1] / n if n else None
        n = self.loss_count.get(epoch, 0)
        if not self.first_loss or not n:
            return 0.0
        return float(sched.osp_ics_size(epoch, self.loss_sum[epoch] / n, self.first_loss, u))

    def bitmap_for(self, k: int, importance: np.ndarray, layer_sizes: np.ndarray,
                   loss: float | None = None, epoch: int = 0,
                   u_max: float | None = None, w: int = 0) -> np.ndarray:
        """The GIB of iteration ``k`` from a report of iteration ``k`` (its importance: the
        global gradients of k-1); the first report of ``k`` decides it for every worker."""
        if u_max is not None and u_max >= 0.0:
            self.u_max_reported[w] = u_max
        if loss is not None and epoch >= 1 and np.isfinite(loss):
            self.loss_sum[epoch] = self.loss_sum.get(epoch, 0.0) + float(loss)
            self.loss_count[epoch] = self.loss_count.get(epoch, 0) + 1
        if k not in self.bitmaps:
            sizes = layer_sizes.astype(np.int64)
            model = float(sizes.sum())
            budget = self.ics_size(epoch, model)
            bitmap = sched.osp_bitmap(importance, sizes, budget)
            self.bitmaps[k] = bitmap
            self.ics_layers += int(bitmap.sum())
            if len(self.ics_log) < 100_000:
                self.ics_log.append({"iteration": int(k), "epoch": int(epoch),
                                     "u_max": self.u_max(model), "budget": budget,
                                     "ics_fraction": float(sizes[bitmap].sum()) / max(model, 1.0)})
            for old in [x for x in self.bitmaps if x < k - 4]:
                del self.bitmaps[old]
        return self.bitmaps[k]

    def ics_fraction_per_epoch(self) -> list[dict]:
        """Per epoch: the mean fraction of the model in ICS over its iterations, and the last
        U_max and S(G^u) (model elements) of the epoch."""
        out: dict[int, dict] = {}
        for row in self.ics_log:
            e = out.setdefault(row["epoch"], {"epoch": row["epoch"], "iterations": 0,
                                              "sum": 0.0})
            e["iterations"] += 1
            e["sum"] += row["ics_fraction"]
            e["u_max"], e["s_gu"] = row["u_max"], row["budget"]
        return [{"epoch": e["epoch"], "ics_fraction": e["sum"] / e["iterations"],
                 "iterations": e["iterations"], "u_max": e["u_max"], "s_gu": e["s_gu"]}
                for _, e in sorted(out.items())]

    def describe(self):
        return {"ics_layers_total": self.ics_layers, "loss_L": self.first_loss,
                "u_max": self.u_max_reported[np.isfinite(self.u_max_reported)].tolist(),
                "metrics": {"osp_ics_fraction": self.ics_fraction_per_epoch()}}


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


def _active_view(t: WorkerTable):
    idx = np.flatnonzero(t.active & ~t.final_pushed)
    return t.pushes[idx].copy(), t.push_table[idx].copy(), idx


def _ssp_ok(t: WorkerTable, w: int, s: int) -> bool:
    idx = np.flatnonzero(t.active & ~t.final_pushed)
    if w not in idx:
        return True
    p = int(np.flatnonzero(idx == w)[0])
    return bool(sched.ssp_may_continue(t.pushes[idx], p, s))
