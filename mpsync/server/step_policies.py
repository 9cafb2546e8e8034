"""The state server's policies that decide at every step: ElasticBSP (ZipLine §3, Fig. 5),
ESync (Alg. 1-2, §4.2) and OSP (§3-4, Alg. 1).  Their per-message decisions are the rules of
:mod:`mpsync.server.family_rules`; planning, the PS rounds and OSP's bitmap are made here.
The interface and the tables are :mod:`mpsync.server.policies`'.
"""

from __future__ import annotations

import numpy as np

from mpsync import sched
from mpsync.server import rules
from mpsync.server.policies import Policy, pull_within_staleness, warm_up_staleness

__all__ = ["ElasticBSP", "ESync", "OSP"]


class ElasticBSP(Policy):
    """ElasticBSP (ZipLine paper §3, Fig. 5, §6.2.5): supersteps of asynchronous iterations
    ended by a barrier that the server places with ZipLine.

    Each superstep has the two phases of Fig. 5.  *Monitoring*: after a worker passed a barrier
    (its reset), its steps are answered LOCAL until it has reported ``MONITOR_REPORTS`` times,
    which gives the server its current iteration interval (the time between its two latest
    reports, on the server's clock, never less than the compute the worker reported for that
    iteration: a worker idling in a collective of the script's own reports every 1-50 ms,
    ``rules.record_report``).  *Prediction*: once every active worker has passed the
    last barrier and been monitored, the server predicts ``R`` iterations of each from its
    latest report and interval (``sched.predict``) and ZipLine picks the barrier with the least
    total waiting; worker p synchronizes at iteration ``z[p] + 1`` after its latest report.
    Steps with a barrier planned are answered by ``rules.ebsp_step`` in both serve loops.
    A worker that has joined (PS: sent its last push; uneven step counts) takes no more
    steps, so it leaves the plans: the next superstep's monitoring, prediction and barrier
    cover the workers still running (``running``).

    What a LOCAL step does is the topology's:

    * PS (the paper's setting, §6.2): the worker pushes its update and pulls the current
      weights every iteration (ASP within the superstep, §6.2.5); at the barrier its pull is
      held until every active worker's barrier push is in (BSP at the barrier: everyone
      restarts from the same weights).
    * Ring (an adaptation: no server holds the weights, so an iteration cannot publish an
      update without everyone taking part): local SGD between barriers, the model deltas
      averaged at the barrier.  Both variants synchronize at the same ZipLine barriers.

    Departure [ebsp-report-intervals]: the paper times iterations by *push* timestamps; here by
    step reports, which on the PS precede each push by the report's round trip, and on the ring
    are the only per-iteration event.  With equal speeds the optimum is z = 0 (ties go to the
    earliest barrier, §4.2 Thm. 1): a superstep is then the monitoring iterations plus one.
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
        self.hurry_round: int | None = None   # (hurry)

    def warm_up(self):
        M = sched.predict(np.zeros(2), np.ones(2), 2)
        sched.zipline(M, self.config.zipline_variant)
        rules.ebsp_new_superstep(rules.new_ebsp_tables(1), 0)

    def monitored(self, ws: np.ndarray) -> bool:
        """Has every worker of ``ws`` passed the last barrier and reported often enough?"""
        if self.epoch >= 0 and np.any(self.completed[ws] != self.epoch):
            return False
        return bool(np.all(self.reports[ws] >= self.MONITOR_REPORTS))

    def running(self) -> np.ndarray:
        """The workers a plan covers: every live worker, registered yet or not (a plan made
        before a slow starter has registered would leave it out of the barrier, and on the
        ring the others would then wait for it in the aggregation; a worker that never starts
        is taken out for silence), except those that sent their last push (PS: joined, they
        take no more steps, so ZipLine plans over the workers still running)."""
        return np.flatnonzero(self.t.active & ~self.t.final_pushed)

    def _try_plan(self, now: float | None = None) -> None:
        t = self.t
        ws = self.running()
        if ws.size == 0 or np.any(self.target[ws] >= 0) or not self.monitored(ws):
            return
        if np.any(np.isnan(t.interval[ws])):
            return
        last = t.last_event[ws].copy()
        interval = np.maximum(t.interval[ws], 1e-9)
        res = sched.zipline(sched.predict(last, interval, self.config.lookahead),
                            self.config.zipline_variant)
        self._plan(ws, t.iteration[ws] + res.z + 1, res.z.tolist(), float(res.d),
                   float(res.t_sync), last=last, interval=interval)

    def _plan(self, ws, targets, z, d, t_sync, last=None, interval=None, **extra) -> None:
        """A new superstep's barrier at iteration ``targets`` of workers ``ws``, kept in
        ``plans`` with what placed it."""
        t = self.t
        self.epoch += 1
        self.target[:] = -1
        self.target[ws] = targets
        if len(self.plans) < self.max_plans_kept:
            last = t.last_event[ws] if last is None else last
            interval = t.interval[ws] if interval is None else interval
            self.plans.append({"round": self.epoch, "workers": ws.tolist(),
                               "last_push": last.tolist(), "interval": interval.tolist(),
                               "z": z, "d": d, "t_sync": t_sync,
                               "monitor_reports": self.reports[ws].tolist(),
                               "base_iteration": t.iteration[ws].tolist(),
                               "target_iteration": self.target[ws].tolist(), **extra})

    def hurry(self, round_: int) -> None:
        """Policy ``auto`` switches away at the barrier that opens ``round_``: that barrier
        comes at every running worker's next step, not where ZipLine would place it (with a
        4x straggler its supersteps were 1.8 s apart, and a switch decided just after one
        waited for the next).  Only ``auto`` asks for it (the paper has no switch between
        policies), so ElasticBSP run as itself places every barrier by ZipLine; the hurried
        superstep's plan is kept with ``hurried_for_round``."""
        self.hurry_round = int(round_)
        self._hurry()

    def _hurry(self, w: int | None = None, k: int | None = None) -> None:
        """The barrier of ``hurry_round`` at each worker's next step (at once for ``w``,
        reporting iteration ``k`` now), once the workers before it have all passed the
        barrier before (a plan under way for that earlier barrier is left as it is)."""
        t, r = self.t, self.hurry_round
        ws = self.running()
        due = ws[t.round[ws] + 1 == r] if r is not None else ws[:0]
        if due.size == 0:
            return
        soon = t.iteration[due] + 1
        if w is not None:
            soon[due == w] = k
        if np.any(self.target[ws] >= 0):
            planned = self.target[due] >= 0         # (this barrier's plan: bring it forward)
            self.target[due[planned]] = np.minimum(self.target[due[planned]], soon[planned])
            return
        if due.size != ws.size or (self.epoch >= 0 and np.any(self.completed[ws] != self.epoch)):
            return
        self._plan(due, soon, [0] * due.size, 0.0, None, hurried_for_round=int(r))

    def on_step(self, w, k, compute, now, delayed_ack=False, rtt=0.0):
        if self.hurry_round is not None:
            self._hurry(w, k)
        decision = rules.ebsp_step(self.cells, w, k)
        if self.target[w] < 0:
            self._try_plan(now)
            if self.hurry_round is not None:
                self._hurry(w, k)
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
        ws = self.running()
        return bool(np.all(self.barrier_pushed[ws] | (self.completed[ws] == self.epoch)))

    def on_reset(self, w, round_, now):
        super().on_reset(w, round_, now)
        # A joined worker's resets end no superstep: it left the plan at its last push.
        if self.epoch >= 0 and self.completed[w] != self.epoch and \
                not self.t.final_pushed[w] and len(self.supersteps) < self.max_plans_kept:
            self.supersteps.append({"superstep": int(self.epoch), "worker": int(w),
                                    "barrier_iteration": int(self.t.iteration[w]),
                                    "pushes": int(self.pushes_in_superstep[w])})
        self.pushes_in_superstep[w] = 0
        self.completed[w] = self.epoch
        rules.ebsp_new_superstep(self.cells, w)
        self._try_plan(now)
        if self.hurry_round is not None:
            self._hurry()

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

    Departure [esync-server-clock]: t_e is the server's receipt time, not the device's clock
    (the paper's comparison of a device's time with the server's assumes synchronized
    clocks).  Departure [esync-ready-after-every-pull]: a READY waits for every device's pull
    of the last round, where Alg. 2 line 5 names only the slowest (on the ring the two agree,
    see ``rules.esync_step``).  Departure [esync-held-capability-test]: the capability test's
    reply is held until every capability is known (Alg. 1 does not say how the first queries
    meet: without it the first reporter would find no slower device).
    On the sharded PS every shard applies the round's deltas before any pull is granted
    (``mpsync.server.shards``), in the parameters' dtype.
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
        warm_up_staleness()
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
        return pull_within_staleness(self.t, w, 0)

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
      the first report for iteration k, from the importance of the gradients of iteration k-1
      that the report carries (Eq. 4; global on the Routine Sync layers, the local estimate
      on the In-Computation Sync layers, see ``mpsync.torch.strategies.two_stage``), and given to every
      worker of k.  Workers send that report at the end of step k-1 without waiting, so the
      GIB is computed while they compute iteration k, as the paper's asynchronous GIB module
      does (§3.2, §4.5).
    * U_max (Eq. 5, Alg. 1 lines 1-2): each report carries the bound its worker measured,
      b·T_c/N in model elements, b the aggregation rate the worker measured (N times its
      bytes per second: the rate at which a parameter server would take N workers' pushes;
      timed after a barrier, so waiting for a straggler is not in it), T_c its compute time;
      the server uses the smallest (every worker's ICS must land within its own next
      computation), capped at ``osp_ics_max_fraction`` (0.8) of the model.  ``osp_ics_size="fixed"``: U_max is that fraction of the model instead.
    * S(G^u) (Alg. 1 lines 3-12): 0 in epoch 1, whose mean reported loss becomes L; in epoch
      i > 1, (1 - loss_i / L)·U_max with loss_i the mean loss reported in epoch i so far.

    Departure [osp-ring]: the paper's RS and ICS go through a parameter server; here both are
    ring allreduces and the state server only decides the bitmap.  Departure
    [osp-no-loss-rate]: the loss rate lr of Eq. 5 is not measured (the measured rate already
    includes retransmissions), so lr = 0.  Departure [osp-running-mean-loss]: loss_i is the
    running mean of epoch i (the epoch's loss is known only at its end), so S(G^u) moves
    within an epoch.  Departure [osp-loss-one-ahead]: a report carries the loss and epoch of
    the iteration before the one its GIB is for (it leaves before that iteration is
    computed), so an epoch's first GIB is sized with the previous epoch's S(G^u).
    """

    takes_importance = True

    def __init__(self, table, config):
        super().__init__(table, config)
        self.bitmaps: dict[int, np.ndarray] = {}
        self.u_max_reported = np.full(table.n, np.inf)
        self.loss_sum: dict[int, float] = {}
        self.loss_count: dict[int, int] = {}
        self.first_loss: float | None = None        # L of Alg. 1
        self.epoch = 1                              # the latest epoch a report named
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
        global gradients of k-1); the first report of ``k`` decides it for every worker.

        A report without an epoch (0: a joined worker's, which trains no more) belongs to the
        latest epoch any report named, so a round opened by a joined worker is sized and
        logged with the epoch the others are in, not as an epoch 0."""
        if epoch >= 1:
            self.epoch = max(self.epoch, int(epoch))
        else:
            epoch = self.epoch
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
