"""Multi-rank programs for tests/test_horovod_api.py (run under tests/mpi_harness.py).

Each checks horovod.torch's collectives on mpsync's workers against values computed from
the ranks, so a wrong reduction, order or shape fails on the rank that sees it.
"""

from __future__ import annotations

import sys

import torch

import mpsync.torch as mps


def _arg(name: str, default: str) -> str:
    for a in sys.argv[1:]:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def _raises(exc, fn, match: str) -> None:
    try:
        fn()
    except exc as e:
        if match not in str(e):
            raise AssertionError(f"expected {match!r} in {e!r}") from None
        return
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def collectives() -> None:
    """Every collective of the compatibility table, on the workers of a dedicated server."""
    mps.init(policy="bsp", backend=_arg("backend", "mpi"), deadline=30)
    r, n = mps.rank(), mps.size()
    assert mps.is_initialized() and mps.mpi_built() and not mps.gloo_built()
    assert mps.local_size() == n and mps.cross_size() == 1 and mps.cross_rank() == 0
    ranks = torch.arange(n, dtype=torch.float64)
    x = torch.tensor([r + 1.0, 2.0 * r])
    want = {mps.Average: torch.stack([ranks + 1, 2 * ranks]).mean(1),
            mps.Sum: torch.stack([ranks + 1, 2 * ranks]).sum(1),
            mps.Min: torch.tensor([1.0, 0.0]), mps.Max: torch.tensor([n, 2.0 * (n - 1)]),
            mps.Product: torch.stack([ranks + 1, 2 * ranks]).prod(1)}
    for op, expected in want.items():
        got = mps.allreduce(x, op=op, name=f"op{op}")
        assert torch.allclose(got.double(), expected.double()), (op, got, expected)
    assert torch.allclose(mps.allreduce(x, average=False), want[mps.Sum].float())
    # Integer sums are exact; prescale/postscale as Horovod (sum of 2x, then x0.5).
    assert int(mps.allreduce(torch.tensor([r], dtype=torch.int64), op=mps.Sum)) == n * (n - 1) // 2
    scaled = mps.allreduce(x, op=mps.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.allclose(scaled, want[mps.Sum].float())
    # fp16 compression: the dtype comes back, the values are the average to fp16 precision.
    big = torch.full((1000,), 0.1 * (r + 1))
    half = mps.allreduce(big, compression=mps.Compression.fp16, name="fp16")
    assert half.dtype == torch.float32
    assert torch.allclose(half, torch.full((1000,), 0.1 * (n + 1) / 2), atol=1e-3)
    # In place, async + poll + synchronize, grouped.
    y = x.clone()
    mps.allreduce_(y, op=mps.Sum)
    assert torch.allclose(y, want[mps.Sum].float())
    h = mps.allreduce_async(x, name="async")
    out = mps.synchronize(h)
    assert torch.allclose(out, want[mps.Average].float())
    h = mps.allreduce_async_(y, op=mps.Max)
    while not mps.poll(h):
        pass
    assert mps.synchronize(h) is y
    g = mps.grouped_allreduce([x, 2 * x], op=mps.Sum)
    assert torch.allclose(g[1], 2 * want[mps.Sum].float())
    # allgather with a different first dimension per worker.
    mine = torch.full((r + 1, 2), float(r))
    gathered = mps.allgather(mine)
    assert gathered.shape == (n * (n + 1) // 2, 2)
    assert gathered[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    assert mps.allgather_object({"rank": r}) == [{"rank": k} for k in range(n)]
    b = mps.broadcast(torch.tensor([float(r)] * 3), root_rank=n - 1)
    assert b.tolist() == [n - 1.0] * 3
    c = torch.tensor([r], dtype=torch.int32)
    mps.broadcast_(c, root_rank=0)
    assert int(c) == 0
    assert mps.broadcast_object({"from": r}, root_rank=1, name="obj") == {"from": 1}
    # alltoall: worker r sends k+1 rows of value 10r+k to worker k.
    send = torch.cat([torch.full((k + 1,), 10.0 * r + k) for k in range(n)])
    got, splits = mps.alltoall(send, splits=torch.tensor([k + 1 for k in range(n)]))
    assert splits.tolist() == [r + 1] * n
    assert got.tolist() == [10.0 * k + r for k in range(n) for _ in range(r + 1)]
    even = mps.alltoall(torch.arange(2.0 * n) + 100 * r)
    assert even.tolist() == [100.0 * k + 2 * r + j for k in range(n) for j in range(2)]
    rs = mps.reducescatter(torch.arange(2.0 * n + 1).repeat_interleave(1), op=mps.Sum)
    rows = 2 if r > 0 else 3
    start = 0 if r == 0 else 3 + 2 * (r - 1)
    assert rs.tolist() == [n * float(v) for v in range(start, start + rows)], rs
    mps.barrier()
    # Refusals name what to use instead.
    _raises(ValueError, lambda: mps.allreduce(x, op=mps.Adasum), "use op=Average")
    _raises(ValueError, lambda: mps.allreduce(x, process_set=object()), "process set")
    # join() with no optimizer: every worker returns the same rank.
    last = mps.join()
    assert mps.allgather_object(last) == [last] * n
    mps.shutdown()
    print(f"COLLECTIVES-OK rank={r}", flush=True)


def optimizer_keywords() -> None:
    """DistributedOptimizer's Horovod keywords: what is refused under which policy, and that
    backward_passes_per_step, sparse_as_dense and synchronize/skip_synchronize behave."""
    mps.init(policy="bsp", backend=_arg("backend", "mpi"), deadline=30)
    r, n = mps.rank(), mps.size()
    model = torch.nn.Linear(4, 2)
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    # Op Sum: gradients summed, not averaged.
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), op=mps.Sum,
                                   backward_passes_per_step=2)
    for _ in range(2):
        (model.weight.sum() * (r + 1)).backward()
    opt.synchronize()               # Horovod's clipping idiom: gradients final here
    expected = 2 * sum(k + 1 for k in range(n))
    assert torch.allclose(model.weight.grad, torch.full_like(model.weight, expected)), \
        model.weight.grad
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
    for _ in range(3):
        model.weight.sum().backward()
    _raises(RuntimeError, opt.step, "backward_passes_per_step=2")
    opt.zero_grad()
    # sparse gradients need sparse_as_dense.
    emb = torch.nn.Embedding(5, 3, sparse=True)
    mps.broadcast_parameters(emb.state_dict(), root_rank=0)
    sopt = mps.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                    named_parameters=emb.named_parameters(),
                                    sparse_as_dense=True,
                                    compression=mps.Compression.fp16,
                                    gradient_predivide_factor=2.0)
    before = emb.weight.detach().clone()
    emb(torch.tensor([r % 5])).sum().backward()
    sopt.step()
    moved = (before - emb.weight.detach()).abs().sum(1)
    # Each worker touched one row; the average moves row k by (#workers using it)/n.
    counts = torch.bincount(torch.tensor([k % 5 for k in range(n)]), minlength=5).float()
    assert torch.allclose(moved, 3 * counts / n, atol=1e-2), (moved, counts)
    _raises(ValueError, lambda: mps.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=1.0), named_parameters=emb.named_parameters(),
        op=mps.Adasum), "use op=Average")
    mps.shutdown()
    print(f"KEYWORDS-OK rank={r}", flush=True)


def refusals_by_policy() -> None:
    """Horovod features that mean nothing under a policy are refused naming both."""
    policy, topology = _arg("policy", "esync"), _arg("topology", "ring")
    mps.init(policy=policy, topology=topology, backend="mpi", deadline=30)
    model = torch.nn.Linear(4, 2)
    named = list(model.named_parameters())
    _raises(ValueError, lambda: mps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named, op=mps.Sum),
        f"policy={policy!r}")
    if topology == "ps":
        _raises(ValueError, lambda: mps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
            gradient_predivide_factor=2.0), "topology='ps'")
    assert mps.config().policy == policy  # came from MPSYNC_POLICY when not passed
    mps.shutdown()
    print(f"REFUSALS-OK rank={mps.rank()}", flush=True)


def joined_while_others_train() -> None:
    """Worker 0 trains 3 steps and joins while the others train 30 and then call collectives:
    its optimizer's join, waiting for the others (the PS's for the last pushes, the ring's in
    an aggregation), answers them (zeros, as in Horovod), and join() names one of the others."""
    policy, topology = _arg("policy", "ssp"), _arg("topology", "ps")
    mps.init(policy=policy, topology=topology, backend="mpi", deadline=20)
    r, n = mps.rank(), mps.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(8, 4)
    for _ in range(3 if r == 0 else 30):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    if r != 0:
        assert mps.allreduce(torch.ones(2), op=mps.Sum).tolist() == [float(n - 1)] * 2
        mps.barrier()
    last = mps.join()
    assert last in range(1, n), last
    opt.synchronize()
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    assert mps.allgather_object(digest) == [digest] * n
    mps.shutdown()
    print(f"JOINED-OK rank={r} last={last}", flush=True)


def from_environment() -> None:
    """``init()`` with no arguments takes the policy and topology from MPSYNC_*."""
    mps.init()
    cfg = mps.config()
    print(f"ENV policy={cfg.policy} topology={cfg.topology} backend={cfg.backend}", flush=True)
    mps.shutdown()


def device_tensors() -> None:
    """Tensors on a device (``device=cuda``: the GPU of the local rank, staged through host
    memory; ``device=cpu`` runs the same steps on CPU tensors): results come back on it."""
    mps.init(policy="bsp", backend=_arg("backend", "mpi"), deadline=60)
    r, n = mps.rank(), mps.size()
    if _arg("device", "cuda") == "cuda":
        dev = torch.device("cuda", mps.local_rank() % torch.cuda.device_count())
    else:
        dev = torch.device("cpu")
    x = torch.full((8,), float(r), device=dev)
    out = mps.allreduce(x, op=mps.Sum)
    assert out.device == dev and float(out[0]) == n * (n - 1) / 2
    g = mps.allgather(x[:2])
    assert g.device == dev and g.shape == (2 * n,)
    mps.broadcast_(x, root_rank=0)
    assert float(x[0]) == 0.0
    # BSP training on the device: gradients staged through the host buffer, models equal.
    model = torch.nn.Linear(4, 2).to(dev)
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(3):
        opt.zero_grad()
        model(torch.full((2, 4), float(r + 1), device=dev)).sum().backward()
        opt.step()
    opt.synchronize()
    assert model.weight.device == dev
    w = model.weight.detach().cpu().reshape(-1)
    assert all(torch.equal(w, o) for o in mps.allgather_object(w))
    mps.shutdown()
    print(f"DEVICE-OK rank={r} device={dev.type}", flush=True)
