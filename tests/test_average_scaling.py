"""Averages over a power-of-two number of workers scale each worker's part by 1/N in the
copy a reduction makes anyway, instead of the sum after it: the same bits as Horovod's
arithmetic, one pass over the bytes fewer.  And an allreduce takes the progress engine's
lane from 1 MB, below the other calls' 4 MB."""

from __future__ import annotations

import pytest
import torch

from mpi_harness import run_mpi
from mpsync.torch._collectives import Average, Sum, average_scales, pack_scaled
from mpsync.torch.dataplane.progress import (REDUCE_THREAD_MIN_BYTES, THREAD_MIN_BYTES,
                                             ProgressEngine)


def test_an_average_moves_its_one_over_n_before_the_sum_only_where_that_is_exact():
    assert average_scales(Average, torch.float32, 4, 3.0, 0.5) == (0.75, 0.5)
    assert average_scales(Average, torch.float64, 2, 1.0, 1.0) == (0.5, 1.0)
    assert average_scales(Average, torch.float32, 1, 1.0, 1.0) == (1.0, 1.0)
    # Not a power of two, not a float sum of its own dtype, not an average: Horovod's order.
    assert average_scales(Average, torch.float32, 3, 3.0, 0.5) == (3.0, 0.5 / 3)
    for dtype in (torch.int32, torch.int64, torch.float16, torch.bfloat16):
        assert average_scales(Average, dtype, 4, 1.0, 1.0) == (1.0, 0.25), dtype
    assert average_scales(Sum, torch.float32, 4, 2.0, 0.5) == (2.0, 0.5)


def test_scaled_parts_add_up_to_the_scaled_sum_for_a_power_of_two_and_not_for_three():
    g = torch.Generator().manual_seed(7)
    # values of every magnitude from 1e-20 to 1e20, of one magnitude across the workers
    scale = 10.0 ** torch.randint(-20, 21, (200_000,), generator=g).to(torch.float32)
    parts = [torch.randn(200_000, generator=g) * scale for _ in range(4)]

    def added(xs):
        total = xs[0]
        for x in xs[1:]:
            total = total + x
        return total

    for n in (2, 4):
        xs = parts[:n]
        assert torch.equal(added([x * (1.0 / n) for x in xs]), added(xs) * (1.0 / n)), n
    xs = parts[:3]  # why three workers keep Horovod's order: the bits would differ
    assert not torch.equal(added([x * (1.0 / 3) for x in xs]), added(xs) * (1.0 / 3))


@pytest.mark.parametrize("count", [1, 3, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_packing_scaled_equals_concatenating_then_scaling(count, dtype):
    g = torch.Generator().manual_seed(count)
    xs = [(torch.randn(5 + i, 3, generator=g) * 100).to(dtype) for i in range(count)]
    for factor in (1.0, 0.25, 3.0):
        buf = torch.empty(sum(x.numel() for x in xs), dtype=dtype)
        pack_scaled(xs, buf, factor)
        want = torch.cat([x.reshape(-1) for x in xs])
        if dtype.is_floating_point:
            want = want * factor
        else:  # Horovod's integer scaling: float64, truncated toward zero
            want = (want.to(torch.float64) * factor).trunc().to(dtype)
        assert torch.equal(buf, want), (count, dtype, factor)


def test_an_allreduce_takes_the_lane_from_a_smaller_size_than_the_other_calls():
    eng = ProgressEngine()
    assert REDUCE_THREAD_MIN_BYTES < THREAD_MIN_BYTES
    assert eng.use_lane(REDUCE_THREAD_MIN_BYTES, reduction=True)
    assert not eng.use_lane(REDUCE_THREAD_MIN_BYTES - 4, reduction=True)
    assert not eng.use_lane(REDUCE_THREAD_MIN_BYTES)
    assert eng.use_lane(THREAD_MIN_BYTES)
    # The engine's own setting still rules where it says never, or lower.
    assert not ProgressEngine(thread_min_bytes=None).use_lane(1 << 30, reduction=True)
    assert ProgressEngine(thread_min_bytes=1).use_lane(4, reduction=True)
    assert not eng.use_lane(1 << 30, threshold=None, reduction=True)


@pytest.mark.mpi
def test_averages_on_two_workers_have_horovods_bits_and_take_the_lane_from_1_mb():
    run = run_mpi("average_programs:main", np=2, timeout=240)
    for r in range(2):
        for part in ("averages", "allgather_stays_off_the_lane"):
            assert f"PART-OK {part} rank={r}" in run.rank_out(r), run.report()
