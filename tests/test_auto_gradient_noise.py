"""``auto``'s statistical efficiency measured in the run: the gradient noise scale from
two batches' gradients at the same weights (mpsync.torch.strategies.gradient_pairs on the worker,
mpsync.auto.noise on the server), the full-update gain it implies, the fitted constant as
its prior, and the ranking and the decision log reading it.  The live path (real ranks, a
script's loop) is tests/test_auto_stability.py's loss-report test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpsync.auto import Candidate, Measurements
from mpsync.auto.efficiency import PS_FULL_UPDATE_GAIN
from mpsync.auto.noise import MIN_PAIRS, MIN_REPORTS, PRIOR_SD, GradientNoise, gain_from_ratio
from mpsync.auto.ranking import rank_candidates
from mpsync.torch.strategies.gradient_pairs import GradientPairs


def test_the_gain_runs_from_1_for_noisy_gradients_to_n_for_exact_ones():
    """(φ + n) / (φ + 1): averaging n gradients loses nothing where one worker's batch is
    far below the noise scale, everything (n times the steps) where there is no noise."""
    assert gain_from_ratio(1e9, 4) == pytest.approx(1.0, abs=1e-8)
    assert gain_from_ratio(math.inf, 4) == 1.0
    assert gain_from_ratio(0.0, 4) == 4.0
    assert gain_from_ratio(1.0, 4) == pytest.approx(2.5)
    assert gain_from_ratio(3.0, 1) == 1.0                  # one worker: nothing averaged
    # The fitted 1.22 at 4 workers is a noise scale of about 12.6 batches.
    assert gain_from_ratio(12.6, 4) == pytest.approx(PS_FULL_UPDATE_GAIN, abs=0.005)


def _pairs(rng, true_g, sigma, b, count):
    """``count`` pairs of minibatch gradients of ``b`` samples: the true gradient plus the mean
    of b per-sample deviations of standard deviation ``sigma`` per coordinate; summed as a
    worker reports them."""
    d = true_g.size
    noise = signal = 0.0
    for _ in range(count):
        g1 = true_g + rng.normal(0.0, sigma / math.sqrt(b), d)
        g2 = true_g + rng.normal(0.0, sigma / math.sqrt(b), d)
        noise += 0.5 * float(np.sum((g1 - g2) ** 2))
        signal += float(g1 @ g2)
    return noise, signal


def test_the_measured_noise_scale_recovers_a_known_one_and_overrides_the_prior():
    """Gradients with a known noise scale (tr Σ / |G|² = d σ² / |G|²): before MIN_REPORTS
    reports the estimate is the prior alone; with 40 reports of 5 pairs from 4 workers the
    measured ratio is within 15% of the truth, its gain close to the true one, and the
    combined gain follows the measurement (its spread far below the prior's)."""
    rng = np.random.default_rng(11)
    d, b, sigma = 200, 8, 1.0
    true_g = rng.normal(0.0, 0.1, d)
    phi_true = d * sigma ** 2 / (b * float(true_g @ true_g))
    est = GradientNoise(4)
    for i in range(MIN_REPORTS - 1):
        est.add(0.1 * i, i % 4, *_pairs(rng, true_g, sigma, b, 5), 5)
    early = est.estimate(0.5)
    assert early.measured is None and early.gain == PS_FULL_UPDATE_GAIN and \
        early.sd == PRIOR_SD, early
    assert "prior" in early.note and f"needs {MIN_PAIRS}" in early.note, early.note
    for i in range(MIN_REPORTS - 1, 40):
        est.add(0.1 * i, i % 4, *_pairs(rng, true_g, sigma, b, 5), 5)
    late = est.estimate(4.0)
    assert late.ratio == pytest.approx(phi_true, rel=0.15), (late, phi_true)
    assert late.measured == pytest.approx(gain_from_ratio(phi_true, 4), abs=0.1), late
    assert late.measured_sd < PRIOR_SD / 3, late
    assert abs(late.gain - late.measured) < abs(PS_FULL_UPDATE_GAIN - late.measured) / 2, late
    assert late.workers == 4 and late.pairs == 200 and "gradient noise scale" in late.note


def test_reports_older_than_the_window_and_bad_reports_are_left_out():
    est = GradientNoise(2, window_s=5.0)
    assert not est.add(0.0, 0, float("nan"), 1.0, 3)
    assert not est.add(0.0, 0, 1.0, 1.0, 0)
    assert not est.add(0.0, 0, -1.0, 1.0, 2)
    assert est.refused == 3
    for i in range(10):
        est.add(float(i), 0, 1.0, 1.0, 2)      # φ = 1
    assert est.estimate(9.0).reports == 6      # t = 4..9 within 5 s of 9
    assert est.estimate(9.0).ratio == pytest.approx(1.0)
    # Gradients whose common part is lost in their noise (g1 · g2 <= 0): no gain.
    lost = GradientNoise(4)
    for i in range(10):
        lost.add(float(i), i % 4, 5.0, -0.1, 2)
    assert lost.estimate(9.0).measured == 1.0 and math.isinf(lost.estimate(9.0).ratio)


def _model_and_data(seed=0, n=4096, d=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.randn(d, generator=g) + 0.5 * torch.randn(n, generator=g)
    model = torch.nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model, x, y


def _grad_of(model, x, y):
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()


def test_a_probe_sums_the_dot_and_half_squared_difference_and_puts_the_step_back():
    """A probe: exactly g1 · g2 and ½|g1 - g2|² of the step's batch and the closure's, at the
    same weights; the step's gradients are back in place afterwards (the same tensors);
    nothing runs before ``every_s`` has passed on its clock, nor without gradients."""
    model, x, y = _model_and_data()
    with torch.no_grad():
        model.weight.fill_(0.2)
    clock = [0.0]
    pairs = GradientPairs(list(model.parameters()), every_s=1.0, clock=lambda: clock[0])
    _grad_of(model, x[32:64], y[32:64])
    g2 = model.weight.grad.detach().clone().reshape(-1)
    _grad_of(model, x[:32], y[:32])
    grad_tensor = model.weight.grad
    g1 = grad_tensor.detach().clone().reshape(-1)

    def second():
        torch.nn.functional.mse_loss(model(x[32:64]).squeeze(1), y[32:64]).backward()

    assert pairs.probe(second)
    assert model.weight.grad is grad_tensor and torch.equal(grad_tensor.reshape(-1), g1)
    noise, signal, count = pairs.take()
    assert count == 1
    assert signal == pytest.approx(float(g1 @ g2), rel=1e-5)
    assert noise == pytest.approx(0.5 * float((g1 - g2) @ (g1 - g2)), rel=1e-5)
    assert pairs.take() == (0.0, 0.0, 0)
    ran = []
    assert not pairs.probe(lambda: ran.append(1))           # clock 0 < next (1.0)
    clock[0] = 2.0
    model.weight.grad = None
    assert not pairs.probe(lambda: ran.append(1)) and not ran   # no gradient to pair
    assert pairs.take()[2] == 0


def test_probes_take_at_most_their_share_of_the_workers_time():
    """A cheap probe comes at its period; a costly one waits until its time is at most the
    share (``FIRST_PROBE_SHARE`` for the first ``FIRST_PROBES``, ``PROBE_SHARE`` after): a
    probe of 0.2 s at a 0.1 share is followed by 1.8 s without one, whatever the period."""
    from mpsync.torch.strategies import gradient_pairs as gp

    model, x, y = _model_and_data()
    clock = [0.0]
    pairs = GradientPairs(list(model.parameters()), every_s=1.0, clock=lambda: clock[0])
    cost = [0.0]

    def second():
        clock[0] += cost[0]
        torch.nn.functional.mse_loss(model(x[32:64]).squeeze(1), y[32:64]).backward()

    def next_probe_after(at: float, seconds: float) -> None:
        """A probe at ``at`` (its cost on the clock), and the next one due ``seconds`` after
        its end: not a moment before."""
        clock[0] = at
        _grad_of(model, x[:32], y[:32])
        assert pairs.probe(second)
        end = clock[0]
        clock[0] = end + seconds - 0.002
        assert not pairs.probe(lambda: None)
        clock[0] = end + seconds + 0.002
        assert pairs.probe(lambda: None)

    next_probe_after(0.0, gp.FIRST_EVERY_S)
    cost[0] = 0.2
    share = gp.FIRST_PROBE_SHARE
    next_probe_after(1.0, 0.2 * (1 - share) / share)
    pairs.probes = gp.FIRST_PROBES
    next_probe_after(clock[0] + 2.0, 0.2 * (1 - gp.PROBE_SHARE) / gp.PROBE_SHARE)
    cost[0] = 0.0
    next_probe_after(clock[0] + 2.0, 1.0)


def test_probes_of_a_real_model_measure_its_noise_scale():
    """A linear regression: the ratio from 300 probes of batch-32 gradients (each pair at
    the same weights) is within 20% of tr(Σ) / (b |G|²) computed from every sample's
    gradient."""
    model, x, y = _model_and_data(seed=1)
    with torch.no_grad():
        model.weight.fill_(0.3)
    # Per-sample gradients of the mean-squared error: 2 (w·x - y) x.
    residual = (x @ model.weight.detach().reshape(-1) - y)
    per_sample = 2.0 * residual[:, None] * x
    true_g = per_sample.mean(0)
    trace = float(per_sample.var(0, unbiased=False).sum())
    b = 32
    phi_true = trace / (b * float(true_g @ true_g))
    pairs = GradientPairs(list(model.parameters()), every_s=0.0, clock=lambda: 0.0)
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        idx = torch.randint(0, x.shape[0], (b,), generator=gen)
        _grad_of(model, x[idx], y[idx])
        other = torch.randint(0, x.shape[0], (b,), generator=gen)
        assert pairs.probe(lambda: torch.nn.functional.mse_loss(
            model(x[other]).squeeze(1), y[other]).backward())
    noise, signal, count = pairs.take()
    assert count == 300
    assert noise / signal == pytest.approx(phi_true, rel=0.2), (noise / signal, phi_true)


def _equal_speeds(**kw):
    return Measurements(compute_s=(0.05,) * 4, aggregation_s=0.004, topologies=("ring", "ps"),
                        **kw)


def test_the_ranking_reads_the_measured_gain_and_a_moved_gain_is_a_change():
    """The PS's full-update candidates' efficiency is the job's measured gain where there is
    one, ranked one standard deviation below its estimate and never above the fitted constant
    (the measurement is an upper bound; the ring's efficiency is untouched): at equal speeds
    a gain of 1 (noisy gradients) ranks the ring's BSP ahead of SSP on the PS, a gain of 3
    ranks as the fitted 1.22 (SSP first), a gain of 1.3 +- 0.4 the ring (the PS must win on
    what the measurement vouches for); the reason says measured; a gain moved beyond its
    error is a change that asks for a new ranking."""
    bsp, ssp = Candidate("bsp", "ring"), Candidate("ssp", "ps", (("staleness", 3),))
    low = rank_candidates(_equal_speeds(ps_gain=1.0, ps_gain_sd=0.05), [bsp, ssp])
    high = rank_candidates(_equal_speeds(ps_gain=3.0, ps_gain_sd=0.05), [bsp, ssp])
    prior = rank_candidates(_equal_speeds(), [bsp, ssp])
    eff = {r.candidate.label: r.efficiency for r in low}
    assert eff[ssp.label] == pytest.approx(0.95, abs=0.03) and eff[bsp.label] == 1.0
    assert low[0].candidate == bsp and high[0].candidate == ssp, (low, high)
    by_label = {r.candidate.label: r for r in high}
    fitted = {r.candidate.label: r for r in prior}
    assert by_label[ssp.label].efficiency == pytest.approx(fitted[ssp.label].efficiency)
    assert any("measured in the run" in why and "ranked at x1.22" in why
               for why in by_label[ssp.label].reasons), by_label[ssp.label].reasons
    unsure = rank_candidates(_equal_speeds(ps_gain=1.3, ps_gain_sd=0.4), [bsp, ssp])
    sure = rank_candidates(_equal_speeds(ps_gain=1.3, ps_gain_sd=0.02), [bsp, ssp])
    assert unsure[0].candidate == bsp and sure[0].candidate == ssp, (unsure, sure)
    assert any("fitted" in why for r in prior for why in r.reasons if "in full" in why)
    # (as ranked: 1.22 before a measurement, min(gain - sd, 1.22) after)
    assert _equal_speeds(ps_gain=1.6, ps_gain_sd=0.2).change_from(_equal_speeds(), 0.3) is None
    first = _equal_speeds(ps_gain=1.0, ps_gain_sd=0.05,
                          ps_gain_note="measured 1.00").change_from(_equal_speeds(), 0.3)
    assert first is not None and "as ranked 1.22 -> 0.95 (measured 1.00)" in first, first
    before = _equal_speeds(ps_gain=1.2, ps_gain_sd=0.03)
    assert _equal_speeds(ps_gain=1.25, ps_gain_sd=0.03).change_from(before, 0.3) is None
    moved = _equal_speeds(ps_gain=0.9, ps_gain_sd=0.03).change_from(before, 0.3)
    assert moved is not None and "statistical efficiency" in moved and "1.17 -> 0.87" in moved
    ring_only = Measurements(compute_s=(0.05,) * 4, topologies=("ring",), ps_gain=0.9)
    assert ring_only.change_from(Measurements(compute_s=(0.05,) * 4, topologies=("ring",)),
                                 0.3) is None
    with pytest.raises(ValueError, match="ps_gain"):
        _equal_speeds(ps_gain=float("nan"))


def test_the_server_policy_puts_the_measured_gain_in_its_measurements_and_log():
    """AutoPolicy (no MPI) fed the workers' gradient pairs: the measurements it ranks on
    carry the job's gain and a note saying what it rests on; describe() and the metrics show
    the estimate."""
    from mpsync.config import SyncConfig
    from mpsync.server.policies import make_policy

    pol = make_policy(SyncConfig(policy="auto", auto_ps=False).validate(), 4)
    try:
        m = Measurements(compute_s=(0.05,) * 4)
        assert pol._with_gain(m, 0.0).ps_gain is None
        assert "prior" in pol._with_gain(m, 0.0).ps_gain_note
        for i in range(20):
            pol.on_gradient_noise(i % 4, 3.0, 1.0, 2, 0.1 * i)      # φ = 3: gain 7 / 4
        m2 = pol._with_gain(m, 2.0)
        assert m2.ps_gain is not None and 1.0 < m2.ps_gain < 1.75, m2
        assert "B_noise / batch = 3.00" in m2.ps_gain_note, m2.ps_gain_note
        assert m2.as_dict()["ps_gain"] == m2.ps_gain      # (what a decision record keeps)
        shown = pol.describe()
        assert shown["gradient_noise"]["pairs"] == 40
        assert shown["metrics"]["auto_gradient_noise"]["measured"] == pytest.approx(1.75)
    finally:
        if pol.ranker is not None:
            pol.ranker.close()


def test_the_first_decision_tries_the_ps_within_the_uncertainty_only_once_measured():
    """At the first decision a candidate predicted a little faster (within the model's
    uncertainty) is tried; on the parameter server only once the job has measured its gain
    (before that the fitted constant's error is a divergence, not a few %)."""
    from mpsync.auto import Decider
    from mpsync.auto.ranking import Ranked

    ebsp, ssp = Candidate("ebsp", "ring"), Candidate("ssp", "ps", (("staleness", 3),))
    ranked = [Ranked(c, t, 1000.0, 1.0, 0.0, (), 0.0) for c, t in ((ssp, 10.0), (ebsp, 10.5))]
    unmeasured = Decider(ebsp, explore=True)
    record = unmeasured.decide(ranked, _equal_speeds(), 1.0, "first measurement")
    assert not record.switch and "not yet measured" in record.reason, record.reason
    # Nothing changes in the cluster, but the gain gets measured: it ranks again and tries.
    assert unmeasured.wants_ranking(_equal_speeds()) is None
    later = _equal_speeds(ps_gain=1.3, ps_gain_sd=0.1)
    trigger = unmeasured.wants_ranking(later)
    assert trigger and "gain first measured" in trigger, trigger
    record = unmeasured.decide(ranked, later, 3.0, trigger)
    assert record.switch and unmeasured.current == ssp, record.reason
    assert unmeasured.wants_ranking(later) is None and not unmeasured.explore
    # A change of the cluster before any gain is measured: an ordinary decision, no try.
    waiting = Decider(ebsp, explore=True)
    waiting.decide(ranked, _equal_speeds(), 1.0, "first measurement")
    slower = Measurements(compute_s=(0.05, 0.05, 0.05, 0.2), aggregation_s=0.004,
                          topologies=("ring", "ps"))
    trigger = None
    for _ in range(waiting.confirm + 1):
        trigger = trigger or waiting.wants_ranking(slower)
    assert trigger and "cluster changed" in trigger and not waiting.explore, trigger
    measured = Decider(ebsp, explore=True)
    record = measured.decide(ranked, _equal_speeds(ps_gain=1.3, ps_gain_sd=0.1), 1.0,
                             "first measurement")
    assert record.switch and measured.current == ssp, record.reason
