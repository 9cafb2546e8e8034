"""``auto``'s step test: whether the loss still falls along a parameter server round's stride
(mpsync.torch.strategies.gradient_pairs on the worker, mpsync.auto.curvature on the server),
the gain it implies, and how the ranking raises the parameter server's gain with it."""

from __future__ import annotations

import math

import pytest
import torch

from mpsync.auto import Candidate, Measurements
from mpsync.auto.curvature import MIN_PAIRS, MIN_REPORTS, StepTest, stride_gain
from mpsync.auto.efficiency import PS_FULL_UPDATE_GAIN, ranked_gain
from mpsync.auto.ranking import rank_candidates
from mpsync.torch.strategies.gradient_pairs import GradientPairs, sgd_step_sizes

from test_auto_gradient_noise import _model_and_data as _noise_problem


def test_the_gain_is_n_for_a_small_step_and_falls_below_zero_where_strides_overshoot():
    """D_ps / D_ring (curvature module doc): no curvature, n; the curvature of a step at
    the edge of n strides' stability, the parameter server makes no progress; beyond it a
    loss that rises (below 0); no reading where the ring's own step does not fall, without
    a slope or with one worker."""
    assert stride_gain(1.0, 2.0, 0.0, 4) == pytest.approx(4.0)
    # f = 1 (no noise): D_ps = n p - n² q / 2 = 0 at q = 2 p / n; the ring still falls.
    assert stride_gain(1.0, 1.0, 0.5, 4) == pytest.approx(0.0, abs=1e-12)
    assert stride_gain(1.0, 1.0, 1.0, 4) < 0
    # All noise but one share in ten: the strides' cross terms are the signal's alone.
    p, a, q = 0.1, 1.0, 0.05
    f = p / a
    ring = p - q / 2 * (f + (1 - f) / 4)
    ps = 4 * p - 2 * q * (1 + 3 * f)
    assert stride_gain(p, a, q, 4) == pytest.approx(ps / ring)
    assert stride_gain(1.0, 1.0, 2.5, 4) is None           # the ring's step rises: no reading
    assert stride_gain(-0.1, 1.0, 0.1, 4) is None          # no slope
    assert stride_gain(1.0, 0.0, 0.1, 4) is None
    assert stride_gain(1.0, 2.0, 0.0, 1) is None


def _model_and_data(seed=0):
    """The noise tests' least-squares problem, from weights of 0.1 (not its minimum)."""
    model, x, y = _noise_problem(seed)
    with torch.no_grad():
        model.weight.fill_(0.1)
    return model, x, y


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x).squeeze(1), y)


def test_a_probe_measures_the_curvature_along_n_steps_and_restores_the_weights_bit_for_bit():
    """A least-squares loss is exactly quadratic: one probe's q equals u₁ᵀH₂u₁ with u₁ the
    optimizer's effective step (lr / (1 - momentum)) along the first batch's gradient and H₂
    the second batch's Hessian (2 X₂ᵀX₂ / b), p = ε g₁ · g₂ and a = ε (|g₁|² + |g₂|²) / 2;
    the weights and the step's gradients are back exactly afterwards."""
    model, x, y = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    eps = 0.02 / (1 - 0.5)
    pairs = GradientPairs(list(model.parameters()), every_s=0.0, clock=lambda: 0.0,
                          optimizer=opt, steps_ahead=lambda: 4)
    x1, y1, x2, y2 = x[:32], y[:32], x[32:64], y[32:64]
    model.zero_grad()
    _loss(model, x2, y2).backward()
    g2 = model.weight.grad.detach().clone().reshape(-1)
    model.zero_grad()
    _loss(model, x1, y1).backward()
    g1 = model.weight.grad.detach().clone().reshape(-1)
    weights = model.weight.detach().clone()

    def second():
        loss = _loss(model, x2, y2)
        loss.backward()
        return loss

    assert pairs.probe(second)
    assert torch.equal(model.weight.detach(), weights)
    assert torch.equal(model.weight.grad.reshape(-1), g1)
    count, p, a, q = pairs.take_stride()
    hessian = 2.0 * x2.T @ x2 / 32
    u = -eps * g1
    assert count == 1
    assert p == pytest.approx(eps * float(g1 @ g2), rel=1e-4)
    assert a == pytest.approx(eps * 0.5 * float(g1 @ g1 + g2 @ g2), rel=1e-4)
    assert q == pytest.approx(float(u @ hessian @ u), rel=1e-3)
    assert pairs.take_stride() == (0, 0.0, 0.0, 0.0)
    assert pairs.take()[2] == 1                             # (the noise pair as before)


def test_no_step_test_without_a_loss_an_sgd_optimizer_or_the_worker_count():
    """The closure returns nothing, the optimizer is Adam, or there is no count of workers:
    the noise pair is taken, the step test is not (and the closure runs once)."""
    model, x, y = _model_and_data()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    assert sgd_step_sizes(sgd, list(model.parameters())) == [0.01]
    assert sgd_step_sizes(adam, list(model.parameters())) is None
    assert sgd_step_sizes(sgd, [torch.nn.Parameter(torch.ones(1))]) is None
    for optimizer, returns, ahead in ((sgd, False, 4), (adam, True, 4), (sgd, True, None)):
        pairs = GradientPairs(list(model.parameters()), every_s=0.0, clock=lambda: 0.0,
                              optimizer=optimizer, steps_ahead=(lambda: ahead) if ahead else None)
        model.zero_grad()
        _loss(model, x[:32], y[:32]).backward()
        calls = []

        def second():
            calls.append(1)
            loss = _loss(model, x[32:64], y[32:64])
            loss.backward()
            return loss if returns else None

        assert pairs.probe(second)
        assert len(calls) == 1 and pairs.take_stride()[0] == 0 and pairs.take()[2] == 1
        assert pairs.adaptive == (optimizer is adam)   # (told to the server: no step test)


def test_probes_along_a_ring_trained_regression_read_a_gain_near_n_at_a_small_step():
    """A small step on a least-squares loss: 4 strides fall about 4 times as far as the ring's
    step per sample; at a step near the loss's stability limit (lr λmax about 2 / 4) the
    reading falls well below it."""
    readings = {}
    for lr in (0.002, 0.2):
        model, x, y = _model_and_data(seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        pairs = GradientPairs(list(model.parameters()), every_s=0.0, clock=lambda: 0.0,
                              optimizer=opt, steps_ahead=lambda: 4)
        gen = torch.Generator().manual_seed(7)
        test = StepTest(4)
        for i in range(40):
            a_idx, b_idx = (torch.randint(0, 2048, (32,), generator=gen) for _ in range(2))
            model.zero_grad()
            _loss(model, x[a_idx], y[a_idx]).backward()

            def second():
                loss = _loss(model, x[b_idx], y[b_idx])
                loss.backward()
                return loss

            assert pairs.probe(second)
            test.add(0.1 * i, i % 4, *pairs.take_stride())
        readings[lr] = test.estimate()
    small, large = readings[0.002], readings[0.2]
    assert small.gain == pytest.approx(4.0, abs=0.3), small
    assert large.gain is None or large.gain < 2.0, large


def _reports(test, count, p, a, q, start=0.0):
    for i in range(count):
        assert test.add(start + 0.1 * i, i % 4, 2, p, a, q)


def test_the_estimate_waits_for_enough_strides_keeps_its_best_reading_and_resets():
    """Before MIN_REPORTS reports and MIN_PAIRS strides there is no reading; a reading has a
    jackknife spread; bad reports are refused; ``kept`` holds the reading with the highest
    lower bound against later, lower ones (the late strides read low where the parameter
    server trains on: curvature module doc) until ``reset``."""
    test = StepTest(4, window_s=20.0)
    assert not test.add(0.0, 0, 0, 1.0, 1.0, 0.0) and not test.add(0.0, 0, 1, 1.0, -1.0, 0.0)
    assert not test.add(0.0, 0, 1, math.nan, 1.0, 0.0) and test.refused == 3
    _reports(test, MIN_REPORTS - 1, 0.01, 0.05, 0.001)
    assert test.estimate().gain is None and "needs" in test.estimate().note
    _reports(test, max(MIN_PAIRS // 2, 2), 0.01, 0.05, 0.001, start=1.0)
    early = test.kept()
    assert early.gain == pytest.approx(stride_gain(0.01, 0.05, 0.001, 4), rel=1e-9)
    assert early.sd is not None and early.sd >= 0.1 and "step test" in early.note
    _reports(test, 60, 0.01, 0.05, 0.05, start=25.0)       # the window moved on: all curvature
    assert test.estimate().gain is None or test.estimate().gain < 1.0
    kept = test.kept()
    assert kept.gain == early.gain and "kept from" in kept.note, kept.note
    test.reset()
    assert test.kept().gain is None and test.best is None


def test_a_gain_that_falls_within_the_window_is_read_from_its_later_strides():
    """The ranking asks about the strides to come: where the later half of the window's
    strides reads below the whole window by more than its spread, the estimate is the later
    half's, its spread widened by the drop, and the note says so; a steady or a rising gain
    keeps the window's reading (a straggler job's first ranking read 2.56 +- 0.37 from 21
    strides whose later half read 1.87, and the parameter server lost to the ring)."""
    steady, rising, falling = StepTest(4), StepTest(4), StepTest(4)
    _reports(steady, 24, 0.01, 0.05, 0.001)
    _reports(rising, 12, 0.01, 0.05, 0.006)
    _reports(rising, 12, 0.01, 0.05, 0.001, start=1.2)
    _reports(falling, 12, 0.01, 0.05, 0.001)
    _reports(falling, 12, 0.01, 0.05, 0.006, start=1.2)
    whole = stride_gain(0.24, 1.2, 0.084, 4)
    later = stride_gain(0.12, 0.6, 0.072, 4)
    assert later < whole - 0.5, (later, whole)
    for test, gain in ((steady, stride_gain(0.24, 1.2, 0.024, 4)), (rising, whole)):
        est = test.estimate()
        assert est.gain == pytest.approx(gain, rel=1e-9) and "falling" not in est.note
    est = falling.estimate()
    assert est.gain == pytest.approx(later, rel=1e-9), est
    assert est.sd >= whole - later and "falling: the later half" in est.note, est
    # The slope gone in the later half, the ring's own stride rising there: no reading
    # there, the ranking's floor, 0.
    gone = StepTest(4)
    _reports(gone, 12, 0.05, 0.1, 0.001)
    _reports(gone, 12, 0.002, 0.05, 0.02, start=1.2)
    assert stride_gain(0.024, 0.6, 0.24, 4) is None
    assert gone.estimate().gain == 0.0 and gone.estimate().lower < 0


def _equal_speeds(**kw):
    return Measurements(compute_s=(0.05,) * 4, aggregation_s=0.004, topologies=("ring", "ps"),
                        **kw)


def test_the_step_test_raises_the_ranked_gain_never_lowers_it_and_the_bracket_still_bounds():
    """The ranked gain: the step test's lower bound where it is above the noise scale's
    capped reading, ignored below it; the parameter server's measured progress still caps it.
    At equal speeds a step test of 3 +- 0.2 ranks SSP on the PS first where a noise scale
    of 1.0 alone ranks the ring's BSP first; its reason names the step test."""
    assert ranked_gain(1.0, 0.05, stride=3.0, stride_sd=0.2) == pytest.approx(2.8)
    assert ranked_gain(None, stride=0.5, stride_sd=0.1) == PS_FULL_UPDATE_GAIN
    assert ranked_gain(1.0, 0.05, 0.1, 0.6, stride=3.0, stride_sd=0.2) == pytest.approx(0.6)
    bsp, ssp = Candidate("bsp", "ring"), Candidate("ssp", "ps", (("staleness", 3),))
    noisy = rank_candidates(_equal_speeds(ps_gain=1.0, ps_gain_sd=0.05), [bsp, ssp])
    raised = rank_candidates(_equal_speeds(ps_gain=1.0, ps_gain_sd=0.05, ps_stride_gain=3.0,
                                           ps_stride_gain_sd=0.2), [bsp, ssp])
    assert noisy[0].candidate == bsp and raised[0].candidate == ssp, (noisy, raised)
    why = {r.candidate.label: r for r in raised}[ssp.label].reasons
    assert any("by the step test" in w and "ranked at x2.80" in w for w in why), why
    moved = _equal_speeds(ps_gain=1.0, ps_gain_sd=0.05, ps_stride_gain=3.0,
                          ps_stride_gain_sd=0.2).change_from(
        _equal_speeds(ps_gain=1.0, ps_gain_sd=0.05), 0.3)
    assert moved is not None and "0.95 -> 2.80" in moved, moved
    with pytest.raises(ValueError, match="ps_stride_gain"):
        _equal_speeds(ps_stride_gain=math.inf)


def test_the_server_policy_ranks_with_the_step_test_and_keeps_its_readings():
    """AutoPolicy (no MPI) fed strides: its measurements carry the step test's gain, the
    note says so, the metrics keep every reading; a change of learning rate forgets them."""
    from mpsync.config import SyncConfig
    from mpsync.server.policies import make_policy

    pol = make_policy(SyncConfig(policy="auto", auto_ps=False).validate(), 4)
    try:
        m = Measurements(compute_s=(0.05,) * 4)
        assert pol._with_gain(m, 0.0).ps_stride_gain is None
        for i in range(20):
            pol.on_stride(i % 4, 2, 0.02, 0.1, 0.001, 0.1 * i)
        m2 = pol._with_gain(m, 2.0)
        assert m2.ps_stride_gain == pytest.approx(stride_gain(0.4, 2.0, 0.02, 4), abs=1e-3)
        assert "step test" in m2.ps_gain_note, m2.ps_gain_note
        shown = pol.describe()
        assert shown["step_test"][-1]["pairs"] == 40
        assert len(shown["metrics"]["auto_step_test"]) == 2
        pol.on_learning_rate_change(0, 30, 3.0)
        assert pol._with_gain(m, 3.1).ps_stride_gain is None
    finally:
        if pol.ranker is not None:
            pol.ranker.close()


def test_a_scripts_probe_that_returns_its_loss_feeds_the_servers_step_test():
    """Two workers of a script's own loop (BSP on the ring, SGD with momentum), the probe's
    closure returning its loss: the server reads the step test from their strides, and the
    probes leave the replicas bitwise equal."""
    from mpi_harness import run_mpi

    run = run_mpi("auto_programs:stride_reports", np=3, timeout=120)
    res = run.results()
    assert sorted(res) == [1, 2], run.report()
    assert res[1]["digest"] == res[2]["digest"], res
    readings = res[1]["step_test"]
    assert readings and readings[-1]["pairs"] >= MIN_PAIRS, (readings, res[1]["steps"])
    assert readings[-1]["workers"] == 2 and "step test" in readings[-1]["note"], readings


def test_an_adaptive_optimizers_measured_gain_is_ranked_uncapped():
    """No step test (Adam): the noise scale's gain, at its lower bound, may raise the fitted
    constant; with stragglers 1,1,2,4 a measured 2.0 +- 0.1 then ranks ASP on the PS above
    ElasticBSP on the ring, where SGD's capped reading keeps the ring first, and the reason
    says why.  The measured progress still bounds it."""
    assert ranked_gain(2.0, 0.1) == PS_FULL_UPDATE_GAIN
    assert ranked_gain(2.0, 0.1, capped=False) == pytest.approx(1.9)
    assert ranked_gain(2.0, 0.1, 0.1, 0.6, capped=False) == pytest.approx(0.6)
    assert ranked_gain(None, capped=False) == PS_FULL_UPDATE_GAIN
    ebsp, asp = Candidate("ebsp", "ring"), Candidate("asp", "ps")

    def ranked(capped):
        m = Measurements(compute_s=(0.15, 0.15, 0.3, 0.6), aggregation_s=0.004,
                         topologies=("ring", "ps"), ps_gain=2.0, ps_gain_sd=0.1,
                         ps_gain_capped=capped)
        assert Measurements.from_dict(m.as_dict()) == m
        return rank_candidates(m, [ebsp, asp])

    sgd, adam = ranked(True), ranked(False)
    assert sgd[0].candidate == ebsp and adam[0].candidate == asp, (sgd, adam)
    why = {r.candidate.label: r for r in adam}[asp.label].reasons
    assert any("not capped" in w and "ranked at x1.90" in w for w in why), why


def test_the_server_hears_once_that_a_workers_optimizer_admits_no_step_test():
    """A STRIDE of no pairs: the worker's optimizer is not SGD; the measurements the policy
    ranks with are then uncapped, its note and state say so, and no stride is counted."""
    from mpsync.config import SyncConfig
    from mpsync.server.policies import make_policy

    pol = make_policy(SyncConfig(policy="auto", auto_ps=False).validate(), 4)
    try:
        m = Measurements(compute_s=(0.05,) * 4)
        assert pol._with_gain(m, 0.0).ps_gain_capped
        pol.on_stride(2, 0, 0.0, 0.0, 0.0, 0.5)
        m2 = pol._with_gain(m, 1.0)
        assert not m2.ps_gain_capped and "adaptive optimizer" in m2.ps_gain_note, m2
        assert m2.ps_stride_gain is None
        assert pol.describe()["adaptive_workers"] == [2]
    finally:
        if pol.ranker is not None:
            pol.ranker.close()


def test_a_script_with_adam_tells_the_server_it_has_no_step_test():
    """Two workers of a script's own loop with Adam, probing: each tells the server once,
    the step test has no reading, and the replicas stay bitwise equal."""
    from mpi_harness import run_mpi

    run = run_mpi("auto_programs:adaptive_reports", np=3, timeout=120)
    res = run.results()
    assert sorted(res) == [1, 2], run.report()
    assert res[1]["digest"] == res[2]["digest"], res
    assert res[1]["adaptive_workers"] == [0, 1], (res[1], res[1]["steps"])
    assert not any(r["pairs"] for r in res[1]["step_test"] or ()), res[1]["step_test"]


# A CNN's first ranking at lr 0.01 or 0.1 with stragglers 1,1,2,4 (bench/auto/README.md).
CNN_FIRST = dict(compute_s=(0.15, 0.15, 0.30, 0.60), topologies=("ring", "ps"), ps_gain=1.09,
                 ps_gain_sd=0.13)


def _ranked_once(first: Measurements):
    """A Decider on ElasticBSP after its first ranking, on ``first``."""
    from mpsync.auto import Decider

    d = Decider(Candidate("ebsp", "ring"))
    d.decide(rank_candidates(first), first, 1.8, d.wants_ranking(first))
    return d


def test_a_rise_of_the_kept_step_test_asks_for_a_ranking_at_once_a_noise_scale_rise_twice():
    """The step test's kept reading only rises (``StepTest.kept``): its rise is a change at
    the first check, where the noise scale's gain, which may fall back, needs ``confirm``
    checks as a compute time does.  (The CNN at lr 0.01: 1.91 +- 6.00 at the first ranking,
    2.99 +- 0.91 1.1 s later; the switch waited for the second check.)"""
    seen = CNN_FIRST
    first = Measurements(ps_stride_gain=1.91, ps_stride_gain_sd=6.0, **seen)
    d = _ranked_once(first)
    rose = Measurements(ps_stride_gain=2.99, ps_stride_gain_sd=0.91, **seen)
    trigger = d.wants_ranking(rose)
    assert trigger and "statistical efficiency" in trigger and "2.08" in trigger, trigger

    d = _ranked_once(first)
    noisy = Measurements(**{**seen, "ps_gain": 1.6, "ps_gain_sd": 0.1},
                         ps_gain_capped=False, ps_stride_gain=1.91, ps_stride_gain_sd=6.0)
    assert noisy.ranked_ps_gain() > first.ranked_ps_gain() + 0.1
    assert d.wants_ranking(noisy) is None
    assert "statistical efficiency" in d.wants_ranking(noisy)


def test_soon_after_a_ranking_only_what_needs_one_check_asks_again():
    """Within ``RANK_EVERY_S`` of a ranking the checks go on every ``CHECK_EVERY_S``, and
    a rise of the step test's kept reading asks at once (a CNN at lr 0.1 read 1.50 +- 63.6
    at its first ranking and waited 1 s for the next, where it read 2.97 +- 0.86); a change
    that needs two checks is neither asked for nor counted there."""
    seen = CNN_FIRST
    first = Measurements(ps_stride_gain=1.50, ps_stride_gain_sd=63.6, **seen)
    d = _ranked_once(first)
    rose = Measurements(ps_stride_gain=2.97, ps_stride_gain_sd=0.86, **seen)
    trigger = d.wants_ranking(rose, soon=True)
    assert trigger and "statistical efficiency" in trigger, trigger

    d = _ranked_once(first)
    slower = Measurements(**{**seen, "compute_s": (0.15, 0.15, 0.30, 1.20)},
                          ps_stride_gain=1.50, ps_stride_gain_sd=63.6)
    assert d.wants_ranking(slower, soon=True) is None
    assert d.wants_ranking(slower, soon=True) is None      # not counted: still no ranking
    assert d.wants_ranking(slower) is None                 # the first counted check
    assert "compute" in d.wants_ranking(slower)            # the second
