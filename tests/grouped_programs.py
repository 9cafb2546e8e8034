"""Multi-rank program for tests/test_grouped_calls.py: grouped calls on 3 workers of a
co-located server (bsp, ring).

Worker 1 takes the general path of a grouped allreduce (part by part, then fused), the others
the path for plain host tensors (:mod:`mpsync.torch._grouped`): both must submit the same
record and run the same data steps, or the call fails or hangs.  Every value is checked
against what each worker computes alone from every worker's inputs, in float64.  Each part
prints ``PART-OK <name> rank=<r>``.
"""

from __future__ import annotations

import torch

import mpsync.torch as mps
from mpsync.torch import _runtime, mpi_ops

_SHAPES = [(3,), (2, 2), (), (5, 1)]


def _x(k: int, i: int, shape, dtype) -> torch.Tensor:
    """Worker ``k``'s ``i``-th tensor: small integers, exact in every dtype and sum here."""
    n = max(1, int(torch.Size(shape).numel()))
    return ((torch.arange(n) % 4 + k + 2 * i) - 3).reshape(shape).to(dtype)


def _expected(i, shape, dtype, op, pre, post, n) -> torch.Tensor:
    xs = [_x(k, i, shape, dtype).to(torch.float64) for k in range(n)]
    if not dtype.is_floating_point:  # Horovod's integer scaling: float64, truncated
        xs = [(x * pre).trunc() for x in xs]
    else:
        xs = [x * pre for x in xs]
    if op == mps.Min:
        y = torch.stack(xs).amin(0)
    elif op == mps.Max:
        y = torch.stack(xs).amax(0)
    else:
        y = sum(xs)
    y = y * (post / n if op == mps.Average else post)
    return y.trunc() if not dtype.is_floating_point else y


def plain_and_general_agree(r, n):
    """Every dtype, op, scaling and the in-place form, one worker on the general path; one
    request per group."""
    ops = _runtime.worker_context("test").user_ops
    cases = [(dtype, op, pre, post, in_place)
             for dtype in (torch.float32, torch.float64, torch.int32, torch.int64,
                           torch.float16, torch.bfloat16)
             for op, pre, post in ((mps.Sum, 1.0, 1.0), (mps.Average, 2.0, 0.5),
                                   (mps.Max, 1.0, 3.0), (mps.Min, 1.0, 1.0))
             for in_place in (False, True)
             if not (dtype in (torch.float16, torch.bfloat16) and op in (mps.Min, mps.Max))]
    for c, (dtype, op, pre, post, in_place) in enumerate(cases):
        xs = [_x(r, i, s, dtype) for i, s in enumerate(_SHAPES)]
        before = ops.stats()["requests"]
        name = f"g.{c}"
        if in_place:
            got = mps.grouped_allreduce_(xs, name=name, op=op, prescale_factor=pre,
                                         postscale_factor=post)
            assert all(g is x for g, x in zip(got, xs)), "in place: the callers' tensors"
        else:
            got = mps.grouped_allreduce(xs, name=name, op=op, prescale_factor=pre,
                                        postscale_factor=post)
            assert all(torch.equal(x, _x(r, i, s, dtype))
                       for i, (x, s) in enumerate(zip(xs, _SHAPES))), "inputs untouched"
        assert ops.stats()["requests"] - before == 1, (dtype, op)
        for i, (g, s) in enumerate(zip(got, _SHAPES)):
            want = _expected(i, s, dtype, op, pre, post, n)
            assert g.dtype == dtype and g.shape == torch.Size(s), (dtype, op, i, g)
            assert torch.equal(g.to(torch.float64), want), (dtype, op, pre, post, i, g, want)
    # Results are tensors of their own: writing one leaves the others as they were.
    a, b = mps.grouped_allreduce([torch.ones(3), torch.ones(3)], name="own", op=mps.Sum)
    a.add_(1)
    assert b.tolist() == [float(n)] * 3 and a.tolist() == [n + 1.0] * 3
    # The gradient of a grouped allreduce (Average) is the grouped allreduce of the
    # gradients: every worker's ones, averaged.
    w = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    sum(y.sum() for y in mps.grouped_allreduce(w, name="grad")).backward()
    assert w[0].grad.tolist() == [1.0, 1.0] and w[1].grad.tolist() == [1.0] * 3


def reducescatters_fused(r, n):
    """Small reduce-scatters in a group run as one allreduce, each worker keeping its rows
    (rows that do not split evenly too); a large one runs alone; named ones submitted
    together fuse as well."""
    parts = [(torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2) + r + 3 * i)
             for i in range(3)] + [torch.full((n * 4,), float(r + 1), dtype=torch.float16)]
    big = torch.full((n * 70_000,), float(r), dtype=torch.float32)  # 840 KB: alone

    def mine(t_of_k, rows):
        first = sum(rows // n + (1 if m < rows % n else 0) for m in range(r))
        count = rows // n + (1 if r < rows % n else 0)
        return sum(t_of_k(k) for k in range(n)).to(torch.float64)[first:first + count]

    for op in (mps.Sum, mps.Average):
        got = mps.grouped_reducescatter(parts + [big], name=f"rs.{op}", op=op,
                                        prescale_factor=2.0)
        scale = 2.0 / (n if op == mps.Average else 1)
        for i in range(3):
            want = mine(lambda k: torch.arange(10.).reshape(5, 2) + k + 3 * i, 5) * scale
            assert torch.equal(got[i].to(torch.float64), want), (op, i, got[i], want)
        want = mine(lambda k: torch.full((n * 4,), k + 1.0), n * 4) * scale
        assert got[3].dtype == torch.float16 and torch.equal(got[3].double(), want), got[3]
        want = mine(lambda k: torch.full((n * 70_000,), float(k)), n * 70_000) * scale
        assert torch.equal(got[4].double(), want), op
    small = [t * (i + 1) for i, t in enumerate(parts[:3])]  # one dtype: one fused step
    for op in (mps.Sum, mps.Average):
        got = mps.grouped_reducescatter(small, name=f"rss.{op}", op=op, postscale_factor=3.0)
        scale = 3.0 / (n if op == mps.Average else 1)
        for i in range(3):
            want = mine(lambda k: (torch.arange(10.).reshape(5, 2) + k + 3 * i) * (i + 1),
                        5) * scale
            assert got[i].dtype == torch.float32 and torch.equal(got[i].double(), want), i
    handles = [mpi_ops.reducescatter_async(torch.ones(n * 2, 3) * (r + i), name=f"rsn.{i}",
                                           op=mps.Sum) for i in range(3)]
    for i, h in enumerate(handles):
        want = sum(torch.ones(2, 3) * (k + i) for k in range(n))
        assert torch.equal(mps.synchronize(h), want), i


def allgathers(r, n):
    """Grouped allgathers: one shape on every worker (one fused step, dtypes mixed), first
    dimensions differing by worker (each part alone), and the two in one group."""
    same = [torch.full((2, 3), float(r)), torch.tensor([[r, r + 1]], dtype=torch.int64),
            torch.full((1, 2, 2), r % 2 == 0), torch.full((3,), r, dtype=torch.bfloat16)]
    ragged = [torch.full((r + 1, 2), float(r)), torch.arange(r + 2, dtype=torch.int32)]
    for c, group in enumerate((same, ragged, same + ragged)):
        got = mps.grouped_allgather(group, name=f"ag.{c}")
        for g, x in zip(got, group):
            want = torch.cat([_like(x, k) for k in range(n)])
            assert g.dtype == x.dtype and torch.equal(g, want), (c, g, want)
    # Pieces at offsets that suit no wider dtype, an empty one, named ones fused together.
    odd = [torch.full((3,), r % 2 == 1), torch.zeros((0, 2), dtype=torch.int64),
           torch.full((1, 2), r, dtype=torch.int64), torch.full((1,), r, dtype=torch.int16)]
    handles = [mpi_ops.allgather_async(x, name=f"odd.{i}") for i, x in enumerate(odd)]
    for c, got in enumerate((mps.grouped_allgather(odd, name="odd"),
                             [mps.synchronize(h) for h in handles])):
        assert [g.tolist() for g in got] == [
            [k % 2 == 1 for k in range(n) for _ in range(3)], [],
            [[k, k] for k in range(n)], list(range(n))], (c, got)


def _like(x, k):
    """Worker ``k``'s version of this worker's allgather input ``x`` (see allgathers)."""
    if x.dtype == torch.int32:
        return torch.arange(k + 2, dtype=torch.int32)
    if x.dtype == torch.int64:
        return torch.tensor([[k, k + 1]], dtype=torch.int64)
    if x.dtype == torch.bool:
        return torch.full((1, 2, 2), k % 2 == 0)
    if x.dtype == torch.bfloat16:
        return torch.full((3,), k, dtype=torch.bfloat16)
    if x.shape[1:] == (2,):
        return torch.full((k + 1, 2), float(k))
    return torch.full((2, 3), float(k))


def main():
    mps.init(policy="bsp", topology="ring", backend="mpi", server="colocated", deadline=30)
    r, n = mps.rank(), mps.size()
    if r == 1:  # the general path, part by part
        for plain in ("group", "allgather", "reducescatter"):
            setattr(mpi_ops, f"submit_plain_{plain}", lambda *args, **kwargs: None)
    for part in (plain_and_general_agree, reducescatters_fused, allgathers):
        part(r, n)
        print(f"PART-OK {part.__name__} rank={r}", flush=True)
    mps.shutdown()
