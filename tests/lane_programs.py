"""Multi-rank program for tests/test_collective_lanes.py: the script's collectives give the
same results whether their data step runs blocking on the progress engine's lane or
non-blocking on the communicator, with uneven splits and rows (np 3), their results in
memory leased from the scratch pool (``ScratchPool.result``, from 1 KB here instead of 32 MB:
memory that held other data before).

The lane is taken at ``thread_min_bytes`` and up; the program sets it to 1 byte (every data
step on the lane) and to None (never), so both paths run at sizes a test can afford.  Every
result is compared with numpy's on the inputs every rank can rebuild.  Each rank prints
``LANES-OK <mode> rank=<r>`` or raises.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpsync.torch import _moves, mpi_ops
from mpsync.torch._collectives import Average, Sum, UserOps
from mpsync.torch.dataplane.compression import Compression
from mpsync.torch.dataplane.progress import engine
from mpsync.torch.dataplane.scratch import pool


def _input(r: int, shape, dtype=torch.float32) -> torch.Tensor:
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * (r + 1) + r).to(dtype)


def _check(what: str, got: torch.Tensor, want: np.ndarray, rtol: float = 0.0) -> None:
    got_np = got.to(torch.float64).numpy()
    if got_np.shape != want.shape or not np.allclose(got_np, want, rtol=rtol, atol=0.0):
        raise AssertionError(f"{what}: got {got_np.tolist()} want {want.tolist()}")


def check_all(ops: UserOps, r: int, n: int, mode: str) -> None:
    rows, first = 7, [0, 3, 5, 7]  # 7 rows over 3 members: 3, 2, 2

    # reducescatter, float32: Sum and Average, with pre- and postscale
    inputs = [_input(w, (rows, 5)).numpy().astype(np.float64) for w in range(n)]
    total = np.sum(inputs, axis=0)
    for op, pre, post in ((Sum, 1.0, 1.0), (Average, 2.0, 0.5)):
        y = mpi_ops.start_reducescatter(ops, _input(r, (rows, 5)), op, pre, post, None,
                                        f"rs.{mode}.{op}").wait()
        want = total * pre * post / (n if op == Average else 1)
        _check(f"reducescatter op={op}", y, want[first[r]:first[r + 1]], rtol=1e-6)
        assert y.dtype == torch.float32, y.dtype

    # reducescatter, int32 Average: the quotient truncated, as Horovod's
    y = mpi_ops.start_reducescatter(ops, _input(r, (rows,), torch.int32), Average, 1.0, 1.0,
                                    None, f"rs.int.{mode}").wait()
    isum = np.sum([_input(w, (rows,), torch.int32).numpy() for w in range(n)], axis=0)
    _check("reducescatter int32", y, np.trunc(isum / n)[first[r]:first[r + 1]])
    assert y.dtype == torch.int32

    # reducescatter, float16 (the half sum) and with Compression.fp16
    y = mpi_ops.start_reducescatter(ops, _input(r, (rows,), torch.float16), Sum, 1.0, 1.0,
                                    None, f"rs.half.{mode}").wait()
    hsum = np.sum([_input(w, (rows,)).numpy() for w in range(n)], axis=0)
    _check("reducescatter float16", y, hsum[first[r]:first[r + 1]].astype(np.float64), rtol=1e-3)
    y = mpi_ops.start_reducescatter(ops, _input(r, (rows, 5)), Sum, 1.0, 1.0, Compression.fp16,
                                    f"rs.fp16.{mode}").wait()
    _check("reducescatter fp16 wire", y, total[first[r]:first[r + 1]], rtol=1e-3)
    assert y.dtype == torch.float32

    # alltoall, uneven splits: member w sends (w + k) % 3 rows to member k
    splits = [(r + k) % 3 for k in range(n)]
    send = _input(r, (sum(splits), 2))
    got, recv_splits = _moves.start_alltoall(ops, send, splits, f"a2a.{mode}").wait()
    want = []
    for w in range(n):
        ws = [(w + k) % 3 for k in range(n)]
        at = sum(ws[:r])
        want.append(_input(w, (sum(ws), 2)).numpy()[at:at + ws[r]])
    _check("alltoall", got, np.concatenate(want).astype(np.float64))
    assert recv_splits.tolist() == [(w + r) % 3 for w in range(n)], recv_splits

    # allreduce with Compression.fp16, a length the members do not divide (padding) and one
    # they do
    for length in (10, 9):
        y = _moves.start_allreduce(ops, _input(r, (length,)), Average, 1.0, 1.0,
                                   Compression.fp16, f"arh.{length}.{mode}").wait()
        want = np.mean([_input(w, (length,)).numpy() for w in range(n)], axis=0)
        _check(f"fp16 allreduce of {length}", y, want.astype(np.float64), rtol=2e-3)
        assert y.dtype == torch.float32

    # grouped allreduce (fused into one buffer), prescaled; the inputs stay as they were
    parts = [_input(r, (4,)), _input(r, (3, 2)), _input(r, (5,))]
    before = [p.clone() for p in parts]
    ys = mpi_ops.start_grouped_allreduce(ops, parts, Sum, 3.0, 1.0, None, f"gar.{mode}",
                                         False).wait()
    for i, (p, y) in enumerate(zip(parts, ys)):
        want = 3.0 * np.sum([_input(w, tuple(p.shape)).numpy() for w in range(n)], axis=0)
        _check(f"grouped part {i}", y, want.astype(np.float64), rtol=1e-6)
        assert torch.equal(p, before[i]), f"grouped allreduce wrote into its input {i}"

    # grouped allgather (rows differ by member) and grouped reducescatter (prescaled)
    gparts = [_input(r, (r + 1 + i, 3)) for i in range(3)]
    ys = mpi_ops.start_grouped_allgather(ops, gparts, f"gag.{mode}").wait()
    for i, y in enumerate(ys):
        want = np.concatenate([_input(w, (w + 1 + i, 3)).numpy() for w in range(n)])
        _check(f"grouped allgather part {i}", y, want.astype(np.float64))
    rparts = [_input(r, (rows + i, 2)) for i in range(3)]
    ys = mpi_ops.start_grouped_reducescatter(ops, rparts, Average, 2.0, 1.0, None,
                                             f"grs.{mode}").wait()
    for i, y in enumerate(ys):
        start, count = _moves.reducescatter_rows(rows + i, n, r)
        want = 2.0 * np.mean([_input(w, (rows + i, 2)).numpy() for w in range(n)], axis=0)
        _check(f"grouped reducescatter part {i}", y, want[start:start + count], rtol=1e-6)

    # the half sum itself (float16 and bfloat16: one allreduce with MPI's own algorithm and a
    # registered 2-byte sum): every member gets the same bits, within the rounding of each
    # addition of the float64 sum; a length the members do not divide
    for dtype, rtol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        x = (_input(r, (11,)) / 7).to(dtype)
        _moves.sum_half_(ops, x, f"half.{mode}")
        want = np.sum([(_input(w, (11,)) / 7).to(dtype).to(torch.float64).numpy()
                       for w in range(n)], axis=0)
        _check(f"half sum {dtype}", x, want, rtol=rtol)
        bits = x.view(torch.int16).numpy()
        every = np.empty((n, bits.size), dtype=np.int16)
        ops.comm.Allgather(bits, every)
        assert (every == every[0]).all(), f"half sum {dtype}: members differ: {every}"

    # allgather of a tensor whose size-1 dimension has an odd stride (read without a copy only
    # where its strides are row-major)
    odd = torch.empty(2, 2)[:, :1]
    odd.copy_(torch.tensor([[r + 0.5], [r + 1.5]]))
    y = _moves.start_allgather(ops, odd, f"ag.odd.{mode}").wait()
    _check("allgather, odd strides", y, np.array([[w + 0.5 + d] for w in range(n)
                                                  for d in (0, 1)]))


def check_leases(ops: UserOps, r: int, n: int, mode: str) -> None:
    """A result kept is never reused by the next call; once dropped (views too), its memory
    serves the next result."""
    shape, want = (300, 3), sum(np.arange(900.0).reshape(300, 3) + w for w in range(n))
    calls = {
        "allreduce": lambda i: _moves.start_allreduce(
            ops, torch.arange(900.0).reshape(shape) + r + i, Sum, 1.0, 1.0, None,
            f"lease.ar.{mode}").wait(),
        "allgather": lambda i: _moves.start_allgather(
            ops, torch.arange(900.0).reshape(shape) + r + i, f"lease.ag.{mode}").wait(),
    }
    wants = {"allreduce": lambda i: want + n * i,
             "allgather": lambda i: np.concatenate([np.arange(900.0).reshape(shape) + w + i
                                                    for w in range(n)])}
    for what, call in calls.items():
        kept = call(0)
        view = kept[1:]
        ptr = kept.untyped_storage().data_ptr()
        later = call(1)  # `kept` is alive: other memory
        assert later.untyped_storage().data_ptr() != ptr, what
        _check(f"{what} kept", kept, wants[what](0))
        _check(f"{what} later", later, wants[what](1))
        del kept
        again = call(2)  # the view keeps the memory: still other memory
        assert again.untyped_storage().data_ptr() != ptr, what
        _check(f"{what} view", view, wants[what](0)[1:])
        ptrs = {ptr, later.untyped_storage().data_ptr(), again.untyped_storage().data_ptr()}
        del view, again, later
        reused = pool().reused
        assert call(3).untyped_storage().data_ptr() in ptrs, what  # back in the pool, reused
        assert pool().reused > reused, what


def main() -> None:
    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    assert n == 3, "run on 3 ranks: the rows and splits are uneven over 3"
    ops = UserOps(world.Dup(), 60.0)
    eng = engine()
    pool().lease_min = pool().fresh_below = 1 << 10
    for mode, threshold in (("lane", 1), ("no-lane", None)):
        eng.thread_min_bytes = threshold
        calls = eng.counts["lane_calls"]
        check_all(ops, r, n, mode)
        check_leases(ops, r, n, mode)
        used = eng.counts["lane_calls"] - calls
        assert (used > 0) == (mode == "lane"), (mode, used)
        print(f"LANES-OK {mode} rank={r} lane_calls={used}", flush=True)
