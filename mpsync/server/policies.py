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

The policies that decide at every step (ElasticBSP, ESync, OSP) are in
:mod:`mpsync.server.step_policies`.
"""

from __future__ import annotations

import numpy as np

from mpsync import sched
from mpsync.policies import PolicyError
from mpsync.server import pull_rules, rules
from mpsync.server.wire import SYNC

__all__ = ["WorkerTable", "Policy", "BSP", "ASP", "SSP", "DSSP", "make_policy",
           "pull_within_staleness", "pull_sure_within", "warm_up_staleness"]


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
        # Sharded PS: its next push-and-pull's reply is collected later (ASP's:
        # ``SyncClient.push_pull``), so the serve loop does not wake up ahead of it.
        self.unawaited = np.zeros(n, dtype=bool)

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
    # True: ``on_step`` may hold a reply, so the compiled loop (which answers every step of
    # the "tables" family SYNC) must leave the steps to the Python loop.
    holds_steps = False

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

    def sure_pulls(self, w: int) -> int:
        """How many more pushes of ``w`` have pulls that this policy grants at once whatever
        the others do meanwhile (``pull_sure_within``); sent with each pull's reply, so the
        worker reads those pulls from the shards without asking first.  0: ask each time."""
        return 0

    def compiled_pull_bound(self) -> int:
        """The staleness bound with which the compiled serve loop may answer this policy's
        push-and-pull requests (``pull_rules``: ``BOUND_NONE`` never holds a pull), or
        ``pull_rules.NOT_SERVED``: the Python loop answers them (this base's pushes are
        only counted, but its pull rule may be any)."""
        return pull_rules.NOT_SERVED

    def compiled_controller(self):
        """DSSP's per-worker arrays ``(r_extra, held)`` that the compiled rule reads and
        writes as ``on_push`` does (``pull_rules``), or None: no controller."""
        return None

    def on_membership_change(self) -> None:
        """A worker shut down or was taken out: decisions must not wait for it any more."""

    def on_rejoin(self, w: int) -> None:
        """A worker taken out for silence reports again (PS topology)."""

    def on_loss(self, w: int, k: int, loss: float, count: int, now: float) -> None:
        """Worker ``w``'s mean training loss over ``count`` iterations up to ``k`` (``inf``:
        not finite); read by ``auto`` (``mpsync.auto.stability``), ignored by the rest."""

    def on_learning_rate_change(self, w: int, k: int, now: float) -> None:
        """Worker ``w``'s learning rate changed before its iteration ``k`` (a schedule);
        read by ``auto`` (``mpsync.auto.serving``), ignored by the rest."""

    def on_gradient_noise(self, w: int, noise: float, signal: float, pairs: int,
                          now: float) -> None:
        """Worker ``w``'s ``pairs`` same-weights gradient pairs since its last report:
        summed ½|g₁ - g₂|² (``noise``) and g₁ · g₂ (``signal``); read by ``auto``
        (``mpsync.auto.noise``), ignored by the rest."""

    def on_stride(self, w: int, pairs: int, p: float, a: float, q: float,
                  now: float) -> None:
        """Worker ``w``'s step test over ``pairs`` probes since its last report: the summed
        fall one step's slope predicts (``p``), its square norm (``a``) and the curvature
        along its stride (``q``); read by ``auto`` (``mpsync.auto.curvature``), ignored by
        the rest.  ``pairs`` 0: the worker's optimizer admits no step test (not SGD)."""

    def describe(self) -> dict:
        return {}


class BSP(Policy):
    """Everyone synchronizes every iteration (Horovod's behaviour).

    On the PS topology BSP is rounds: a pull waits until every active worker has pushed as
    often (SSP with s = 0), and a step's SYNC waits until every active worker has pulled the
    previous round (its reset, sent after the pull, is in): otherwise a fast worker's next
    push could reach the weights before a slow worker's pull of the round, which would then
    read a model no ring computes.  With the server averaging the round's deltas
    (``ps_average``), every worker then reads w_t + mean_i Δ_i, what the ring's gradient
    average gives for SGD with or without momentum.  Workers that pushed their last update
    (join) or were taken out are not waited for.
    """

    def __init__(self, table, config):
        super().__init__(table, config)
        # The step rule needs the Python loop (the compiled one answers every step SYNC).
        self.holds_steps = config.topology == "ps"

    def on_step(self, w, k, compute, now, delayed_ack=False, rtt=0.0):
        return self.decide_held(w, k, now)

    def decide_held(self, w, k, now):
        if self.holds_steps:
            t = self.t
            members = t.active & ~t.final_pushed
            lowest = t.round[members].min() if members.any() else t.round[w]
            if not rules.round_pulled(lowest, t.round[w]):
                return None
        return SYNC, 0, 0

    def may_pull(self, w):
        return pull_within_staleness(self.t, w, 0)

    def warm_up(self):
        warm_up_staleness()


class ASP(Policy):
    """Never wait (DSSP §I.A): every iteration pushes and pulls whatever is current."""

    def compiled_pull_bound(self):
        return pull_rules.BOUND_NONE if _pull_rules_are(self, ASP) else pull_rules.NOT_SERVED


def warm_up_staleness():
    sched.ssp_may_continue(np.zeros(2, dtype=np.int64), 0, 0)


class SSP(Policy):
    """A worker may be at most ``staleness`` pushes ahead of the slowest active one."""


    def may_pull(self, w):
        return pull_within_staleness(self.t, w, self.config.staleness)

    def sure_pulls(self, w):
        return pull_sure_within(self.t, w, self.config.staleness)

    def compiled_pull_bound(self):
        return int(self.config.staleness) if _pull_rules_are(self, SSP) else \
            pull_rules.NOT_SERVED

    def warm_up(self):
        warm_up_staleness()


def _pull_rules_are(policy: Policy, cls: type) -> bool:
    """Whether ``policy`` counts a push and rules on a pull as ``cls`` does (a subclass, a
    plugin's, may change either; then the Python loop serves its requests)."""
    return all(getattr(type(policy), name) is getattr(cls, name)
               for name in ("on_push", "may_pull", "sure_pulls"))


class DSSP(Policy):
    """DSSP Alg. 1 on each push (``sched.dssp_on_push``) with the Alg. 2 controller granting
    the fastest worker up to ``s_U - s_L`` extra iterations; a pull that Alg. 1 line 17 holds is
    answered once ``ssp_may_continue(s_L)`` holds again.

    Departure [dssp-allowance-left] from Alg. 1 line 12: the controller is given the
    allowance that is left, not the full r_max, so repeated grants never carry the fastest
    worker past s_U (``on_push``).  The other two departures are ``sched.dssp_on_push``'s.
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
        # Departure [dssp-allowance-left], Alg. 1 line 12: the listing calls the controller
        # with the full r_max each time the fastest worker is beyond s_L with no extra
        # iterations left, so repeated grants could carry it past s_U.  We pass the allowance
        # that is left, s_U - gap + 1 (the OK sent now counts as the first extra iteration),
        # so the gap never exceeds s_U.
        gap = int(iters[p] - iters.min())
        r_max = sched.dssp_allowance(gap, self.config.staleness_low,
                                     self.config.staleness_high)
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

    def compiled_pull_bound(self):
        # The compiled loop grants what Alg. 1 grants without the controller (s_L, or an
        # extra iteration left) and leaves the controller's pushes to this object.
        return int(self.config.staleness_low) if _pull_rules_are(self, DSSP) else \
            pull_rules.NOT_SERVED

    def compiled_controller(self):
        return (self.r_extra, self.held) if _pull_rules_are(self, DSSP) else None

    def warm_up(self):
        warm_up_staleness()
        sched.dssp_on_push(np.ones(2, dtype=np.int64), 0, np.array([[0.0, 1.0], [0.0, 2.0]]),
                           0, 1, 1)

    def may_pull(self, w):
        if not self.held[w]:
            return True
        if pull_within_staleness(self.t, w, self.config.staleness_low):
            self.held[w] = False
            return True
        return False

    def sure_pulls(self, w):
        # Alg. 1 sends OK for each of the extra iterations the controller granted (lines
        # 3-5; only w's own pushes use them up) and, within s_L, whatever the controller's
        # state (lines 7-9): the next pulls up to the larger of the two are granted.
        return max(int(self.r_extra[w]), pull_sure_within(self.t, w, self.config.staleness_low))

    def describe(self):
        return {"controller_grants": self.granted.tolist(),
                "extra_iterations": self.extra_runs.tolist(), "grants": self.grants}


def make_policy(config, n_workers: int) -> Policy:
    """The server policy of the configuration's resolved policy (its registry entry)."""
    spec = config.resolved().spec  # a bad policy or topology: ConfigError, naming it
    cls = spec.server_class()
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"policy {config.policy!r}: {spec.server} is not a "
                                   f"mpsync.server Policy subclass")
    return cls(WorkerTable(n_workers), config)


def _active_view(t: WorkerTable):
    idx = np.flatnonzero(t.active & ~t.final_pushed)
    return t.pushes[idx].copy(), t.push_table[idx].copy(), idx


def pull_within_staleness(t: WorkerTable, w: int, s: int) -> bool:
    idx = np.flatnonzero(t.active & ~t.final_pushed)
    if w not in idx:
        return True
    p = int(np.flatnonzero(idx == w)[0])
    return bool(sched.ssp_may_continue(t.pushes[idx], p, s))


def pull_sure_within(t: WorkerTable, w: int, s: int) -> int:
    """How many more pushes of ``w`` ``pull_within_staleness(t, w, s)`` is sure to grant the
    pull after, at any later time: ``s - (pushes[w] - slowest)``, the slowest taken over every
    worker that has not shut down nor pushed its last update -- workers taken out for silence
    too, since one may report again (``on_rejoin``) and count once more.  No count decreases
    and no worker leaves that set for good but by shutting down or pushing its last update,
    so that slowest count never decreases and stays a lower bound of the one the rule
    compares with; a pull sure by it is one the rule grants whenever it is asked.  The
    counts are of pushes in on every shard, so a read made after this answer holds at least
    that slowest count of every such worker's pushes (SSP's bounded staleness)."""
    going = ~(t.done | t.final_pushed)
    if not going[w]:
        return 0
    return max(0, int(s - (t.pushes[w] - t.pushes[going].min())))
