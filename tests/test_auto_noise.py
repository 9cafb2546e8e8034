"""``auto``'s judgement of its own measurements, without MPI: a change in the cluster is one
beyond the measurements' noise, and a decision's reason names the target its times are to
(mpsync.auto.measurements, mpsync.auto.decider)."""

from __future__ import annotations

import numpy as np

from mpsync.auto import Candidate, Decider, Measurements, Window


def _jittered_checks(rng, means_s, checks: int, window: Window, reports_per_check: int = 10):
    """Per check, ``reports_per_check`` compute reports per worker: each its mean plus a
    loaded machine's timing noise (3 ms standard deviation, never below 1 ms: the medians of
    three move by 2-6 ms from check to check); the window's measurements after each check."""
    for _ in range(checks):
        for _ in range(reports_per_check):
            for w, mean in enumerate(means_s):
                window.add_compute(w, max(mean + rng.normal(0.0, 3e-3), 1e-3))
        yield window.measurements(topologies=("ring",))


def test_timing_noise_is_not_a_cluster_change_a_4x_slowdown_is():
    """A change in the cluster is a change beyond the measurement's noise: 5 ms iterations
    read with 2-6 ms of jitter over 60 checks never trigger a new ranking; a worker 4x
    slower does, and the reason says how the change was judged."""
    from mpsync.auto.serving import WINDOW_REPORTS

    rng = np.random.default_rng(7)
    d = Decider(Candidate("bsp", "ring"), confirm=2)
    window = Window(4, WINDOW_REPORTS)
    triggers, seen = [], []
    for m in _jittered_checks(rng, [5e-3] * 4, 60, window):
        seen.append(m.compute_s)
        trigger = d.wants_ranking(m)
        if trigger:
            triggers.append(trigger)
            d.basis = m                      # (a decision rests on it)
    assert triggers == ["first measurement"], triggers
    # The series is as noisy as a loaded machine's: a relative tolerance alone (30%) would
    # have seen a "change" between many pairs of checks, by 2 ms and more.
    moves = [abs(a - b) for x, y in zip(seen, seen[1:]) for a, b in zip(x, y)]
    assert sum(m > 0.3 * 5e-3 for m in moves) > len(moves) / 3 and max(moves) > 4e-3
    assert all(0 < s < 5e-3 for s in m.compute_noise_s), m.compute_noise_s
    slowed = []
    for m in _jittered_checks(rng, [5e-3, 20e-3, 5e-3, 5e-3], 4, window):
        slowed.append(d.wants_ranking(m))
    change = next(t for t in slowed if t)
    assert change.startswith("cluster changed: worker 1 compute"), change
    assert "standard error" in change and "ms" in change


def test_a_change_of_a_few_ms_is_below_the_floor_without_a_noise_estimate():
    before = Measurements(compute_s=(0.005, 0.005), topologies=("ring",))
    after = Measurements(compute_s=(0.005, 0.002), topologies=("ring",))
    assert after.change_from(before, 0.3) is None          # 60%, but 3 ms
    noisy_long = Measurements(compute_s=(0.150, 0.150), compute_noise_s=(0.03, 0.03))
    moved = Measurements(compute_s=(0.150, 0.210), compute_noise_s=(0.03, 0.03))
    assert moved.change_from(noisy_long, 0.3) is None       # 60 ms, within 3 errors
    assert Measurements(compute_s=(0.150, 0.600), compute_noise_s=(0.03, 0.03)) \
        .change_from(noisy_long, 0.3).startswith("worker 1 compute 150 -> 600")


def test_the_reason_names_the_target_it_predicts_for():
    from mpsync.auto.ranking import Ranked

    def ranked(label_times):
        return [Ranked(Candidate(p, "ring"), t, 1000.0, 1.0, 0.0, (), 0.0)
                for p, t in label_times]

    m = Measurements.from_speeds([1, 1], topologies=("ring",), target_samples=12_500)
    stay = Decider(Candidate("bsp", "ring")).decide(ranked([("bsp", 0.8), ("asp", 0.9)]),
                                                    m, 1.0, "first measurement")
    assert stay.reason == "bsp/ring is predicted fastest (0.8 s to 12,500 BSP-equivalent " \
                          "samples)", stay.reason
    switch = Decider(Candidate("bsp", "ring")).decide(ranked([("asp", 0.5), ("bsp", 0.9)]),
                                                      m, 5.0, "first measurement")
    assert switch.switch and "0.9 s to 12,500 BSP-equivalent samples" in switch.reason
