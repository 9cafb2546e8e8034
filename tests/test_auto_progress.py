"""The progress per sample a policy made while the job ran it (``mpsync.auto.progress``): read
from the training loss before and after a switch, on a real model (softmax regression on the
digits, trained by SGD as four data-parallel workers would) and on curves of known rates; how
the bracket it gives moves the efficiency a confirmation and the ranking use; and the state
server's ``auto`` measuring it around a real switch."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from mpsync.auto.decider import Decider
from mpsync.auto.efficiency import PS_FULL_UPDATE_GAIN, efficiency, ranked_gain
from mpsync.auto.measurements import Measurements
from mpsync.auto.progress import FLATTENING, PhaseProgress, ProgressRatio, clamp
from mpsync.auto.ranking import Candidate, Ranked

from auto_ring_driver import RingDriver, ring_auto

RATE = 40.0          # the job's iterations per second: 4 workers at 0.1 s


# -- a real model --------------------------------------------------------------------------------
class _Digits:
    """Softmax regression on the digits; a round is one iteration of each of 4 workers on 32
    samples: averaged into one step (the ring) or applied one after another (the parameter
    server's full updates)."""

    def __init__(self):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        self.x, self.y = x / 16.0, y

    def loss_grad(self, w, idx):
        z = self.x[idx] @ w
        z -= z.max(1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(1, keepdims=True)
        loss = -np.mean(np.log(p[np.arange(len(idx)), self.y[idx]] + 1e-12))
        p[np.arange(len(idx)), self.y[idx]] -= 1.0
        return loss, self.x[idx].T @ p / len(idx)

    def full_loss(self, w):
        return self.loss_grad(w, np.arange(len(self.x)))[0]

    def round(self, w, rng, lr, full_updates):
        losses, grads = [], []
        for _ in range(4):
            loss, g = self.loss_grad(w, rng.integers(0, len(self.x), 32))
            losses.append(loss)
            if full_updates:
                w = w - lr * g
            else:
                grads.append(g)
        if not full_updates:
            w = w - lr * np.mean(grads, 0)
        return w, losses

    def samples_to(self, w, lr, full_updates, target, seed, most=5000):
        rng = np.random.default_rng(seed)
        for k in range(most):
            if k % 5 == 0 and self.full_loss(w) <= target:
                return 4 * 32 * k
            w, _ = self.round(w, rng, lr, full_updates)
        return math.inf


@pytest.fixture(scope="module")
def digits():
    return _Digits()


def _switched(digits, seed, *, lr=0.1, rounds=150, after_full=False, after_rounds=40):
    """Train ``rounds`` rounds on the ring, switch (to full updates where ``after_full``), train
    ``after_rounds`` more, each worker reporting its minibatch loss; (the measured ratio, the
    weights at the switch)."""
    rng = np.random.default_rng(seed)
    w, it = np.zeros((64, 10)), 0
    progress = PhaseProgress("ring")
    for _ in range(rounds):
        w, losses = digits.round(w, rng, lr, False)
        it += 4
        for loss in losses:
            progress.add(it / RATE, loss, 1, it)
    progress.begin(it / RATE, "after", it)
    at_switch = w.copy()
    for _ in range(after_rounds):
        w, losses = digits.round(w, rng, lr, after_full)
        it += 4
        for loss in losses:
            progress.add(it / RATE, loss, 1, it)
    return progress.ratio(it / RATE), at_switch


def test_an_unchanged_policy_reads_within_its_bracket_and_the_flattening_allowed(digits):
    """A switch to the same training: the truth is 1.  The reading is low (the loss flattens
    between the windows) but by no more than ``FLATTENING`` allows, and the bracket holds 1
    in nearly every seed."""
    ratios = [_switched(digits, seed)[0] for seed in range(12)]
    assert all(r is not None for r in ratios)
    held = sum(lo <= 1.0 <= hi for lo, hi in (r.bracket() for r in ratios))
    assert held >= 10, [(round(r.ratio, 2), round(r.sd, 2)) for r in ratios]
    median = statistics.median(r.ratio for r in ratios)
    assert 1.0 / FLATTENING <= median <= 1.2, median


def test_full_updates_read_faster_and_their_measured_progress_is_in_the_bracket(digits):
    """After the switch each worker's update is applied in full (4 steps of 32 where the ring
    took one of 128, the same learning rate).  The truth: the samples each needs from the
    switch's weights to a loss 15% lower, ring over full updates (medians of 3 seeds)."""
    readings = [_switched(digits, seed, after_full=True) for seed in range(12)]
    w = readings[0][1]
    target = 0.85 * digits.full_loss(w)
    truths = []
    for seed in range(3):
        _, w = _switched(digits, seed, after_full=True)
        truths.append(digits.samples_to(w, 0.1, False, target, seed)
                      / digits.samples_to(w, 0.1, True, target, seed))
    truth = statistics.median(truths)
    assert truth > 2.0, truths                 # the effect measured is there to find
    brackets = [r.bracket() for r, _ in readings]
    assert sum(lo > 1.0 for lo, _ in brackets) >= 9, brackets
    assert sum(lo <= truth <= hi for lo, hi in brackets) >= 10, (truth, brackets)


# -- curves of known rates -----------------------------------------------------------------------
def _curve(progress, rng, t0, t1, level_at, noise=0.1):
    """Reports from 4 workers every 0.1 s over [t0, t1) at the job's RATE iterations/s."""
    t = t0
    while t < t1 - 1e-9:
        it = int(round(t * RATE))
        for _ in range(4):
            progress.add(t, level_at(it) * math.exp(rng.normal(0.0, noise)), 1, it)
        t = round(t + 0.1, 9)


@pytest.mark.parametrize("speedup", [0.3, 2.0])
def test_an_exponential_loss_reads_its_true_ratio(speedup):
    """A loss that decays exponentially has a constant relative rate: the reading is the
    true ratio, within its own standard deviation's reach."""
    rho = 1.5e-3
    hits, readings = 0, []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        progress = PhaseProgress("ring")
        x_s = int(6.0 * RATE)
        _curve(progress, rng, 0.0, 6.0, lambda it: 2.3 * math.exp(-rho * it))
        progress.begin(6.0, "ps", x_s)
        _curve(progress, rng, 6.0, 10.0,
               lambda it: 2.3 * math.exp(-rho * x_s - speedup * rho * (it - x_s)))
        r = progress.ratio(10.0)
        readings.append((round(r.ratio, 2), round(r.sd, 2)))
        hits += abs(r.ratio - speedup) <= 3 * r.sd
    assert hits >= 9, readings
    # (unbiased: over 200 seeds the mean read 0.33 and 2.07; ten seeds' median wanders)
    assert abs(statistics.median(x for x, _ in readings) - speedup) <= 0.1 + 0.1 * speedup, \
        readings


def _decaying(it):
    return 2.3 * math.exp(-1.5e-3 * it)


def _across_a_switch(after_at, label, seed, end=10.0):
    """6 s of BSP's loss decaying by 1.5e-3 per iteration, a switch to ``label`` at iteration
    240, then ``after_at(iteration)`` until ``end``."""
    rng = np.random.default_rng(seed)
    progress = PhaseProgress("bsp/ring")
    _curve(progress, rng, 0.0, 6.0, _decaying)
    progress.begin(6.0, label, int(6.0 * RATE))
    _curve(progress, rng, 6.0, end, after_at)
    return progress


def test_a_loss_that_rises_after_the_switch_caps_the_efficiency_below_the_model():
    x_s, level = int(6.0 * RATE), _decaying(int(6.0 * RATE))
    progress = _across_a_switch(lambda it: level * (1.0 + 2e-3 * (it - x_s)), "ssp/ps", 0)
    r = progress.ratio(10.0)
    assert r.ratio < 0 and not r.diverged
    lo, hi = r.bracket(1.0)
    assert lo == 0.0 and hi < 0.5, (lo, hi)
    assert clamp(1.22, lo, hi) == hi
    assert "ssp/ps made" in r.note and "bsp/ring" in r.note


def test_a_reference_from_the_runs_first_seconds_bounds_only_from_above():
    """Switched 1.5 s into the run: the reference covers less than ``MIN_REFERENCE_S`` (a run's
    first seconds are slow, and would overstate the ratio), so the bracket's lower end is 0;
    the upper end still holds the new policy down."""
    rng = np.random.default_rng(3)
    progress = PhaseProgress("ebsp/ring")
    _curve(progress, rng, 0.0, 1.5, lambda it: 2.3 * math.exp(-3e-3 * it))
    progress.begin(1.5, "ssp/ps", 60)
    _curve(progress, rng, 1.5, 5.5, lambda it: 2.3 * math.exp(-3e-3 * 60 - 9e-3 * (it - 60)))
    r = progress.ratio(5.5)
    assert r.reference_s == pytest.approx(1.5) and r.ratio > 2.0, r
    lo, hi = r.bracket(1.0)
    assert lo == 0.0 and hi > r.ratio, (lo, hi)
    assert "in the 1.5 s before the switch" in r.note


def test_a_non_finite_loss_after_the_switch_reads_diverged():
    progress = _across_a_switch(lambda it: 1.0 if it < 300 else math.inf, "asp/ps", 1)
    r = progress.ratio(10.0)
    assert r.diverged and r.bracket(1.0) == (0.0, 0.0)
    assert "not finite" in r.note


def test_nothing_is_read_from_too_little_or_from_a_flat_loss():
    rng = np.random.default_rng(2)
    progress = _across_a_switch(lambda it: 1.0, "ssp/ps", 2, end=8.0)
    assert progress.ratio(8.0) is None                 # the window after is not complete
    assert progress.declined == "the window after the switch is 1.5 s so far"
    assert progress.ratio(8.0, min_span_s=1.0) is not None
    flat = PhaseProgress("bsp/ring")
    _curve(flat, rng, 0.0, 6.0, lambda it: 0.3, noise=0.3)
    flat.begin(6.0, "ssp/ps", 240)
    _curve(flat, rng, 6.0, 10.0, lambda it: 0.3, noise=0.3)
    assert flat.ratio(10.0) is None                    # no progress before: no reference
    assert flat.declined.startswith("the loss was not falling measurably"), flat.declined
    signed = _across_a_switch(lambda it: -1.0, "ssp/ps", 3)
    assert signed.ratio(10.0) is None                  # a loss below 0 has no logarithm
    assert signed.declined == "a loss at or below 0"
    with pytest.raises(ValueError, match="window_s"):
        PhaseProgress(window_s=0)


def test_a_stall_is_where_neither_side_of_the_switch_made_measurable_progress():
    """``ratio`` has no reference where the loss was flat before the switch; ``stalled`` says
    whether the running policy moves the loss itself: not where it stays flat too, not where
    it falls, nor where the policy left was falling (``ratio`` measures that)."""
    def switched(before, after, seed):
        rng = np.random.default_rng(seed)
        progress = PhaseProgress("ssp/ps (staleness=3)")
        _curve(progress, rng, 0.0, 6.0, before, noise=0.2)
        progress.begin(6.0, "asp/ps", int(6.0 * RATE))
        _curve(progress, rng, 6.0, 10.0, after, noise=0.2)
        return progress

    # Two flat windows read as a stall but where noise tilts one past 2 standard errors
    # (about 1 in 40 each): then the confirmation is what it was without the test.
    flats = [switched(lambda it: 0.6, lambda it: 0.6, seed) for seed in range(10)]
    assert all(f.ratio(10.0) is None for f in flats)
    stalls = [f.stalled(10.0) for f in flats]
    assert sum(why is not None for why in stalls) >= 8, stalls
    flat = flats[stalls.index(next(w for w in stalls if w is not None))]
    assert stalls[flats.index(flat)].startswith(
        "neither ssp/ps (staleness=3)'s last 3.0 s nor asp/ps's 3.5 s since the switch")
    for seed in range(10):
        falls = switched(lambda it: 0.6, lambda it: 0.6 * math.exp(-3e-3 * (it - 240)), seed)
        assert falls.ratio(10.0) is None and falls.stalled(10.0) is None
    left_fell = _across_a_switch(lambda it: 0.5, "asp/ps", 5)
    assert left_fell.ratio(10.0) is not None and left_fell.stalled(10.0) is None
    assert flat.stalled(6.4) is None                   # nothing after the switch yet
    assert PhaseProgress("bsp/ring").stalled(1.0) is None   # no switch


# -- what the bracket moves ----------------------------------------------------------------------
def _ratio(ratio, sd=0.05, left="bsp/ring", label="ssp/ps (staleness=3)"):
    return ProgressRatio(left, label, ratio, sd, ratio * 1e-3, sd * 1e-3, 1e-3, 1e-5, 30, 30)


def _ranked(entries):
    return [Ranked(c, t, 1000.0, eff, 0.1, ("x",), 0.0) for c, t, eff in entries]


def test_a_confirmation_goes_back_when_the_measured_progress_refutes_the_model():
    """The switch to the PS predicted an efficiency of 1.2; the throughput rose 27%.  The model
    alone confirms it; the loss's progress since the switch (a fifth of BSP's per sample)
    sends it back, and the record says why."""
    bsp, ssp = Candidate("bsp", "ring"), Candidate("ssp", "ps", (("staleness", 3),))
    m = Measurements(compute_s=(0.05,) * 4, aggregation_s=0.002)   # a timed network
    for progress, back in ((None, False), (_ratio(0.2), True), (_ratio(1.1), False)):
        d = Decider(bsp)
        d.decide(_ranked([(ssp, 5.0, 1.2), (bsp, 8.0, 1.0)]), m, 1.0, "first measurement")
        record = d.confirm_switch(bsp, 10.0, 12.7, 7.0, 4.0, progress=progress)
        assert record.switch == back, record.reason
        if progress is None:
            assert "efficiency_bracket" not in record.measurements
            continue
        lo, hi = record.measurements["efficiency_bracket"]
        assert lo <= record.measurements["efficiency"] <= hi
        assert record.measurements["efficiency_model"] == 1.2
        assert "made" in record.reason and "allows" in record.reason
    # Too little of BSP ran on the cluster as it is (a change came just before the switch):
    # its rate is the ranking's prediction, scaled by the running policy's measured rate.
    predicted = Decider(bsp)
    predicted.decide([Ranked(ssp, 5.0, 1000.0, 1.2, 0.1, ("x",), 0.0),
                      Ranked(bsp, 8.0, 900.0, 1.0, 0.1, ("x",), 0.0)], m, 1.0, "first")
    record = predicted.confirm_switch(bsp, None, 12.0, 7.0, 4.0, progress=_ratio(0.2))
    assert record.measurements["left_rate_predicted"] is True
    assert record.measurements["left_iterations_per_s"] == pytest.approx(10.8)
    assert record.switch, record.reason
    lifted = Decider(bsp)
    lifted.decide(_ranked([(ssp, 5.0, 0.9), (bsp, 8.0, 1.0)]), m, 1.0, "first measurement")
    record = lifted.confirm_switch(bsp, 10.0, 9.0, 7.0, 4.0, progress=_ratio(2.0))
    assert not record.switch and record.measurements["efficiency"] == pytest.approx(1.9)


def test_a_stalled_parameter_server_goes_to_the_ring():
    """Switched between two of the PS's policies with the loss flat before and after: the
    rates alone (+118% as ranked) would confirm it; ``stalled`` sends it to the ring's best
    in the ranking that switched (ElasticBSP), not back to the PS policy left, and the
    running one is refuted.  Left from the ring, it goes back there; unjudged, it stays."""
    ebsp, ssp = Candidate("ebsp", "ring"), Candidate("ssp", "ps", (("staleness", 3),))
    asp = Candidate("asp", "ps")
    m = Measurements(compute_s=(0.05,) * 4, aggregation_s=0.002)
    why = "neither ssp/ps's last 3.0 s nor asp/ps's 3.5 s since the switch made progress"
    d = Decider(ssp)
    d.decide(_ranked([(asp, 5.0, 1.2), (ebsp, 8.0, 0.93), (ssp, 11.0, 1.2)]), m, 1.0, "change")
    assert d.current == asp
    confirmed = Decider(ssp)
    confirmed.decide(_ranked([(asp, 5.0, 1.2), (ebsp, 8.0, 0.93)]), m, 1.0, "change")
    assert not confirmed.confirm_switch(ssp, 2.8, 8.9, 7.0, 4.0).switch
    record = d.confirm_switch(ssp, None, 8.9, 7.0, 4.0, stalled=why)
    assert record.switch and record.chosen == "ebsp/ring" and d.current == ebsp, record.reason
    assert record.reason.startswith(why) and "asp/ps" in d.refuted
    assert record.measurements["stalled"] == why
    from_ring = Decider(ebsp)
    from_ring.decide(_ranked([(asp, 5.0, 1.2), (ebsp, 8.0, 0.93)]), m, 1.0, "change")
    back = from_ring.confirm_switch(ebsp, 12.0, 8.9, 7.0, 4.0, stalled=why)
    assert back.switch and from_ring.current == ebsp
    unjudged = Decider(ebsp)
    unjudged.decide(_ranked([(asp, 5.0, 1.2), (ebsp, 8.0, 0.93)]), m, 1.0, "change")
    kept = unjudged.confirm_switch(ebsp, 12.0, 14.0, 7.0, 4.0, judged=False, stalled=why)
    assert not kept.switch and unjudged.current == asp


def test_the_gain_bracket_moves_the_ranked_gain_and_reads_as_a_change():
    assert ranked_gain(None) == PS_FULL_UPDATE_GAIN
    assert ranked_gain(None, 0.0, 0.1, 0.4) == 0.4            # measured crawling: capped
    assert ranked_gain(None, 0.0, 2.0, 6.0) == 2.0            # measured faster: lifted
    assert ranked_gain(3.3, 0.3, 2.0, 6.0) == 2.0             # the noise bound alone: 1.22
    row = {"iterations_each": [100] * 4, "sim_time_s": 10.0}
    eff, why = efficiency(row, True, [0.1] * 4, None, 0.0, (0.1, 0.4))
    assert eff == pytest.approx(0.4) and "x0.10-0.40 by the progress" in why
    base = Measurements(compute_s=(0.05,) * 4)
    capped = Measurements(compute_s=(0.05,) * 4, ps_gain_lo=0.1, ps_gain_hi=0.4,
                          ps_progress_note="ssp/ps made 0.20")
    assert capped.ps_gain_bracket == (0.1, 0.4)
    assert Measurements.from_dict(capped.as_dict()) == capped
    change = capped.change_from(base, 0.3)
    assert change is not None and "1.22 -> 0.40" in change and "ssp/ps made 0.20" in change
    assert base.change_from(base, 0.3) is None
    for lo, hi in ((0.5, None), (0.5, 0.2), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="ps_gain_lo"):
            Measurements(compute_s=(0.05,) * 4, ps_gain_lo=lo, ps_gain_hi=hi)


# -- the state server ----------------------------------------------------------------------------
def test_the_server_measures_the_progress_of_the_policy_it_switched_to():
    """AutoPolicy on the ring (no MPI: a virtual clock, the ranking in its helper process):
    worker 3 slows down and auto switches away from BSP.  After the switch the training loss
    falls three times as fast per iteration; the confirmation reads it from the losses and
    records it (a ring policy's efficiency stays the model's), and the run's description lists
    the measurement."""
    pol = ring_auto()
    switch_at = [None]

    def loss_at(now, iterations):
        u = iterations if switch_at[0] is None else \
            switch_at[0] + 3 * (iterations - switch_at[0])
        return 2.3 * math.exp(-6e-3 * u)

    driver = RingDriver(pol, loss_at, noise=0.05)
    try:
        assert driver.run([0.05] * 4, lambda: len(pol.decider.records) >= 1, 60.0), pol.problems
        slowed = [0.05, 0.05, 0.05, 0.2]
        assert driver.run(slowed, lambda: pol.switch_after is not None, 60.0), pol.problems
        assert driver.run(slowed, lambda: pol.switch_after is None, 10.0)
        switch_at[0] = pol.progress.start_iterations
        assert driver.run(slowed, lambda: pol.decider.records[-1].trigger == "confirmation",
                          10.0), [r.as_dict() for r in pol.decider.records]
        record = pol.decider.records[-1]
        measured = record.measurements.get("progress")
        assert measured is not None, record.as_dict()
        assert measured["ratio"] > 1.5, measured
        # a ring policy's progress is recorded, not judged (the PS's is: the Decider's test)
        assert "efficiency_bracket" not in record.measurements, record.measurements
        assert pol.describe()["progress"][-1]["ratio"] == measured["ratio"]
        assert pol.gain_bracket is None          # a ring policy: no gain of full updates
    finally:
        pol.ranker.close()
