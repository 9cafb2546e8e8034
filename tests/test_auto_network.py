"""``auto`` before the run has timed the network: a move from the ring to the parameter server
waits for the first timed aggregation, unless it holds on a slow link (mpsync.auto)."""

from __future__ import annotations

import time

from mpsync.auto import Candidate, Decider, Measurements, default_candidates, rank_candidates
from mpsync.auto.measurements import SLOW_LINK

LIVE = default_candidates(("ring", "ps"), switchable_only=True)   # with auto_ps
EBSP = Candidate("ebsp", "ring")
# The first ranking of a run of the digits CNN at lr 0.01 with momentum 0.9, stragglers
# 1,1,2,4 at 0.15 s (bench/auto/README.md): ElasticBSP's first barrier had not come, the step
# test read 2.66 +- 0.71.
CNN_LR_001 = dict(compute_s=(0.15, 0.15, 0.30, 0.60), jitter=0.0002, topologies=("ring", "ps"),
                  model_bytes=150e3, ps_gain=1.258, ps_gain_sd=0.144, ps_stride_gain=2.66,
                  ps_stride_gain_sd=0.71)
# The wide MLP's first ranking behind 100 Mbit/s links (the run below), its 8.7 MB model.
WIDE_MLP_100M = dict(compute_s=(0.10, 0.16, 0.22, 0.40), jitter=0.14, topologies=("ring", "ps"),
                     model_bytes=8_704_040.0, ps_gain=1.5, ps_gain_sd=0.12,
                     ps_stride_gain=1.89, ps_stride_gain_sd=0.43)


def _labels(ranked, k=3):
    return [(r.candidate.label, round(r.predicted_time_to_target_s, 1)) for r in ranked[:k]]


def test_no_move_to_the_parameter_server_before_the_run_has_timed_an_aggregation():
    """At 100 Mbit/s the first ranking (no aggregation timed yet: the link assumed at
    10 Gbit/s) once put ASP on the PS ahead and switched; measured 64-76% slower.  Now it
    stays, ranks again at the first timed aggregation, and decides on the link as it is."""
    ebsp = Candidate("ebsp", "ring")
    # That run's first ranking (its 1,1,2,4 workers at 0.1 s; the noise scale's gain, and the
    # step test's first reading, which raised it)
    seen = dict(compute_s=(0.10, 0.16, 0.22, 0.40), jitter=0.14, topologies=("ring", "ps"),
                ps_gain=1.5, ps_gain_sd=0.12, ps_stride_gain=1.89, ps_stride_gain_sd=0.43)
    assumed = Measurements(**seen)
    ranked = rank_candidates(assumed, LIVE)
    assert ranked[0].candidate.topology == "ps", [r.candidate.label for r in ranked[:3]]
    d = Decider(ebsp, explore=True)
    assert d.wants_ranking(assumed) == "first measurement"
    stay = d.decide(ranked, assumed, 1.1, "first measurement")
    assert not stay.switch and "no aggregation timed" in stay.reason, stay.reason
    assert d.wants_ranking(assumed) is None          # still nothing timed: no new ranking
    # The first ElasticBSP barrier, timed on the slow link
    timed = Measurements(aggregation_s=0.05, **seen)
    trigger = d.wants_ranking(timed)
    assert trigger and "first aggregation timed" in trigger, trigger
    ranked = rank_candidates(timed, LIVE)
    record = d.decide(ranked, timed, 2.4, trigger)
    assert not record.switch and record.chosen == "ebsp/ring", (record.reason, [
        (r.candidate.label, round(r.predicted_time_to_target_s, 1)) for r in ranked[:3]])
    # On a fast link the same gain moves to the PS once the aggregation is timed.
    d = Decider(ebsp, explore=True)
    d.decide(rank_candidates(assumed, LIVE), assumed, 1.1, "first measurement")
    fast = Measurements(aggregation_s=0.002, **seen)
    trigger = d.wants_ranking(fast)
    record = d.decide(rank_candidates(fast, LIVE), fast, 2.4, trigger)
    assert record.switch and record.chosen.endswith("/ps"), record.reason


def test_a_clear_gain_that_holds_on_a_slow_link_moves_to_the_ps_without_waiting():
    """The CNN at lr 0.01 waited 1.1 s for ElasticBSP's first barrier to move to ASP, whose
    full updates made 3x the progress per sample; ranked on a 100 Mbit/s link the move still
    wins by 10% or more, so it is made at once.  The wide MLP's 8.7 MB do not: it stays, and
    the first timed aggregation still asks for a ranking."""
    assumed = Measurements(**CNN_LR_001)
    d = Decider(EBSP, explore=True)
    stay = d.decide(rank_candidates(assumed, LIVE), assumed, 2.2, d.wants_ranking(assumed))
    assert not stay.switch and d.wants_slow_link, stay.reason
    slow = assumed.on_slow_link()
    assert (slow.bandwidth, slow.latency) == SLOW_LINK and slow.aggregation_s is None
    ranked = rank_candidates(slow, LIVE)
    moved = d.decide_on_slow_link(ranked, slow, 2.5)
    assert moved.switch and moved.chosen == "asp/ps", (moved.reason, _labels(ranked))
    assert "slow link" in moved.trigger and "even on an assumed slow link" in moved.reason
    assert d.current.label == "asp/ps" and not d.wants_slow_link
    assert d.wants_ranking(Measurements(aggregation_s=0.005, **CNN_LR_001)) is None

    wide = Measurements(**WIDE_MLP_100M)
    d = Decider(EBSP, explore=True)
    ranked = rank_candidates(wide, LIVE)
    assert ranked[0].candidate.topology == "ps", _labels(ranked)   # (on the assumed 10 Gbit/s)
    d.decide(ranked, wide, 1.1, d.wants_ranking(wide))
    assert d.wants_slow_link
    ranked = rank_candidates(wide.on_slow_link(), LIVE)
    held = d.decide_on_slow_link(ranked, wide.on_slow_link(), 1.4)
    assert not held.switch and held.chosen == "ebsp/ring", (held.reason, _labels(ranked))
    assert "rank again once an aggregation is timed" in held.reason
    trigger = d.wants_ranking(Measurements(aggregation_s=1.2, **WIDE_MLP_100M))
    assert trigger and "first aggregation timed" in trigger, trigger


def test_a_gain_within_the_models_uncertainty_is_not_ranked_on_a_slow_link():
    """A try of the PS within the model's uncertainty (a 2-10% edge) waits for the timed
    aggregation as before: on an assumed link only a clear gain may move."""
    tie = Measurements(compute_s=(0.4, 0.4, 0.4, 0.41), topologies=("ring", "ps"))
    ranked = rank_candidates(tie, LIVE)
    here = next(r for r in ranked if r.candidate == EBSP)
    edge = here.predicted_time_to_target_s / ranked[0].predicted_time_to_target_s - 1.0
    d = Decider(EBSP, explore=True)
    record = d.decide(ranked, tie, 1.5, d.wants_ranking(tie))
    assert not record.switch and "no aggregation timed" in record.reason, record.reason
    assert d.wants_slow_link == (edge >= d.min_gain), (edge, _labels(ranked))


def test_the_server_policy_ranks_a_held_move_on_a_slow_link_in_its_helper_and_switches():
    """AutoPolicy as the state server runs it, its rankings in the real helper process: the
    first ranking holds the move for want of a timed aggregation, the second (on the slow
    link) is asked at once and schedules the switch at ElasticBSP's next barrier."""
    from mpsync.config import SyncConfig
    from mpsync.server.policies import make_policy

    pol = make_policy(SyncConfig(policy="auto").validate(), 4)
    if pol.ring_only:
        raise AssertionError(f"auto has no parameter server here: {pol.ring_only}")
    pol.warm_up()
    pol.t0 = pol.stride.origin = 0.0
    try:
        pol._ask(Measurements(**CNN_LR_001), "first measurement", 2.2)
        deadline = time.monotonic() + 120
        while len(pol.decider.records) < 2 and time.monotonic() < deadline:
            pol._think(2.3)
            time.sleep(0.02)
        assert len(pol.decider.records) >= 2, pol.problems
        first, second = pol.decider.records[-2:]
        assert first.trigger == "first measurement" and not first.switch, first.reason
        assert "slow link" in second.trigger and second.switch, second.reason
        assert second.chosen == "asp/ps" and pol.switch_after == pol.sync_sent + 1
        assert second.measurements["bandwidth"] == SLOW_LINK[0]
        assert second.extra["answered_after_s"] >= 0
    finally:
        pol.ranker.close()


def test_the_server_policy_checks_again_half_a_ranking_after_one_on_the_ring():
    """After a ranking that kept the ring, the next check comes ``CHECK_EVERY_S`` later (a
    step test's rise asks there at once), and the one after it a ranking's length after the
    ranking, where it was before: a change that needs two checks is not put off by it."""
    from mpsync.auto.serving import CHECK_EVERY_S, RANK_EVERY_S
    from mpsync.config import SyncConfig
    from mpsync.server.policies import make_policy

    pol = make_policy(SyncConfig(policy="auto").validate(), 4)
    pol.warm_up()
    pol.t0 = pol.stride.origin = 0.0
    for w, seconds in enumerate((0.15, 0.15, 0.30, 0.60)):
        for _ in range(3):
            pol.window.add_compute(w, seconds)
    try:
        deadline = time.monotonic() + 120
        while pol.asked is not None and time.monotonic() < deadline:   # the warm-up's
            pol._think(0.5)
            time.sleep(0.02)
        first = 1.9
        pol._think(first)
        assert pol.asked is not None and pol.asked[0] == "first measurement", pol.asked
        deadline = time.monotonic() + 120
        while pol.asked is not None and time.monotonic() < deadline:
            pol._think(first + 0.01)
            time.sleep(0.02)
        assert pol.decider.records and pol.switch_after is None, \
            [(r.trigger, r.chosen, r.reason) for r in pol.decider.records]
        checked = len(pol.stride_series)
        pol._think(first + CHECK_EVERY_S - 0.01)
        assert len(pol.stride_series) == checked             # not yet
        pol._think(first + CHECK_EVERY_S + 0.1)
        assert len(pol.stride_series) == checked + 1         # the check soon after
        assert pol.next_check == first + RANK_EVERY_S
        pol._think(first + RANK_EVERY_S)
        assert len(pol.stride_series) == checked + 2
    finally:
        pol.ranker.close()


def test_on_the_ps_the_aggregation_the_last_ranking_used_stands():
    """On the PS the window times no ring aggregation, so its median is what the ring's last
    rounds left in it: a round timed after the ranking that moved the run (4.6 ms, then
    14.8) read as "aggregation 4.6 -> 9.7 ms/round" there and ranked again.  On the ring the
    same two timings are a change."""
    from mpsync.config import SyncConfig
    from mpsync.policies import auto_code
    from mpsync.server.policies import make_policy

    def policy_after_a_ranking(running):
        pol = make_policy(SyncConfig(policy="auto").validate(), 4)
        pol.t0 = pol.stride.origin = 0.0
        for w, seconds in enumerate((0.15, 0.15, 0.30, 0.60)):
            for _ in range(3):
                pol.window.add_compute(w, seconds)
        pol.window.add_aggregation(0.0046)
        m = pol._live_measurements(2.0)
        pol.decider.decide(rank_candidates(m), m, 2.0, pol.decider.wants_ranking(m))
        pol.window.add_aggregation(0.0148)    # a round after the ranking
        pol.code = auto_code(*running)
        return pol

    pol = policy_after_a_ranking(("asp", "ps"))
    later = pol._live_measurements(3.0)
    assert later.aggregation_s == 0.0046
    assert pol.decider.wants_ranking(later) is None
    assert pol.decider.wants_ranking(pol._live_measurements(3.5)) is None

    pol = policy_after_a_ranking(("ebsp", "ring"))
    later = pol._live_measurements(3.0)
    assert later.aggregation_s == (0.0046 + 0.0148) / 2
    assert pol.decider.wants_ranking(later) is None          # one check
    assert "aggregation" in pol.decider.wants_ranking(pol._live_measurements(3.5))
