"""``auto`` on the state server: a policy of policies.

:class:`AutoPolicy` is what the registry names as ``auto``'s server class, so the server
never imports the simulator: it gets this decider from the registry like any other policy.  It
answers every step with the rules of the policy running now (ElasticBSP from the first
step while it measures: ``policies.auto_start_code``; BSP under a plan of switches), over
the server's one ``WorkerTable``, and meanwhile:

* measures: each worker's compute time per iteration (the reports: ``measurements.Window``),
  the aggregation's seconds per round (from the last SYNC of a round to its first reset: the
  collective itself, without the waiting for peers), and its own cost per query;
* decides: every ``CHECK_EVERY_S`` it asks the ``Decider`` whether the cluster needs a
  decision (the first one, or a confirmed change); if so the ranking (every switchable
  candidate simulated on the measurements) runs in a helper process (``helper.Ranker``) and
  the answer is picked up by a later query, which never waits for it;
* watches the training loss the workers report (``stability.LossWatch``): a PS policy applying
  updates in full that it switched to and that undoes the run's progress (those updates can
  diverge at a learning rate the ring converges at) is left for the policy it replaced (the
  ring), and no such policy is chosen again; a ring policy is not judged;
* measures the progress each policy makes: the training loss's rate per iteration since a
  switch against the rate before it (``progress.PhaseProgress``) bounds the efficiency of the
  policy switched to when the switch is confirmed, and on the parameter server the gain every
  candidate applying updates in full is ranked with from then on;
* switches: the SYNC replies carry the code of the policy to run after their round; a switch
  decided now takes effect after the first round no SYNC has been sent for yet, so every
  worker switches after the same round.  Each worker's messages go to the old policy until its
  reset of that round, then to a fresh instance of the new one (its own state starts as at the
  start of a run: ElasticBSP's monitoring phase, ESync's capability test).
* across topologies (``auto_ps``: the job hosts the PS's shards beside the ring): to ASP, SSP
  or DSSP after a ring round as above, the push counts its staleness rules read starting
  from 0 at the switch; from them to the ring through a round made for the purpose
  (``gathering``).  Between two PS policies the new rules take over at once, the push
  counts starting from 0 (the workers' strategy and the shards' weights stay).

Everything it decided, on what, and why, is in ``describe()``: ``decisions`` and
``policy_timeline`` reach ``metrics.json`` at the top level (the policy's ``metrics``).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from mpsync.auto.curvature import StepTest
from mpsync.auto.decider import Decider, DecisionRecord
from mpsync.auto.efficiency import ranked_gain
from mpsync.auto.gathering import Gathering
from mpsync.auto.measurements import Window
from mpsync.auto.noise import GradientNoise
from mpsync.auto.progress import PhaseProgress
from mpsync.auto.stability import LossWatch
from mpsync.auto.ranking import Candidate, Ranked
from mpsync.config import parse_auto_plan
from mpsync import policies
from mpsync.policies import (AUTO_PS_SWITCHABLE, AUTO_ROLLBACK, AUTO_SWITCHABLE, auto_code,
                             auto_start_code, auto_target)
from mpsync.server.policies import Policy
from mpsync.server.shard_plan import shards_unavailable
from mpsync.server.wire import SYNC

__all__ = ["AutoPolicy", "CHECK_EVERY_S", "WARM_UP_S", "MIN_REPORTS", "live_candidates"]

CHECK_EVERY_S = 0.5      # how often the measurements are looked at (on the queries' clock)
# ... and at most this often ranked again on a change that needs two checks (2 s before: the
# CNN with Adam, whose measured gain climbs in the first seconds, switched at the second
# ranking 2.6 s after the first, not 1.6).  What needs one check asks at the next check.
RANK_EVERY_S = 1.0
SAME_RATE_CHANGE_S = 2.0  # the workers' reports of one change of learning rate come within
WARM_UP_S = 1.0          # measured under the starting policy at least this long
CONFIRM_AFTER_S = 4.0    # a switch's progress is measured this long before it is confirmed
MIN_REPORTS = 3          # ... and until every worker has reported this often,
EARLY_REPORTS = 2        # or this often where its reports agree within EARLY_AGREEMENT
EARLY_AGREEMENT = 0.2    # (their median is then within 10% of the one a third would give)
WINDOW_REPORTS = 3       # the window of compute times per worker (medians over it: one
                         # hiccup is no change; a straggler is seen after two reports)
_SLOW_LINK = "slow link"     # (the trigger of a ranking on ``Measurements.on_slow_link``)
_SETTINGS = ("staleness", "staleness_low", "staleness_high", "lookahead", "zipline_variant",
             "epsilon", "esync_slack")


def live_candidates(config) -> list[Candidate]:
    """What a live run can switch to: the ring's policies with the run's settings, and with
    ``auto_ps`` ASP, SSP (its bound at 1, 3 and 8 besides the run's) and DSSP on the PS.
    Not BSP or ESync on the PS: their shards average each round's pushes, the others' apply
    each push, and a shard's merge is fixed at start (bench/auto/README.md, *Not
    candidates*, with what the model says they would gain: nothing at 4 workers)."""
    out = [Candidate(name, "ring") for name in AUTO_SWITCHABLE]
    if config.auto_ps:
        for name in AUTO_PS_SWITCHABLE:
            if policies.get(name).reads("staleness"):
                out += [Candidate(name, "ps", (("staleness", s),))
                        for s in sorted({1, 3, 8, int(config.staleness)})]
            else:
                out.append(Candidate(name, "ps"))
    return out


def _applies_in_full(candidate: Candidate) -> bool:
    """Does ``candidate`` apply every worker's update in full (ASP, SSP, DSSP on the PS: the
    updates the loss watch guards, ``stability``)?"""
    return candidate.topology == "ps" and not policies.get(candidate.policy).ps_average


def _planned(candidates, name: str, config) -> Candidate:
    """The candidate a plan's ``name`` stands for (the run's own settings)."""
    topology = "ring" if name in AUTO_SWITCHABLE else "ps"
    return next(c for c in candidates if (c.policy, c.topology) == (name, topology) and
                dict(c.settings).get("staleness", config.staleness) == config.staleness)


class AutoPolicy(Policy):
    holds_steps = True   # served by the Python loop: the compiled one knows one rule family

    def __init__(self, table, config):
        super().__init__(table, config)
        self.candidates = live_candidates(config)
        self.topologies = ("ring", "ps") if config.auto_ps else ("ring",)
        # A fixed plan of switches (config.auto_plan) replaces the decisions: no ranking.
        self.plan = parse_auto_plan(config.auto_plan)
        self.planned = bool(self.plan)
        # From the first step, while auto measures (auto_start_code, also on every worker):
        # ElasticBSP.  Its fast workers step instead of waiting at its barriers; where it is
        # the one to run (stragglers, slow links: bench/auto/README.md) the decision needs no
        # switch, and a wrong first guess costs less than BSP's waiting.  A plan starts on BSP.
        code = auto_start_code(self.planned)
        self.decider = Decider(next(c for c in self.candidates
                                    if auto_code(c.policy, c.topology) == code), explore=True)
        self._start_on(self.decider.current, measuring=not self.planned)
        self.next, self.next_code, self.switch_after = None, 0, None
        self.next_candidate = None
        self.gathering: Gathering | None = None   # a switch from the PS to the ring
        self.window = Window(table.n, WINDOW_REPORTS)
        self.sync_sent = 0          # the highest round any SYNC was sent for
        self.sync_at: dict[int, float] = {}
        self.t0 = None
        self.next_check = 0.0
        self.ranked_at = float("-inf")   # when the checks last asked for a ranking
        self.ranker = None
        self.asked = None           # (trigger, measurements, when) of the ranking in flight
        self.overhead_s, self.queries = 0.0, 0
        # Measured progress: iterations reported, from when the running policy began; the
        # policy a switch left and its rate, until the new one's is measured (_confirm).
        self.steps_done, self.period_start, self.left = 0, None, None
        self._left_candidate, self._confirm_next = None, False
        # The training loss under each policy; where a decision switched, the policy it left
        # (the one to go back to if the new one diverges); None: nothing to go back to.
        self.losses, self.back_to = LossWatch(), None
        # The job's gradient noise, reported with the losses: its own full-update gain for
        # the parameter server's candidates, the fitted constant as the prior (``noise``).
        self.noise = GradientNoise(table.n)
        # The step test along the workers' own strides (``curvature``): what may raise that
        # gain above the fitted constant; and its readings when the ranking asked (the run's
        # metrics).
        self.stride = StepTest(table.n)
        # The workers whose optimizer is not SGD (they said so): the noise scale's gain is
        # ranked uncapped (``efficiency.ranked_gain``).
        self.adaptive_workers: set[int] = set()
        self.stride_series: list[dict] = []
        # The training loss's progress per sample since each switch against before it
        # (``progress``): what it measured, and the full-update gain (lowest, highest, why)
        # the last measurement on the parameter server allows; None: none measured there yet.
        self.progress_log: list[dict] = []
        self.gain_bracket: tuple[float, float, str] | None = None
        self._lr_changed_at = float("-inf")   # (on_learning_rate_change)
        self.rate_changes: list[dict] = []
        self.rollback = False       # the switch pending leaves the PS from earlier weights
        self.problems: list[str] = []
        # Why auto switches on the ring only although auto_ps was asked for, or None.
        self.ring_only: str | None = None
        if not config.auto_ps:
            self._ring_only(shards_unavailable(_thread_level()))

    def _start_on(self, candidate: Candidate, measuring: bool) -> None:
        """Run ``candidate`` from the first step (before it; every worker starts on the same
        code); ``measuring``: it is what auto measures under, and the decision log says so."""
        self.code = auto_code(candidate.policy, candidate.topology)
        self.running_candidate, self.decider.current = candidate, candidate
        self.running = self._fresh(candidate)
        self.start = candidate if measuring else None
        self.progress = PhaseProgress(candidate.label)
        self.timeline = [{"policy": candidate.policy, "after_round": 0, "at_s": 0.0}]

    def _ring_only(self, reason: str | None, say: bool = True) -> None:
        """The job cannot host the parameter server (``reason``; None: nothing to do): its
        candidates go, and the reason is said once (``say``: here; else the worker did) and
        kept for ``describe()``."""
        if reason is None or self.ring_only is not None:
            return
        self.ring_only = reason
        self.candidates = [c for c in self.candidates if c.topology == "ring"]
        self.topologies = ("ring",)
        if say:
            print(f"mpsync: policy auto switches on the ring only: {reason} (auto_ps is off "
                  f"for this run)", file=sys.stderr, flush=True)

    def worker_ring_only(self, w: int) -> None:
        """Worker ``w``'s model cannot go on the PS (``SyncClient.ring_only``: it mixes
        dtypes); before its first step, so before any decision."""
        self._ring_only(f"worker {w}'s model mixes parameter dtypes, and the parameter server "
                        f"holds one flat model of one dtype", say=False)

    def _fresh(self, candidate: Candidate) -> Policy:
        config = dataclasses.replace(self.config, policy=candidate.policy,
                                     topology=candidate.topology, esync_delayed_ack=False,
                                     **dict(candidate.settings)).validate()
        return config.resolved().spec.server_class()(self.t, config)

    def warm_up(self):
        # Every candidate's kernels now, not at the switch while the workers wait; the
        # helper's imports too (it ranks with the uncompiled exact engine: helper).
        for candidate in self.candidates:
            self._fresh(candidate).warm_up()
        if self.planned:
            return
        from mpsync.auto.helper import Ranker
        from mpsync.auto.measurements import Measurements

        warm = Measurements(compute_s=(0.05,) * self.t.n, topologies=self.topologies)
        self.ranker = Ranker(self.t.n, warm_up_request=self._request(warm))
        self._ask(warm, "warm-up", 0.0)

    # -- routing ---------------------------------------------------------------------------------
    def _policy_of(self, w: int):
        if self.switch_after is not None and self.t.round[w] >= self.switch_after:
            return self.next, self.next_code
        return self.running, self.code

    def _gathered(self, w: int, decision, now: float):
        """A step under a switch from the PS (``gathering``): held until every running
        worker is, then SYNC with the ring policy's code; None: held."""
        g = self.gathering
        if g.cancelled:
            self.gathering, self.next, self.next_code = None, None, 0
            self.rollback = False
            self.decider.current = self.running_candidate
            return decision
        if g.released[w]:   # switching, or past the switch
            return decision
        g.hold(w)
        if not g.ready(w, now):
            return None
        self.switch_after = g.round
        self.sync_sent = max(self.sync_sent, g.round)
        return decision[0], 0, self._told_code()

    def _told_code(self) -> int:
        """The code the SYNCs of the switch round carry (``AUTO_ROLLBACK`` added where the
        ring restarts from the workers' earlier weights)."""
        return self.next_code + (AUTO_ROLLBACK if self.rollback else 0)

    def _tag(self, w: int, decision, now: float):
        if decision is None:
            return None
        action, local_iters, _ = decision
        if action != SYNC:
            return int(action), int(local_iters), 0
        opens = int(self.t.round[w]) + 1          # the round this SYNC opens
        self.sync_sent = max(self.sync_sent, opens)
        self.sync_at[opens] = max(self.sync_at.get(opens, now), now)
        after = self.switch_after is not None and opens >= self.switch_after
        return int(action), int(local_iters), self._told_code() if after else self.code

    def on_step(self, w, k, compute, now, delayed_ack=False, rtt=0.0):
        start = time.perf_counter()
        if self.t0 is None:
            self.t0 = self.stride.origin = now
            if self.start is not None:
                self.decider.records.append(DecisionRecord(
                    at_s=0.0, trigger="start", measurements={}, ranking=[], previous="",
                    chosen=self.start.label, switch=False, switch_after_round=None,
                    reason=f"{self.start.label} from the first step, while auto measures (its "
                           f"fast workers step, not wait)"))
        if k > 1:    # the first step's compute holds the start-up (model, data, first pass)
            self.window.add_compute(w, compute)
        if k > 0:
            self.steps_done += 1
        policy, _ = self._policy_of(w)
        decision = self._tag(w, policy.on_step(w, k, compute, now), now)
        if self.gathering is not None and decision is not None:
            decision = self._gathered(w, decision, now)
        self._think(now)
        self.queries += 1
        self.overhead_s += time.perf_counter() - start
        return decision

    def decide_held(self, w, k, now):
        policy, _ = self._policy_of(w)
        decision = self._tag(w, policy.decide_held(w, k, now), now)
        if self.gathering is not None and decision is not None:
            decision = self._gathered(w, decision, now)
        return decision

    def on_push(self, w, now):
        self._policy_of(w)[0].on_push(w, now)

    def may_pull(self, w):
        g = self.gathering
        if g is not None and g.switching(w):
            return g.may_pull(w)
        if g is not None and g.round is None:
            # SSP's and DSSP's bound is not kept while the workers gather to leave the PS:
            # a pull the bound would hold waits for a slower worker's push, and that
            # worker is (or will be) held at its next step until this one is too, so holding
            # the pull would deadlock the gathering.  Granted, it reads at most one round
            # staler than the bound; the ring then starts from one set of weights.
            return True
        return self._policy_of(w)[0].may_pull(w)

    def on_reset(self, w, round_, now):
        switching = self.switch_after is not None and round_ >= self.switch_after
        (self.next if switching else self.running).on_reset(w, round_, now)
        began = self.sync_at.pop(round_, None)
        # The first reset of this round: the collective has ended.  (On the PS a "round" is
        # a push and a pull, bound waits included: not the ring's aggregation the ranking
        # models with this figure, and read as one it would look like a change of the link.)
        if began is not None and auto_target(self.code)[1] == "ring":
            self.window.add_aggregation(max(0.0, now - began))
        if switching:
            act = self.t.active
            if (self.t.round[act] >= self.switch_after).all():
                self._commit(now)

    def _commit(self, now: float) -> None:
        self.running, self.code = self.next, self.next_code
        held = self.gathering.held_s if self.gathering is not None else None
        self.running_candidate, self.gathering = self.next_candidate, None
        entry = {"policy": auto_target(self.code)[0], "topology": auto_target(self.code)[1],
                 "after_round": int(self.switch_after),
                 "at_s": round(now - (self.t0 or now), 3)}
        if held is not None:   # from the PS: the round made for the switch held this long
            entry["gathering_s"] = round(held, 4)
        self.timeline.append(entry)
        self.next, self.next_code, self.switch_after = None, 0, None
        if self.rollback:
            entry["rolled_back"] = True
            self.rollback = False
        self._began(now)

    def _began(self, now: float) -> None:
        """A switch took effect: the policy left is measured until now, the new one from now
        (``Decider.confirm_switch`` compares them after ``CONFIRM_AFTER_S``)."""
        t, steps = self.period_start or (self.t0 or now, 0)
        rate = (self.steps_done - steps) / max(now - t, 1e-9)
        # (Under a second of the policy left is too little to measure it by: after a change
        # of the cluster, the ranking's prediction of its rate stands in, and what is
        # measured is the progress per sample: ``Decider.confirm_switch``.)
        measured = self._confirm_next and now - t >= 1.0 and self.steps_done > steps
        if measured:
            self.left = (self._left_candidate, rate)
        elif self._confirm_next and self._left_candidate is not None:
            self.left = (self._left_candidate, None)
        else:
            self.left = None
        self.period_start = (now, self.steps_done)
        self.losses.begin(now, self.running_candidate.label)
        self.progress.begin(now, self.running_candidate.label, self.steps_done)

    def _confirm(self, now: float) -> None:
        if self.left is None or now - self.period_start[0] < CONFIRM_AFTER_S:
            return
        t, steps = self.period_start
        (left, left_rate), self.left = self.left, None
        if left is None:
            return
        # The progress per sample since the switch moves the efficiency of a policy that
        # applies updates in full (the one the model cannot know: the learning rate decides);
        # a ring policy's is only recorded: one that follows the parameter server inherits
        # its weights, and judging it by them once cost a run 40 s (``_watch_loss``).
        measured = self.progress.ratio(now)
        # the gain the ranking that switched used, before this measurement moves it
        basis = self.decider.basis
        used = ranked_gain(None) if basis is None else basis.ranked_ps_gain()
        running = self.running_candidate
        # No falling loss to measure against: whether the parameter server moves the job at
        # all (``PhaseProgress.stalled``; ``Decider.confirm_switch`` leaves it if not).
        stalled = (self.progress.stalled(now) if measured is None and running.topology == "ps"
                   else None)
        record = self.decider.confirm_switch(left, left_rate, (self.steps_done - steps) / (now - t),
                                             now - self.t0, now - t, progress=measured,
                                             judged=_applies_in_full(running), stalled=stalled)
        if measured is None:
            record.measurements["progress_declined"] = self.progress.declined
        else:
            self.progress_log.append({"at_s": round(now - self.t0, 3), **measured.as_dict()})
            bracket = record.measurements.get("efficiency_bracket")
            model = record.measurements.get("efficiency_model")
            if bracket is not None and model and _applies_in_full(running):
                # The efficiency is the gain over the staleness cost the model put on this
                # candidate: the same factor turns the measured bracket into the gain's,
                # which every candidate applying updates in full shares.
                factor = used / model
                self.gain_bracket = (bracket[0] * factor, bracket[1] * factor,
                                     f"{measured.note} at {now - self.t0:.1f} s")
        if record.switch:
            to = next((c for c in self.candidates if c.label == record.chosen), left)
            self._schedule(to, now, confirm=False)   # a switch back is not raced again
            if running.topology == "ps" and to.topology == "ring" and measured is not None:
                # Refuted by its measured progress: the parameter server's last seconds may
                # have undone what it made (a run too young for the loss watch to judge, its
                # loss flat at chance, stayed there on the ring for 25 s from such weights):
                # the ring restarts from the snapshot with the lowest loss.
                self.rollback = True
                record.reason += ("; the ring restarts from the weights with the lowest loss "
                                  "(the last 4 s', or those it left the ring with)")
            record.switch_after_round = self.switch_after

    def on_loss(self, w, k, loss, count, now):
        self.losses.add(now, loss, count)
        self.progress.add(now, loss, count, self.steps_done)

    def on_gradient_noise(self, w, noise, signal, pairs, now):
        self.noise.add(now, w, noise, signal, pairs)

    def on_stride(self, w, pairs, p, a, q, now):
        if pairs == 0:      # its optimizer is not SGD: no step test (``gradient_pairs``)
            self.adaptive_workers.add(w)
            return
        self.stride.add(now, w, pairs, p, a, q)

    def on_learning_rate_change(self, w, k, now):
        """A worker's learning rate changed (a schedule, by ``switching.RATE_CHANGE`` or more;
        every worker tells: the first one counts, the others within ``SAME_RATE_CHANGE_S``
        tell of the same change): the candidates ruled out and the parameter server's
        measured progress bracket were judged at the old rate (how fast full updates
        progress, and whether they diverge, is the learning rate's doing), so they are
        dropped and the next check ranks anew."""
        if now - self._lr_changed_at < SAME_RATE_CHANGE_S:
            return
        self._lr_changed_at = now
        had = self.gain_bracket
        self.gain_bracket = None
        self.stride.reset()     # (its strides were the old rate's)
        note = f"worker {w} at iteration {k}" + (
            f"; the parameter server's measured progress bracket ({had[2]}) dropped"
            if had is not None else "")
        readmitted = self.decider.learning_rate_changed(note)
        if len(self.rate_changes) < 100:
            self.rate_changes.append({"at_s": round(now - (self.t0 or now), 3), "worker": w,
                                      "iteration": k, "readmitted": readmitted,
                                      "bracket_dropped": had is not None})

    def _with_gain(self, m, now: float):
        """``m`` with the job's full-update gain as measured now (the prior alone until
        enough gradient pairs came in: then ``ps_gain`` stays None, the fitted constant)."""
        est = self.noise.estimate(now)
        current = self.stride.estimate(now)
        stride = self.stride.kept(now)
        if len(self.stride_series) < 600:
            self.stride_series.append({"at_s": round(now - (self.t0 or now), 3),
                                       **current.as_dict()})
        if stride.gain is not None:
            m = dataclasses.replace(m, ps_stride_gain=round(stride.gain, 4),
                                    ps_stride_gain_sd=round(stride.sd, 4))
        if self.gain_bracket is not None:
            lo, hi, note = self.gain_bracket
            m = dataclasses.replace(m, ps_gain_lo=round(lo, 4), ps_gain_hi=round(max(hi, lo), 4),
                                    ps_progress_note=note)
        note = est.note + "; " + stride.note
        if self.adaptive_workers:
            m = dataclasses.replace(m, ps_gain_capped=False)
            note += "; adaptive optimizer (not SGD): no step test, the gain not capped"
        if est.measured is None:
            return dataclasses.replace(m, ps_gain_note=note)
        return dataclasses.replace(m, ps_gain=round(est.gain, 4), ps_gain_sd=round(est.sd, 4),
                                   ps_gain_note=note)

    def _watch_loss(self, now: float) -> None:
        """The running PS policy applying updates in full undoes the run's progress
        (``LossWatch``): back to the policy the decision left (the ring auto started on, if
        that was another such policy), and no candidate applying updates in full is chosen
        again until a worker's speed or the number of workers changes (``Decider``)."""
        reason = self.losses.check(now)
        if reason is None or self.back_to is None or self.planned:
            return
        running, back = self.running_candidate, self.back_to
        # Only the PS's full updates are judged: a ring policy after them starts from their
        # weights and momentum, and sending it back to the PS for that legacy (ruling the
        # ring out) once cost a run 40 s (bench/auto).
        if not _applies_in_full(running):
            return
        unstable = [c for c in self.candidates if _applies_in_full(c)]
        if back in unstable:      # (a PS -> PS switch: go back to the ring auto started on)
            back = self.start or self.candidates[0]
        # Leaving the PS, the ring restarts from the snapshot of the last seconds' weights
        # under which the training loss was lowest (``switching``): the diverged ones would
        # cost the run the progress it made before the loss rose.
        rollback = running.topology == "ps" and back.topology == "ring"
        record = self.decider.diverged(back, reason + ("; the ring restarts from the weights "
                                                       "of the last 4 s with the lowest loss"
                                                       if rollback else ""),
                                       now - self.t0, unstable,
                                       measured=self.losses.describe())
        self._schedule(back, now, confirm=False)
        self.rollback = rollback
        record.switch_after_round = self.switch_after

    def on_membership_change(self):
        self.running.on_membership_change()
        if self.next is not None:
            self.next.on_membership_change()
        if not self.t.active.any() and self.ranker is not None:
            self.ranker.close()

    def on_rejoin(self, w):
        self.running.on_rejoin(w)

    # -- deciding --------------------------------------------------------------------------------
    def _request(self, m) -> dict:
        return {"measurements": m.as_dict(),
                "candidates": [c.as_dict() for c in self.candidates],
                "base": {k: getattr(self.config, k) for k in _SETTINGS}}

    def _ask(self, m, trigger: str, now: float) -> None:
        self.asked = (trigger, m, now)
        self.ranker.submit(self._request(m))

    def _think(self, now: float) -> None:
        if self.planned:
            return self._follow_plan(now)
        if self.asked is not None:
            answer = self.ranker.poll()
            if answer is not None:
                self._answered(answer, now)
            return
        if self.switch_after is not None or self.gathering is not None or now < self.next_check:
            return
        # A check soon after a ranking leaves the next one where it was before there were
        # such checks, a ranking's length after it: a change that needs two checks is
        # ranked no later for them (one more check in between put it 0.2 s later).
        soon = now - self.ranked_at < RANK_EVERY_S
        self.next_check = min(now + CHECK_EVERY_S, self.ranked_at + RANK_EVERY_S) if soon \
            else now + CHECK_EVERY_S
        self._confirm(now)
        if self.switch_after is None and self.gathering is None:
            self._watch_loss(now)
        if self.switch_after is not None or self.gathering is not None:
            return
        if soon and auto_target(self.code)[1] == "ps":
            # On the PS a rise of the step test moves nothing that cannot wait for the next
            # check (each ranking costs 0.15 CPU s on 4 workers, beside the training).
            return
        if now - self.t0 < WARM_UP_S or not self.window.ready(
                MIN_REPORTS, early=EARLY_REPORTS, agree=EARLY_AGREEMENT):
            return
        m = self._live_measurements(now)
        # (A rise of the step test's kept reading soon after the first ranking: a CNN at lr
        # 0.1 read 1.50 +- 63.6 at its first ranking, 2.97 +- 0.86 at the next, 1 s later.)
        trigger = self.decider.wants_ranking(m, soon=soon)
        if trigger is not None and ("compute" in trigger or "workers" in trigger):
            # A worker's speed changed: the rates before and after a switch compare not (an
            # aggregation that changed may be the switch's doing); the running policy's rate
            # is measured again from now, on the cluster as it is.
            self.left, self.period_start = None, (now, self.steps_done)
        if trigger is not None:
            self._ask(m, trigger, now)
            self.ranked_at = now
            self.next_check = now + CHECK_EVERY_S

    def _live_measurements(self, now: float):
        """The window's measurements with the job's gain (``_with_gain``).  On the PS no
        ring aggregation is timed: the one the last ranking used stands, where the window's
        median could still move by the ring's rounds timed after that ranking (with two or
        three in the window, one round does: "aggregation 4.6 -> 9.7 ms/round" ranked a run
        again on the PS, where nothing on the ring had changed)."""
        m = self._with_gain(self.window.measurements(topologies=self.topologies,
                                                     source="live reports"), now)
        basis = self.decider.basis
        if (auto_target(self.code)[1] == "ps" and basis is not None
                and basis.aggregation_s is not None):
            m = dataclasses.replace(m, aggregation_s=basis.aggregation_s)
        return m

    def _answered(self, answer: dict, now: float) -> None:
        trigger, m, asked_at = self.asked
        self.asked = None
        if "error" in answer:
            if len(self.problems) < 20:
                self.problems.append(answer["error"])
            return
        if trigger == "warm-up":
            return
        ranked = [Ranked.from_dict(r) for r in answer["ranked"]]
        if trigger == _SLOW_LINK:
            record = self.decider.decide_on_slow_link(ranked, m, asked_at - self.t0,
                                                      cost_s=answer.get("cpu_s", 0.0))
        else:
            record = self.decider.decide(ranked, m, asked_at - self.t0, trigger,
                                         cost_s=answer.get("cpu_s", 0.0))
        if self.decider.wants_slow_link:
            # (A clear gain held for want of a timed aggregation: the same measurements
            # ranked at once on a slow link, ``Decider.decide_on_slow_link``.)
            self._ask(m.on_slow_link(), _SLOW_LINK, now)
        record.extra.update(answered_after_s=round(now - asked_at, 3),
                            ranking_wall_s=round(answer.get("wall_s", 0.0), 3),
                            ranker=self.ranker.mode, engine=answer.get("engine"))
        if record.switch:
            self._schedule(next(c for c in self.candidates if c.label == record.chosen), now,
                           hurry=True)
            record.switch_after_round = self.switch_after

    def _follow_plan(self, now: float) -> None:
        if not self.plan or self.switch_after is not None or self.gathering is not None:
            return
        after, name = self.plan[0]
        if name == auto_target(self.code)[0]:
            self.plan.pop(0)
            return
        if self.sync_sent + 1 < after:
            return
        self.plan.pop(0)
        chosen = _planned(self.candidates, name, self.config)
        self._schedule(chosen, now)
        self.decider.records.append(DecisionRecord(
            at_s=now - self.t0, trigger="auto_plan", measurements={}, ranking=[],
            previous=self.decider.current.label, chosen=chosen.label, switch=True,
            reason=f"the plan says {name} after round {after}",
            switch_after_round=self.switch_after))
        self.decider.current = chosen

    def _schedule(self, candidate: Candidate, now: float, confirm: bool = True,
                  hurry: bool = False) -> None:
        """Switch to ``candidate``: from the ring, after the first round no SYNC was sent for
        yet (``hurry``: a ring policy that places its barriers, ElasticBSP, is asked to place
        that one at the workers' next steps; a planned switch keeps the policy's own); from
        the PS to the ring, through a ``Gathering`` (the switch round is known at its
        release); between PS policies, at once."""
        new, code = self._fresh(candidate), auto_code(candidate.policy, candidate.topology)
        leaving = auto_target(self.code)[1]
        if candidate.topology == "ps":
            # The staleness rules count pushes from the switch on (none is in flight: the
            # ring pushes nothing, and a PS policy's count starts again).
            self.t.pushes[:] = 0
            self.t.push_table[:] = 0.0
        self._left_candidate, self._confirm_next = self.running_candidate, confirm
        self.back_to = self.running_candidate if confirm else None
        if leaving == "ps" and candidate.topology == "ps":
            self.running, self.code, self.running_candidate = new, code, candidate
            self.timeline.append({"policy": candidate.policy, "topology": "ps",
                                  "after_round": int(self.sync_sent),
                                  "at_s": round(now - (self.t0 or now), 3)})
            self._began(now)
            return
        self.next, self.next_code, self.next_candidate = new, code, candidate
        if leaving == "ps":
            # Off the PS for any reason while its loss is up from its phase's lowest: the
            # ring restarts from the snapshot with the lowest loss, not from the rise.
            self.rollback = self.losses.risen(now)
            self.gathering = Gathering(self.t, now)
        else:
            self.switch_after = self.sync_sent + 1
            if hurry and hasattr(self.running, "hurry"):
                self.running.hurry(self.switch_after)

    # -- what it says about itself -----------------------------------------------------------------
    def describe(self):
        decisions = [r.as_dict() for r in self.decider.records]
        noise = self.noise.estimate().as_dict()
        return {"running": auto_target(self.code)[0], "decisions": decisions,
                "policy_timeline": self.timeline, "ranker": getattr(self.ranker, "mode", None),
                "problems": self.problems, "ring_only": self.ring_only,
                "training_loss": self.losses.describe(),
                "gradient_noise": noise,
                "step_test": self.stride_series[-1:],
                "adaptive_workers": sorted(self.adaptive_workers),
                "progress": self.progress_log,
                "learning_rate_changes": self.rate_changes,
                "query_overhead_us": round(1e6 * self.overhead_s / max(self.queries, 1), 2),
                "query_overhead_s": round(self.overhead_s, 4), "queries": self.queries,
                "running_state": self.running.describe(),
                "metrics": {"decisions": decisions, "policy_timeline": self.timeline,
                            "auto_topologies": list(self.topologies),
                            "auto_ring_only": self.ring_only,
                            "auto_training_loss": self.losses.describe(),
                            "auto_training_loss_series": self.losses.series(),
                            "auto_gradient_noise": noise,
                            "auto_step_test": self.stride_series,
                            "auto_adaptive_workers": sorted(self.adaptive_workers),
                            "auto_progress": self.progress_log}}


def _thread_level() -> int:
    """The thread level MPI provides on this rank (MPI_THREAD_MULTIPLE where MPI is not
    initialised: nothing here is in a job, e.g. a simulation)."""
    from mpi4py import MPI

    return MPI.Query_thread() if MPI.Is_initialized() else MPI.THREAD_MULTIPLE
