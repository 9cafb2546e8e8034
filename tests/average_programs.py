"""Multi-rank program for tests/test_average_scaling.py: averages over a power-of-two number
of workers (2), where each worker's part is scaled by 1/N in the copy it makes anyway instead
of the sum after it (:func:`mpsync.torch._collectives.average_scales`).

Every result is compared bit for bit with Horovod's arithmetic -- each part times the
prescale, summed, the sum times postscale/N -- computed by each worker alone from every
worker's inputs (seeded, so each can make the others').  Random normal values, large ones
and tiny ones: the scaled parts must add up to the scaled sum exactly.  Sizes below and
above the lane's size for an allreduce (1 MB).  Prints ``PART-OK <name> rank=<r>``.
"""

from __future__ import annotations

import torch

import mpsync.torch as mps
from mpsync.torch.dataplane.progress import REDUCE_THREAD_MIN_BYTES, engine


def _x(k: int, numel: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + k)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x[: numel // 3] *= 1e30    # large: their sum rounds differently from the parts'
    x[numel // 3: numel // 2] *= 1e-30
    return x.to(dtype)


def _horovod(numel, dtype, seed, n, pre, post) -> torch.Tensor:
    """Horovod's average in ``dtype``: parts times ``pre``, summed in rank order (two
    workers: one addition, the same in any order), the sum times ``post / n``."""
    total = None
    for k in range(n):
        part = _x(k, numel, dtype, seed) * pre
        total = part if total is None else total + part
    return total * (post / n)


def averages(r, n):
    assert n & (n - 1) == 0, "a power-of-two number of workers"
    numels = (1000, REDUCE_THREAD_MIN_BYTES // 4 + 7)
    for seed, (numel, dtype, pre, post) in enumerate(
            (numel, dtype, pre, post) for numel in numels
            for dtype in (torch.float32, torch.float64)
            for pre, post in ((1.0, 1.0), (3.0, 0.7))):
        x = _x(r, numel, dtype, seed)
        lanes = engine().counts["lane_calls"]
        got = mps.allreduce(x, op=mps.Average, name=f"avg.{seed}", prescale_factor=pre,
                            postscale_factor=post)
        on_lane = engine().counts["lane_calls"] > lanes
        assert on_lane == (x.nbytes >= REDUCE_THREAD_MIN_BYTES), (numel, dtype, on_lane)
        want = _horovod(numel, dtype, seed, n, pre, post)
        assert torch.equal(x, _x(r, numel, dtype, seed)), "input untouched"
        assert got.dtype == dtype and torch.equal(got, want), (numel, dtype, pre, post)
        # The same values as a group: its parts packed (and scaled) into one buffer.
        parts = list(x.split([numel // 2, numel - numel // 2]))
        got = mps.grouped_allreduce(parts, op=mps.Average, name=f"group.{seed}",
                                    prescale_factor=pre, postscale_factor=post)
        assert torch.equal(torch.cat(got), want), (numel, dtype, pre, post)
    # In place, and through the fusion of several single calls in flight at once.
    xs = [_x(r, 300 + i, torch.float32, 50 + i) for i in range(3)]
    handles = [mps.allreduce_async_(x, op=mps.Average, name=f"inplace.{i}")
               for i, x in enumerate(xs)]
    for i, (h, x) in enumerate(zip(handles, xs)):
        assert mps.synchronize(h) is x
        assert torch.equal(x, _horovod(300 + i, torch.float32, 50 + i, n, 1.0, 1.0)), i


def allgather_stays_off_the_lane(r, n):
    """A 1 MB allgather is not an allreduce: it keeps the non-blocking call (as fast or
    faster than the blocking one at that size, bench/collectives/README.md)."""
    lanes = engine().counts["lane_calls"]
    got = mps.allgather(torch.full((REDUCE_THREAD_MIN_BYTES // 4,), float(r)), name="ag")
    assert engine().counts["lane_calls"] == lanes
    assert got.shape == (n * REDUCE_THREAD_MIN_BYTES // 4,) and float(got[-1]) == n - 1


def main():
    mps.init(policy="bsp", topology="ring", backend="mpi", server="colocated", deadline=60)
    r, n = mps.rank(), mps.size()
    for part in (averages, allgather_stays_off_the_lane):
        part(r, n)
        print(f"PART-OK {part.__name__} rank={r}", flush=True)
    mps.shutdown()
