"""The script's collectives on both of the progress engine's paths: a data step run blocking
on the lane and one run non-blocking give the same results (reducescatter as one
``Ireduce_scatter`` or as an alltoall and a sum, alltoall with uneven splits, the fp16 half
sum, a fused grouped allreduce, an allgather read without a copy, the grouped forms, results
in leased memory), 3 ranks; the scratch pool's buffers and leases."""

from __future__ import annotations

from mpi_harness import run_mpi


def test_lane_and_non_blocking_paths_give_numpys_results():
    run = run_mpi("lane_programs:main", np=3, timeout=180)
    out = run.stdout + "".join(r.get("stdout", "") for r in run.ranks.values())
    for mode in ("lane", "no-lane"):
        for r in range(3):
            assert f"LANES-OK {mode} rank={r}" in out, (mode, r, out[-3000:])


def test_the_scratch_pool_reuses_the_smallest_buffer_that_fits_and_keeps_a_bounded_amount():
    import torch

    from mpsync.torch.dataplane.scratch import ScratchPool

    pool = ScratchPool(keep_bytes=1000, fresh_below=0)
    a = pool.take(400, torch.float32)
    assert a.dtype == torch.float32 and a.numel() == 100
    b = pool.take(100)
    pool.give(a)
    pool.give(b)
    pool.give(b)  # a second give of the same buffer keeps one
    assert pool.kept_bytes() == 500 and pool.allocated == 2
    small = pool.take(60, torch.int16)  # the 100-byte buffer fits: reused, not the 400
    assert small.numel() == 30 and pool.reused == 1 and pool.kept_bytes() == 400
    assert small.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    pool.give(small)
    big = pool.take(2000)  # nothing fits: a new one
    assert pool.allocated == 3 and big.numel() == 2000
    pool.give(big)  # larger than the bound: never kept
    assert pool.kept_bytes() == 500
    third = pool.take(600)  # a new one (the 400 is too small)
    pool.give(third)  # 1,100 bytes kept would pass the bound: the longest unused goes first
    assert pool.kept_bytes() == 700 and pool.allocated == 4
    assert pool.take(400).untyped_storage().data_ptr() == third.untyped_storage().data_ptr()
    odd = pool.take(7, torch.float32)  # whole elements only
    assert odd.numel() == 1
    small = ScratchPool(fresh_below=1 << 10)  # below it: allocated fresh, never kept
    kept = small.take(2048)
    small.give(kept)
    assert small.take(100, torch.float64).numel() == 12 and small.allocated == 1
    small.give(small.take(512))
    assert small.kept_bytes() == 2048


def test_a_leased_result_goes_back_to_the_pool_only_when_nothing_refers_to_it():
    import torch

    from mpsync.torch.dataplane.scratch import ScratchPool

    pool = ScratchPool(fresh_below=0, lease_min=1 << 10)
    assert pool.result((10,), torch.float32).numel() == 10 and pool.allocated == 0  # fresh
    y = pool.result((64, 8), torch.bfloat16)
    assert y.shape == (64, 8) and y.dtype == torch.bfloat16 and y.is_contiguous()
    where = y.untyped_storage().data_ptr()
    part = y[3:].view(torch.int16)  # a view of another dtype holds it too
    del y
    assert pool.kept_bytes() == 0
    other = pool.result((1024,), torch.uint8)
    assert other.untyped_storage().data_ptr() != where and pool.allocated == 2
    del part
    assert pool.kept_bytes() == 1024  # `other` is still alive: only the first is back
    again = pool.result((256,), torch.float32)  # the first one's memory, reused
    assert again.untyped_storage().data_ptr() == where and pool.reused == 1
