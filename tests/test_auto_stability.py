"""``auto``'s watch on the training loss (``mpsync.auto.stability``): a policy it switched to
that undoes the run's progress is left for the one it replaced and not chosen again; the noise
of minibatch losses, a run that has made no progress yet, and a phase that starts high after
an earlier divergence do not trip it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpsync.auto.decider import Decider
from mpsync.auto.ranking import Candidate, Ranked
from mpsync.auto.stability import LossWatch

from auto_ring_driver import RingDriver, ring_auto

STEP_S = 0.1          # one report every 0.1 s from each of 4 workers


def _feed(watch, start, stop, loss_at, rng, noise=0.3):
    """Reports from 4 workers every STEP_S over [start, stop); each a minibatch loss with a
    lognormal spread of ``noise``; returns the first reason check() gave, and when."""
    t = start
    while t < stop:
        for _ in range(4):
            watch.add(t, loss_at(t) * math.exp(rng.normal(0.0, noise)))
        t = round(t + STEP_S, 9)
        if abs(t * 2 - round(t * 2)) < 1e-9:        # the server checks every 0.5 s
            reason = watch.check(t)
            if reason is not None:
                return reason, t
    return None, None


def _converging(t):
    return 0.2 + 2.1 * math.exp(-t / 6.0)


@pytest.mark.parametrize("seed", range(5))
def test_noisy_converging_training_never_trips_it(seed):
    rng = np.random.default_rng(seed)
    watch = LossWatch()
    assert _feed(watch, 0.0, 4.0, _converging, rng) == (None, None)
    watch.begin(4.0, "ssp/ps")
    assert _feed(watch, 4.0, 60.0, _converging, rng) == (None, None)
    assert watch.initial == pytest.approx(2.1, rel=0.15)
    assert watch.lowest < 0.3


@pytest.mark.parametrize("seed", range(3))
def test_a_divergence_after_progress_trips_it_within_two_checks(seed):
    """The shape seen at equal speeds on the parameter server: converging, then within a
    second back at chance level."""
    rng = np.random.default_rng(seed)
    watch = LossWatch()
    _feed(watch, 0.0, 3.0, _converging, rng)
    watch.begin(3.0, "ssp/ps")
    assert _feed(watch, 3.0, 9.0, _converging, rng) == (None, None)
    reason, at = _feed(watch, 9.0, 20.0, lambda t: 2.3, rng)
    assert reason is not None and "ssp/ps" in reason and "undoing" in reason, reason
    assert at <= 10.5, at


@pytest.mark.parametrize("given_back, lasts, trips", [(0.4, 4.0, True), (0.4, 2.0, False),
                                                     (0.15, 4.0, False)])
def test_a_swing_that_gives_back_a_third_of_the_progress_for_seconds_trips_it(given_back, lasts,
                                                                            trips):
    """The other shape seen on the PS at equal speeds: no collapse to chance level, but a
    loss that swings back up for seconds at a time.  Giving back 40% of the progress (still
    below the phase's start) for 4 s trips it; for 2 s it is an overshoot the policy comes
    back from (``persist_s``); 15% (with the noise) does not."""
    rng = np.random.default_rng(4)
    watch = LossWatch()
    _feed(watch, 0.0, 3.0, _converging, rng)
    watch.begin(3.0, "ssp/ps")
    assert _feed(watch, 3.0, 12.0, _converging, rng) == (None, None)
    low = _converging(12.0)
    swung = low + given_back * (_converging(0.0) - low)
    assert swung < _converging(3.0)
    reason, at = _feed(watch, 12.0, 12.0 + lasts, lambda t: swung, rng)
    assert (reason is not None) == trips, (reason, at)
    if trips:
        assert at >= 12.0 + watch.persist_s and "below the" in reason, (reason, at)
    if not trips and given_back > 0.3:
        # Once it is back nothing fires; a second swing of the same phase is a swinging
        # policy, left on two checks.
        assert _feed(watch, 12.0 + lasts, 20.0, _converging, rng) == (None, None)
        reason, at = _feed(watch, 20.0, 23.0, lambda t: swung, rng)
        assert reason is not None and "second rise" in reason and at <= 21.5, (reason, at)


def _feed_slowly(watch, start, stop, loss_at, rng, step_s=1.4, noise=0.3):
    """As ``_feed``, but each of 4 workers reports once a step of ``step_s`` (a worker reports
    once a step at most), the workers a quarter of a step apart."""
    t = start
    while t < stop:
        for w in range(4):
            if abs(((t - w * step_s / 4) / step_s) % 1.0) < 1e-6 or \
                    abs(((t - w * step_s / 4) / step_s) % 1.0 - 1.0) < 1e-6:
                watch.add(t, loss_at(t) * math.exp(rng.normal(0.0, noise)))
        t = round(t + 0.05, 9)
        if abs(t * 2 - round(t * 2)) < 1e-9:
            reason = watch.check(t)
            if reason is not None:
                return reason, t
    return None, None


@pytest.mark.parametrize("seed", range(4))
def test_a_job_that_steps_slowly_is_watched_too(seed):
    """4 workers at 1.4 s a step send about 3 reports a second, fewer than a 1 s window's 6:
    the level widens to the last 6 reports.  A divergence trips it within 3 s, which the 1 s
    window alone (``max_window_s=1``) never saw; noisy convergence never trips it."""
    def diverging(t):
        return _converging(t) if t < 20.0 else 2.3

    reasons = []
    for watch in (LossWatch(), LossWatch(max_window_s=1.0)):
        rng = np.random.default_rng(seed)
        _feed_slowly(watch, 0.0, 4.0, _converging, rng)
        watch.begin(4.0, "ssp/ps")
        reasons.append(_feed_slowly(watch, 4.0, 30.0, diverging, rng))
    (reason, at), blind = reasons
    assert reason is not None and "ssp/ps" in reason and 20.0 < at <= 23.0, (reason, at)
    assert blind == (None, None)
    rng = np.random.default_rng(seed)
    watch = LossWatch()
    _feed_slowly(watch, 0.0, 4.0, _converging, rng)
    assert watch.initial == pytest.approx(2.1, rel=0.2)
    watch.begin(4.0, "ssp/ps")
    assert _feed_slowly(watch, 4.0, 60.0, _converging, rng) == (None, None)


def test_risen_says_when_the_loss_is_up_from_its_phases_lowest():
    """What a switch off the PS for another reason (a slower worker) reads to decide whether
    the ring restarts from a snapshot: the last second's mean more than 20% above the phase's
    lowest, or not finite."""
    rng = np.random.default_rng(5)
    watch = LossWatch()
    _feed(watch, 0.0, 3.0, _converging, rng)
    watch.begin(3.0, "ssp/ps")
    _feed(watch, 3.0, 10.0, _converging, rng)
    assert not watch.risen(10.0)
    _feed(watch, 10.0, 11.5, lambda t: 1.6 * _converging(10.0), rng)
    assert watch.risen(11.5)
    watch.add(11.55, float("inf"))
    assert watch.risen(11.6)
    assert not LossWatch().risen(0.0)


def test_no_progress_yet_means_nothing_to_undo():
    """A switch before the loss has moved (2.30 -> 2.28): a rise to 2.6 is not judged."""
    rng = np.random.default_rng(0)
    watch = LossWatch()
    _feed(watch, 0.0, 2.0, lambda t: 2.3, rng, noise=0.05)
    watch.begin(2.0, "asp/ps")
    assert _feed(watch, 2.0, 10.0, lambda t: 2.28 if t < 5 else 2.6, rng,
                 noise=0.05) == (None, None)


def test_a_non_finite_loss_trips_it_at_the_next_check():
    watch = LossWatch()
    rng = np.random.default_rng(1)
    _feed(watch, 0.0, 2.0, lambda t: 2.3, rng, noise=0.05)
    watch.begin(2.0, "asp/ps")
    watch.add(2.05, float("nan"))
    reason, at = _feed(watch, 2.1, 4.0, lambda t: 2.0, rng, noise=0.05)
    assert at == 2.5 and "not finite" in reason, (reason, at)


def test_a_phase_that_starts_high_is_judged_from_its_own_start():
    """After a divergence and the switch back, the loss is far above the run's lowest; the
    policy now running recovers from there and must not be blamed for the gap."""
    rng = np.random.default_rng(2)
    watch = LossWatch()
    _feed(watch, 0.0, 10.0, _converging, rng)
    _feed(watch, 10.0, 12.0, lambda t: 2.3, rng)          # diverged under another phase
    watch.begin(12.0, "ebsp/ring")
    assert _feed(watch, 12.0, 40.0, lambda t: 0.3 + 2.0 * math.exp(-(t - 12.0) / 5.0),
                 rng) == (None, None)


def test_the_settings_are_checked():
    with pytest.raises(ValueError, match="window_s"):
        LossWatch(window_s=0)
    with pytest.raises(ValueError, match="max_window_s"):
        LossWatch(window_s=2.0, max_window_s=1.0)


def _ranked(label_times):
    return [Ranked(candidate=c, predicted_time_to_target_s=t, samples_per_s=1.0,
                   efficiency=1.0, wait_fraction=0.0, reasons=(),
                   simulation_cpu_s=0.0) for c, t in label_times]


def test_the_decider_goes_back_and_readmits_an_unstable_candidate_only_on_a_new_cluster():
    """Diverged under the PS: back to the ring, the PS's full-update candidates ruled out
    while the cluster stays as it was (a new ranking for any other reason keeps them out);
    a worker's speed that changes re-admits them (the staleness they would run at is
    another), and the trigger says so; an aggregation that changed does not."""
    from mpsync.auto.measurements import Measurements

    ebsp, ssp, asp = Candidate("ebsp", "ring"), Candidate("ssp", "ps"), Candidate("asp", "ps")
    d = Decider(ebsp, confirm=1)
    m = Measurements(compute_s=(0.1,) * 4, aggregation_s=0.01)
    assert d.wants_ranking(m) == "first measurement"
    first = d.decide(_ranked([(ssp, 10.0), (asp, 11.0), (ebsp, 20.0)]), m, 1.0, "first")
    assert first.switch and d.current == ssp
    back = d.diverged(ebsp, "the training loss rose", 9.0, [ssp, asp], measured={"last": 2.3})
    assert back.switch and back.trigger == "training loss" and d.current == ebsp
    assert "asp/ps, ssp/ps" in back.reason and back.measurements == {"last": 2.3}
    assert "until the cluster changes" in back.reason
    # The same cluster, a slower aggregation: still out.
    slower_link = Measurements(compute_s=(0.1,) * 4, aggregation_s=0.05)
    trigger = d.wants_ranking(slower_link)
    assert trigger is not None and "aggregation" in trigger and "re-admitted" not in trigger
    same = d.decide(_ranked([(asp, 5.0), (ssp, 6.0), (ebsp, 20.0)]), slower_link, 30.0,
                    trigger)
    assert not same.switch and d.current == ebsp, same.reason
    # A worker 4x slower: re-admitted, and chosen where it ranks first.
    straggler = Measurements(compute_s=(0.1, 0.1, 0.1, 0.4), aggregation_s=0.05)
    trigger = d.wants_ranking(straggler)
    assert "re-admitted: asp/ps, ssp/ps" in trigger, trigger
    assert not d.unstable
    later = d.decide(_ranked([(ssp, 5.0), (asp, 6.0), (ebsp, 20.0)]), straggler, 40.0, trigger)
    assert later.switch and d.current == ssp, later.reason


def test_the_server_policy_does_not_judge_a_ring_policy_by_the_loss():
    """AutoPolicy as the state server runs it (no MPI: the calls on a virtual clock, the
    ranking in its real helper process; ring only): worker 3 slowing down makes it switch away
    from BSP; the workers' loss reports then jump back to the initial level, and it stays:
    the watch guards the PS's full updates only (a ring policy after them inherits their
    weights; going back to the PS for that, and ruling the ring out, once cost a run 40 s).
    Leaving a diverging PS is tests/test_auto_switch.py's."""
    diverged = False
    pol = ring_auto()
    driver = RingDriver(pol, lambda now, _: 2.3 if diverged else _converging(now))
    run = driver.run

    try:
        assert run([0.05] * 4, lambda: len(pol.decider.records) >= 1, 60.0), pol.problems
        slowed = [0.05, 0.05, 0.05, 0.2]
        assert run(slowed, lambda: pol.switch_after is not None, 60.0), pol.problems
        chosen = pol.decider.records[-1].chosen
        assert run(slowed, lambda: pol.switch_after is None, 10.0)
        assert pol.running_candidate.label == chosen
        run(slowed, lambda: False, 2.0)
        assert not any(r.trigger == "training loss" for r in pol.decider.records)
        diverged = True
        assert not run(slowed, lambda: pol.decider.records[-1].trigger == "training loss", 5.0), \
            [r.as_dict() for r in pol.decider.records]
        # The rise was seen (the watch measured it), and nothing was done about it.
        assert pol.losses.check(driver.now) is not None
        assert pol.running_candidate.label == chosen and pol.switch_after is None
        assert not pol.decider.unstable
        assert pol.describe()["training_loss"]["reports"] > 100
    finally:
        pol.ranker.close()


def test_a_scripts_report_loss_reaches_the_servers_loss_watch():
    """``opt.report_loss`` in a user's own loop (not ``mpsync train``) feeds auto's loss watch
    on the server, about every 0.1 s per worker, and ``opt.probe_gradient_noise`` its
    estimate of the job's gradient noise (a probe per second per worker); a loss of several
    numbers, or epoch 0, is refused with a message naming it."""
    from mpi_harness import run_mpi

    run = run_mpi("auto_programs:loss_reports", np=3, timeout=120)
    res = run.results()
    assert sorted(res) == [1, 2], run.report()   # (world rank 0 is the server)
    for r in res.values():
        assert any("one number" in m for m in r["refused"]) and \
            any("1-based" in m for m in r["refused"]), r["refused"]
    watch = res[1]["training_loss"]
    # Two workers for 1.5 s and 8 reports each at least, at most one report per 0.1 s each:
    # about 14 each on an idle machine.  The server counted at most what both sent, and most
    # of it: a report needs no reply, so the last ones may still be on their way when worker
    # 1's stats request is answered.
    sent = {r: res[r]["sent"] for r in res}
    assert all(8 <= n for n in sent.values()), (sent, res[1]["steps"])
    assert all(n <= 2 + 10 * res[r]["seconds"] for r, n in sent.items()), res
    assert (sent[1] + sent[2]) // 2 <= watch["reports"] <= sent[1] + sent[2], (watch, sent)
    noise = res[1]["gradient_noise"]
    # (one probe per second per worker at most, the first at the first step, after the first
    # FIRST_PROBES every FIRST_EVERY_S)
    from mpsync.torch.strategies.gradient_pairs import FIRST_PROBES

    most = sum(1 + FIRST_PROBES + res[r]["seconds"] for r in res)
    assert 3 <= noise["pairs"] <= most and noise["workers"] == 2, (noise, most)
    assert 1.0 <= noise["gain"] <= 2.0 and "gradient pairs" in noise["note"], noise
    assert watch["initial"] is not None and 1.0 < watch["initial"] < 4.0, watch
    # The learning rate cut 10x at step 5 on both workers: each told the server at its next
    # report, and the server took both as one change.
    changes = res[1]["rate_changes"]
    assert len(changes) == 1 and changes[0]["worker"] in (0, 1), changes


def test_the_levels_it_judged_are_kept_for_the_run_s_metrics():
    rng = np.random.default_rng(0)
    watch = LossWatch()
    _feed(watch, 0.0, 3.0, _converging, rng)
    watch.begin(3.0, "ssp/ps")
    reason, at = _feed(watch, 3.0, 12.0, lambda t: _converging(t) if t < 9.0 else 2.3, rng)
    series = watch.series()
    times = [t for t, _, _ in series]
    assert times == sorted(times) and all(b - a >= LossWatch.SERIES_EVERY_S - 1e-9
                                          for a, b in zip(times, times[1:]))
    assert series[0][2] is None and series[-1][2] is not None   # a reference once in a phase
    # the last level kept is the one that tripped it, above its reference
    assert reason is not None and series[-1][1] > 1.2 * series[-1][2], (reason, series[-1])
    assert len(series) <= LossWatch.SERIES_MAX
