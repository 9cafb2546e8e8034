"""The samples axis of ``mpsync train`` between the ring's stop checks
(:func:`mpsync.apps.train_stops.samples_between_checks`): the last agreed sum plus worker 0's
samples since, times the share of the sums it measured between the last two.  Replayed on the
step pattern of ElasticBSP's supersteps with stragglers 1,1,2,4 and on BSP's rounds."""

from __future__ import annotations

import pytest

from mpsync.apps.train_stops import samples_between_checks, samples_share

BATCH = 32


def _superstep_steps(slowdowns: list[int]) -> list[int]:
    """Steps each worker takes in one superstep as long as the slowest worker's step."""
    longest = max(slowdowns)
    return [longest // s for s in slowdowns]


def _replay(slowdowns: list[int], supersteps: int):
    """(estimate, true sum) at each of worker 0's steps, the checks at superstep ends, with
    the estimate as RingStop keeps it (never going back)."""
    per_superstep = _superstep_steps(slowdowns)
    share, agreed_at, axis = float(len(slowdowns)), (0, 0), 0
    readings = []
    own = true_sum = 0
    for _ in range(supersteps):
        steps0 = per_superstep[0]
        for k in range(1, steps0 + 1):
            own += BATCH
            # The others' samples in step with worker 0's clock within the superstep.
            now_sum = true_sum + sum(BATCH * (n_steps * k // steps0) for n_steps in per_superstep)
            if k < steps0:
                axis = max(axis, samples_between_checks(agreed_at, own, share))
                readings.append((axis, now_sum))
        true_sum += BATCH * sum(per_superstep)
        now = (true_sum, own)
        share = samples_share(agreed_at, now, share)
        agreed_at, axis = now, max(axis, true_sum)
        readings.append((axis, true_sum))
    return share, readings


def test_elastic_bsp_with_stragglers_measures_worker_0s_share_and_tracks_the_sum():
    # Workers at 1,1,2,4 take 4, 4, 2 and 1 steps per superstep: worker 0 takes 4 of 11.
    share, readings = _replay([1, 1, 2, 4], supersteps=6)
    assert share == pytest.approx(11 / 4)
    # After the first superstep, the estimate stays within one superstep's samples of the sum
    # taken, and never falls behind the last agreed sum.
    one_superstep = BATCH * 11
    for axis, true_sum in readings[4:]:
        assert abs(axis - true_sum) <= one_superstep / 2
    # Worker 0's samples times the workers overstates the sum by 16/11 (about 45%).
    own_at_end = 6 * 4 * BATCH
    assert own_at_end * 4 > 1.4 * readings[-1][1]
    assert readings[-1][0] == readings[-1][1]


def test_the_axis_never_goes_back():
    _, readings = _replay([1, 1, 2, 4], supersteps=6)
    axes = [axis for axis, _ in readings]
    assert axes == sorted(axes)


def test_bsp_rounds_give_a_share_of_the_workers():
    share, agreed_at = 4.0, (0, 0)
    for round_ in range(1, 6):
        now = (4 * BATCH * round_, BATCH * round_)
        share = samples_share(agreed_at, now, share)
        agreed_at = now
    assert share == 4.0
    assert samples_between_checks(agreed_at, agreed_at[1] + BATCH, share) == 4 * BATCH * 6


def test_a_check_without_growth_keeps_the_last_share():
    assert samples_share((100, 50), (100, 60), 2.5) == 2.5   # the sum did not grow
    assert samples_share((100, 50), (180, 50), 2.5) == 2.5   # this worker took no step
    assert samples_between_checks((100, 50), 40, 2.5) == 100  # own samples below (a resume)
