"""When to decide, and whether a decision switches: ``auto``'s hysteresis, pure.

A :class:`Decider` holds the policy running now and the measurements its last decision
rested on.  It asks for a new ranking only when the cluster changed beyond the measurements'
noise (``Measurements.change_from``: a worker's compute time moved by more than
``change_tolerance``, more than ``NOISE_MULTIPLE`` standard errors of its recent reports and
more than ``CHANGE_FLOOR_S``; or the aggregation by more than twice ``change_tolerance`` and
5 ms), seen on ``confirm`` consecutive checks, so one slow window is not a change (a rise
of the step test's kept reading, which never falls back, is one at once), and switches only
when the best candidate is predicted at least ``min_gain`` faster than the policy running,
and not sooner than ``min_dwell_s`` after the last switch.  On a steady cluster it therefore
decides once and switches at most once; what it decided, on what, and why, is in
``records``.  Two moves wait for a measurement rather than rest on an assumed figure: onto
the parameter server's full updates before the run measured their gain, and from the ring to
the parameter server before the run timed one aggregation (the link is then an assumed 10
Gbit/s); the first timed aggregation asks for a ranking of its own.  The second waits only
where the move is not clear on a slow link as well (``decide_on_slow_link``: ranked again at
100 Mbit/s).

A switch is a prediction until measured: after it, :meth:`Decider.confirm_switch` sets the progress
per second measured under the new policy (its measured samples per second times the
efficiency the ranking gave it, moved into what the training loss's progress since the switch
allows: ``mpsync.auto.progress``) beside the same figure measured under the policy it left,
and switches back when the new one measured more than ``min_gain`` worse.  A candidate
refuted so is not chosen again until the cluster changes.  Nothing is thrown away: both
figures come from training the job does anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpsync.auto.efficiency import STRIDE_RISK_SDS
from mpsync.auto.measurements import SLOW_LINK_WORDS, Measurements
from mpsync.auto.progress import ProgressRatio, clamp
from mpsync.auto.ranking import Candidate, Ranked

__all__ = ["Decider", "DecisionRecord"]


@dataclass
class DecisionRecord:
    """One decision: when (seconds since the job's server started), why it was taken, the
    measurements, every candidate's prediction, what ran before, what runs after."""

    at_s: float
    trigger: str
    measurements: dict
    ranking: list
    previous: str
    chosen: str
    switch: bool
    reason: str
    switch_after_round: int | None = None
    decision_cost_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"at_s": round(self.at_s, 3), "trigger": self.trigger, "previous": self.previous,
                "chosen": self.chosen, "switch": self.switch, "reason": self.reason,
                "switch_after_round": self.switch_after_round,
                "decision_cost_s": round(self.decision_cost_s, 3),
                "measurements": self.measurements, "ranking": self.ranking, **self.extra}


def _stride_rose(before: Measurements, now: Measurements) -> bool:
    """Whether the gain the ranking uses rose by the step test's reading, which needs no
    second check to be a change: the reading kept is the one with the highest lower bound so
    far (``StepTest.kept``), so it never falls back with the next window, as a compute time or
    the noise scale may.  (The CNN at lr 0.01 read 2.99 +- 0.91 at 2.9 s and switched after the
    check 0.6 s later.)"""
    if now.ps_stride is None:
        return False
    lower = now.ps_stride[0] - STRIDE_RISK_SDS * now.ps_stride[1]
    was = (before.ps_stride[0] - STRIDE_RISK_SDS * before.ps_stride[1]
           if before.ps_stride is not None else float("-inf"))
    ranked = now.ranked_ps_gain()
    return lower > was and ranked > before.ranked_ps_gain() and ranked <= lower + 1e-9


def _to_target(seconds: float, m: Measurements) -> str:
    """A predicted time with the target it is predicted for: the ranking's times are to
    ``m.target_samples`` BSP-equivalent samples (a run's own, or auto's default), not to the
    run's accuracy target."""
    return f"{seconds:.1f} s to {m.target_samples:,.0f} BSP-equivalent samples"


class Decider:
    def __init__(self, current: Candidate, *, min_gain: float = 0.10,
                 change_tolerance: float = 0.3, confirm: int = 2, min_dwell_s: float = 3.0,
                 explore: bool = False):
        self.current = current
        self.min_gain = min_gain
        self.change_tolerance = change_tolerance
        self.confirm = confirm
        self.min_dwell_s = min_dwell_s
        self.basis: Measurements | None = None
        self.records: list[DecisionRecord] = []
        self.last_switch_s = float("-inf")
        self._seen = 0                   # consecutive checks that saw a change
        self.refuted: set[str] = set()   # switched to, measured worse: not again on this basis
        # Switched to, and the training diverged under it (``stability``): not again until
        # a worker's speed or the number of workers changes (the staleness it would run at
        # changes with them; a learning rate too large for it stays so, and the loss watch
        # rules it out again).
        self.unstable: dict[str, str] = {}
        # At the first decision: a candidate predicted faster by less than min_gain (within
        # the model's uncertainty; but by a fifth of it at least: a tie is no reason to pay a
        # switch) is tried, and kept only if confirm_switch's measured progress does not
        # refute it.  The slice trains the job: nothing is lost.
        self.explore = explore
        self._forced: str | None = None  # a trigger the next check ranks on (a new lr)
        # A move from the ring to the parameter server waits for the run's first timed
        # aggregation (``decide``); then the next check ranks again.
        self._awaits_network = False
        # Likewise a try of the PS within the model's uncertainty waits for the run's first
        # measured gain, then the next check ranks again (a job whose first iterations were
        # slow -- compiling, loading -- had no gain yet at the first decision and, nothing in
        # the cluster changing, was never ranked again: the try was lost for the whole run).
        self._awaits_gain = False
        # Set by a decision that stayed on an assumed network with a clear gain: the serving
        # side ranks the same measurements on ``SLOW_LINK`` and calls ``decide_on_slow_link``.
        self.wants_slow_link = False

    @property
    def switches(self) -> int:
        return sum(r.switch for r in self.records)

    def wants_ranking(self, m: Measurements, *, soon: bool = False) -> str | None:
        """Why the cluster needs a (new) decision, or None.  The first call always wants
        one; later ones only for a change confirmed on ``confirm`` consecutive calls.
        ``soon``: a check soon after the last ranking, where only what needs no second
        check asks again (a first timed aggregation or measured gain, a new learning rate,
        a rise of the step test's kept reading); a change that does is counted at the
        checks a ranking apart."""
        if self.basis is None:
            return "first measurement"
        if self._awaits_network and m.aggregation_s is not None:
            self._awaits_network, self._seen = False, 0
            return "first aggregation timed (the network's cost was assumed before)"
        if self._awaits_gain and m.ps_gain is not None:
            self._awaits_gain, self._seen = False, 0
            return "the parameter server's gain first measured (a try of it waited for it)"
        if self._forced is not None:
            trigger, self._forced, self._seen = self._forced, None, 0
            self._stop_awaiting_gain()
            return trigger
        change = m.change_from(self.basis, self.change_tolerance)
        if change is None:
            self._seen = 0
            return None
        rose = change.startswith("statistical efficiency") and _stride_rose(self.basis, m)
        if soon and not rose:
            return None
        self._seen += 1
        if self._seen < self.confirm and not rose:
            return None
        self._seen = 0
        self.refuted.clear()
        self._stop_awaiting_gain()
        trigger = f"cluster changed: {change}"
        if self.unstable and ("compute" in change or "workers" in change):
            # A worker's speed or the number of workers changed: the staleness a candidate
            # applying full updates runs at, and with it whether it diverges, is another one.
            # (Should it diverge again, the loss watch rules it out again.)
            trigger += (f"; re-admitted: {', '.join(sorted(self.unstable))} (ruled out as "
                        f"unstable on the cluster as it was)")
            self.unstable.clear()
        return trigger

    def _stop_awaiting_gain(self) -> None:
        """Another reason to rank came first: the decision it leads to is an ordinary one, no
        try within the uncertainty (a job that never measures the gain would keep it open)."""
        if self._awaits_gain:
            self._awaits_gain = False
            if not self._awaits_network:
                self.explore = False

    def learning_rate_changed(self, note: str) -> list[str]:
        """The job's learning rate changed (``note`` says where): what was ruled out or
        refuted at the old one -- a divergence, a measured progress -- is judged again, so
        it is re-admitted and the next check ranks anew (``wants_ranking``).  Returns the
        labels re-admitted."""
        readmitted = sorted(set(self.unstable) | self.refuted)
        self.unstable.clear()
        self.refuted.clear()
        self._forced = f"learning rate changed ({note})" + (
            f"; re-admitted: {', '.join(readmitted)} (ruled out at the old learning rate)"
            if readmitted else "")
        return readmitted

    def decide(self, ranked: list[Ranked], m: Measurements, now_s: float, trigger: str,
               *, cost_s: float = 0.0) -> DecisionRecord:
        """Choose among ``ranked`` (best first); the record says whether it switches."""
        if not ranked:
            raise ValueError("decide: no candidates were ranked")
        ranked = self._admitted(ranked)
        best = ranked[0]
        here = next((r for r in ranked if r.candidate == self.current), None)
        chosen, switch = self.current, False
        if best.candidate == self.current:
            reason = (f"{self.current.label} is predicted fastest "
                      f"({_to_target(best.predicted_time_to_target_s, m)})")
        elif here is None:
            chosen, switch = best.candidate, True
            reason = f"{self.current.label} is not a candidate; {best.candidate.label} ranks first"
        else:
            gain = here.predicted_time_to_target_s / best.predicted_time_to_target_s - 1.0
            # Not on the PS's full updates while the job has not measured their gain: there
            # the fitted constant's error is a divergence (``efficiency``), not a few %.
            unmeasured = best.candidate.topology == "ps" and m.ps_gain is None
            tryable = self.explore and self.min_gain / 5 <= gain < self.min_gain
            # Nor from the ring to the parameter server before the run has timed one
            # aggregation: until then every transfer is costed on an assumed link
            # (``Measurements.bandwidth``, 10 Gbit/s), and on a slow one the PS moves the
            # whole model each iteration where ElasticBSP moves it once a round (at
            # 100 Mbit/s such a guess switched at 1.1-1.6 s and was measured 64-76% slower).
            blind = (self.current.topology == "ring" and best.candidate.topology == "ps"
                     and m.aggregation_s is None and gain >= self.min_gain / 5)
            if blind:
                self._awaits_network = True
                # A clear gain may not need the network timed: the serving side ranks the
                # same measurements once more on a slow link (``on_slow_link``).
                self.wants_slow_link = gain >= self.min_gain
                reason = (f"{best.candidate.label} predicted {gain:.0%} faster than "
                          f"{self.current.label} on an assumed network: no aggregation "
                          f"timed in the run yet; stay, rank again once one is" +
                          (", or at once on an assumed slow link" if self.wants_slow_link
                           else ""))
            elif tryable and unmeasured:
                self._awaits_gain = True
                reason = (f"{best.candidate.label} predicted {gain:.0%} faster than "
                          f"{self.current.label}, within the model's uncertainty, with the "
                          f"parameter server's gain not yet measured in the run: stay, rank "
                          f"again once it is")
            elif tryable:
                chosen, switch = best.candidate, True
                reason = (f"{best.candidate.label} predicted {gain:.0%} faster than "
                          f"{self.current.label}, within the model's uncertainty "
                          f"({self.min_gain:.0%}): tried, kept unless its measured progress "
                          f"is worse")
            elif gain < self.min_gain:
                reason = (f"{best.candidate.label} predicted only {gain:.0%} faster than "
                          f"{self.current.label} (a switch needs {self.min_gain:.0%}): stay")
            elif now_s - self.last_switch_s < self.min_dwell_s:
                reason = (f"{best.candidate.label} predicted {gain:.0%} faster, but the last "
                          f"switch was {now_s - self.last_switch_s:.1f}s ago "
                          f"(< {self.min_dwell_s:g}s): stay")
            else:
                chosen, switch = best.candidate, True
                reason = (f"{best.candidate.label} predicted {gain:.0%} faster than "
                          f"{self.current.label} ({best.predicted_time_to_target_s:.1f} s vs "
                          f"{_to_target(here.predicted_time_to_target_s, m)})")
        if not (self._awaits_network or self._awaits_gain):
            self.explore = False      # (only at the first decision with the network timed
                                      # and, for a try of the PS, its gain measured)
        record = DecisionRecord(at_s=now_s, trigger=trigger, measurements=m.as_dict(),
                                ranking=[r.as_dict() for r in ranked],
                                previous=self.current.label, chosen=chosen.label,
                                switch=switch, reason=reason, decision_cost_s=cost_s)
        self.records.append(record)
        self.basis = m
        if switch:
            self.current = chosen
            self.last_switch_s = now_s
        return record

    def _admitted(self, ranked: list[Ranked]) -> list[Ranked]:
        """``ranked`` without the candidates refuted or ruled out as unstable (the running one
        stays); all of them where nothing else is left."""
        return [r for r in ranked if (r.candidate.label not in self.refuted
                                      and r.candidate.label not in self.unstable)
                or r.candidate == self.current] or ranked

    def decide_on_slow_link(self, ranked: list[Ranked], m: Measurements, now_s: float,
                            *, cost_s: float = 0.0) -> DecisionRecord:
        """The move to the parameter server that ``decide`` held for want of a timed
        aggregation, judged on ``ranked``: the same candidates ranked on ``m``, the same
        measurements with the link at ``SLOW_LINK`` (``Measurements.on_slow_link``).  Where
        a parameter server candidate is still predicted at least ``min_gain`` faster than the
        running policy there, the record switches to it now; otherwise it stays, and the
        first timed aggregation still asks for a ranking.

        Why: the held move waited for ElasticBSP's first barrier, 1-2 s into a run whose
        policy averaged n steps into one where full updates made 3x the progress per sample
        (the CNN at lr 0.01 with momentum 0.9; bench/auto/README.md).  A job whose
        parameter server wins even where each push and pull crawls at 100 Mbit/s does not need
        the link measured to move; one that loses there (the wide MLP, 8.7 MB a model) waits
        as before.  A link slower still is what the confirmation after the switch measures."""
        self.wants_slow_link = False
        trigger = f"the held move ranked on an assumed slow link ({SLOW_LINK_WORDS})"
        ranked = self._admitted(ranked)
        best = next((r for r in ranked if r.candidate.topology == "ps"), None)
        here = next((r for r in ranked if r.candidate == self.current), None)
        gain = (here.predicted_time_to_target_s / best.predicted_time_to_target_s - 1.0
                if best is not None and here is not None else 0.0)
        switch = (best is not None and here is not None and best is ranked[0]
                  and gain >= self.min_gain and now_s - self.last_switch_s >= self.min_dwell_s)
        if switch:
            reason = (f"{best.candidate.label} predicted {gain:.0%} faster than "
                      f"{self.current.label} even on an assumed slow link "
                      f"({best.predicted_time_to_target_s:.1f} s vs "
                      f"{_to_target(here.predicted_time_to_target_s, m)}; no aggregation "
                      f"timed in the run yet)")
        elif best is None or here is None:
            reason = "no parameter server candidate ranked against the running policy: stay"
        else:
            reason = (f"on an assumed slow link {ranked[0].candidate.label} ranks first, "
                      f"{best.candidate.label} {gain:.0%} against {self.current.label} (a "
                      f"switch needs {self.min_gain:.0%}): stay, rank again once an "
                      f"aggregation is timed")
        chosen = best.candidate if switch else self.current
        record = DecisionRecord(at_s=now_s, trigger=trigger, measurements=m.as_dict(),
                                ranking=[r.as_dict() for r in ranked],
                                previous=self.current.label, chosen=chosen.label,
                                switch=switch, reason=reason, decision_cost_s=cost_s)
        self.records.append(record)
        if switch:
            self._awaits_network = self._awaits_gain = self.explore = False
            self.current = chosen
            self.last_switch_s = now_s
        return record

    def _stalled(self, left: Candidate, switched, why: str, rate: float,
                 left_rate: float | None, now_s: float, measured_s: float) -> DecisionRecord:
        """``confirm_switch`` where no progress was measurable (its doc)."""
        to = left
        if left.topology != "ring":
            ring = [r for r in (switched.ranking if switched is not None else ())
                    if r["topology"] == "ring" and r["candidate"] not in self.unstable]
            to = Candidate.from_dict(ring[0]) if ring else left
        measured = {"left": left.label, "iterations_per_s": round(rate, 2),
                    "left_iterations_per_s": None if left_rate is None else round(left_rate, 2),
                    "measured_s": round(measured_s, 2), "stalled": why}
        back = to != self.current
        reason = (f"{why}: " + (f"to {to.label}, which averages the workers' updates"
                                if back else "stay"))
        record = DecisionRecord(at_s=now_s, trigger="confirmation", measurements=measured,
                                ranking=[], previous=self.current.label, chosen=to.label,
                                switch=back, reason=reason)
        self.records.append(record)
        if back:
            self.refuted.add(self.current.label)
            self.current = to
            self.last_switch_s = now_s
        return record

    def diverged(self, back_to: Candidate, reason: str, now_s: float,
                 unstable: list[Candidate], measured: dict | None = None) -> DecisionRecord:
        """The training diverges under the running policy (``reason``: what the loss did):
        switch to ``back_to`` now, whatever the dwell time (every step under it is lost
        progress), and choose none of ``unstable`` again until a worker's speed or the number
        of workers changes (``wants_ranking`` re-admits them then)."""
        for c in unstable:
            self.unstable[c.label] = reason
        record = DecisionRecord(
            at_s=now_s, trigger="training loss", measurements=dict(measured or {}),
            ranking=[], previous=self.current.label, chosen=back_to.label, switch=True,
            reason=(f"{reason}: back to {back_to.label}; not chosen again until the cluster "
                    f"changes: {', '.join(sorted(c.label for c in unstable))}"))
        self.records.append(record)
        self.current = back_to
        self.last_switch_s = now_s
        return record

    def confirm_switch(self, left: Candidate, left_rate: float | None, rate: float,
                       now_s: float, measured_s: float, progress: ProgressRatio | None = None,
                       judged: bool = True, stalled: str | None = None) -> DecisionRecord:
        """The last switch (from ``left``) measured: the job's iterations per second (every
        worker's, the same batch each) under ``left`` before it (None: too little of it ran
        on the cluster as it is now; the ranking's prediction of ``left`` stands in, scaled
        by the running policy's measured rate over its predicted one) and under the running
        policy for ``measured_s`` seconds since.  Progress per second is that times each one's
        efficiency in the ranking that switched, the running one's moved into what
        ``progress`` (the training loss's progress per sample since the switch against
        before it, ``mpsync.auto.progress``; None: not measured) allows (where ``judged``;
        otherwise the measurement is only recorded); the record switches back when the new
        policy's is more than ``min_gain`` below the left one's.

        ``stalled`` (``PhaseProgress.stalled``: neither the policy left's last seconds nor the
        running one's since the switch made measurable progress; None: either did, or it was
        not asked): where ``judged``, the record leaves the running policy for the ring, the
        policy left if it ran there, else the ring's best in the ranking that switched.  With
        no falling loss to measure against, a rate from the model alone confirmed a move
        between two of the parameter server's policies at +118% progress per second, and
        the run then needed 45 s more to reach its target (bench/auto/README.md, *A slow
        job's loss watch, and a confirmation with nothing to measure against*); the ring's
        averaged updates carry no staleness."""
        switched = next((r for r in reversed(self.records) if r.switch), None)
        if stalled is not None and judged:
            return self._stalled(left, switched, stalled, rate, left_rate, now_s, measured_s)
        eff = {} if switched is None else {r["candidate"]: r["efficiency"]
                                           for r in switched.ranking}
        model, left_eff = eff.get(self.current.label, 1.0), eff.get(left.label, 1.0)
        now_eff, efficiency_words = model, ""
        predicted = left_rate is None
        if predicted:
            speed = {} if switched is None else {r["candidate"]: r["samples_per_s"]
                                                 for r in switched.ranking}
            here, there = speed.get(self.current.label), speed.get(left.label)
            left_rate = rate * there / here if here and there else rate
        measured = {"left": left.label, "left_iterations_per_s": round(left_rate, 2),
                    "left_rate_predicted": predicted,
                    "iterations_per_s": round(rate, 2), "measured_s": round(measured_s, 2)}
        if progress is not None and not judged:
            measured["progress"] = progress.as_dict()
        elif progress is not None:
            lo, hi = progress.bracket(left_eff)
            now_eff = clamp(model, lo, hi)
            measured.update(progress=progress.as_dict(),
                            efficiency_bracket=[round(lo, 3), round(hi, 3)],
                            efficiency_model=round(model, 3), efficiency=round(now_eff, 3))
            moved = "moved to" if now_eff != model else "kept at"
            efficiency_words = (f"; its efficiency {model:.2f} {moved} {now_eff:.2f}: "
                                f"{progress.note}, which allows {lo:.2f}-{hi:.2f}")
        now_p = rate * now_eff
        left_p = left_rate * left_eff
        gain = now_p / left_p - 1.0 if left_p > 0 else 0.0
        measured.update(left_progress_per_s=round(left_p, 1), progress_per_s=round(now_p, 1))
        back = gain < -self.min_gain
        if back:
            reason = (f"measured {self.current.label} {-gain:.0%} slower in progress per second "
                      f"than {left.label} ({now_p:.1f} vs {left_p:.1f} iterations/s x efficiency "
                      f"over {measured_s:.1f}s{efficiency_words}): back to {left.label}")
            self.refuted.add(self.current.label)
        else:
            reason = (f"measured {self.current.label} at {gain:+.0%} progress per second against "
                      f"{left.label} ({now_p:.1f} vs {left_p:.1f}{efficiency_words}): confirmed")
        record = DecisionRecord(at_s=now_s, trigger="confirmation", measurements=measured,
                                ranking=[], previous=self.current.label,
                                chosen=left.label if back else self.current.label,
                                switch=back, reason=reason)
        self.records.append(record)
        if back:
            self.current = left
            self.last_switch_s = now_s
        return record
