"""Multi-rank programs for tests/test_horovod_semantics.py: horovod.torch's semantics beyond
its names, on 2 or 3 workers of a co-located server, under the policy of the arguments.

Every value and gradient is compared with a reference each worker computes alone from the
seeds of every worker (Horovod's backward definitions); every error case must raise on every
worker and leave the next collective working.
"""

from __future__ import annotations

import sys
import warnings

import torch

import mpsync.torch as mps


def _arg(name: str, default: str) -> str:
    for a in sys.argv[1:]:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def _raises(exc, fn, match: str):
    try:
        fn()
    except exc as e:
        if match not in str(e):
            raise AssertionError(f"expected {match!r} in {e!r}") from None
        return e
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def _x(k: int, *shape) -> torch.Tensor:
    """Worker k's input: the same on every worker that computes it."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + k),
                       dtype=torch.float64)


def _w(k: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(900 + k),
                       dtype=torch.float64)


def _close(a, b, what):
    assert torch.allclose(a, b, atol=1e-10), (what, a, b)


def _usable(n):
    """The job goes on after an error: a plain allreduce is right."""
    assert mps.allreduce(torch.ones(3), op=mps.Sum).tolist() == [float(n)] * 3


def integers(r, n):
    v = [torch.tensor([5 * k + 3, -7 * k - 1, 1]) for k in range(n)]
    total = sum(v)
    got = mps.allreduce(v[r], op=mps.Average)
    assert got.dtype == torch.int64
    assert got.tolist() == [int(t / n) for t in total.tolist()], got  # truncated mean
    pre = [(x.double() * 0.7).trunc().long() for x in v]
    want = (sum(pre).double() * 1.5).trunc().long()
    got = mps.allreduce(v[r].int(), op=mps.Sum, prescale_factor=0.7, postscale_factor=1.5)
    assert got.dtype == torch.int32 and got.tolist() == want.tolist(), (got, want)
    rs = mps.reducescatter(torch.tensor([3, 4, 5, 7]) * (r + 1), op=mps.Average)
    full = (torch.tensor([3, 4, 5, 7]) * sum(range(1, n + 1))).double() / n
    rows = [4 // n + (1 if k < 4 % n else 0) for k in range(n)]
    start = sum(rows[:r])
    assert rs.tolist() == full.trunc().long()[start:start + rows[r]].tolist(), rs


def mismatches(r, n):
    HIE = mps.HorovodInternalError
    cases = [
        (lambda: mps.allreduce(torch.zeros(2 + (r == n - 1))), "Mismatched allreduce tensor shapes"),
        (lambda: mps.allgather(torch.zeros(2, 2 + (r == 1))), "dimension 1"),
        (lambda: mps.allgather(torch.zeros(2, dtype=torch.float32 if r else torch.float64)),
         "Mismatched data types"),
        (lambda: mps.broadcast(torch.zeros(2), root_rank=r), "root ranks"),
        (lambda: mps.broadcast(torch.zeros(2 + r), root_rank=0), "Mismatched broadcast tensor shapes"),
        (lambda: mps.alltoall(torch.zeros(n, dtype=torch.int32 if r else torch.int64)),
         "Mismatched data types"),
        (lambda: mps.reducescatter(torch.zeros(n + r)), "Mismatched reducescatter tensor shapes"),
        (lambda: mps.allreduce(torch.zeros(2), op=mps.Sum if r else mps.Max), "reduction operation"),
        (lambda: mps.allreduce(torch.zeros(2), prescale_factor=1.0 + r), "prescale"),
        (lambda: mps.allreduce(torch.zeros(2)) if r else mps.allgather(torch.zeros(2)),
         "Mismatched collective operations"),
        (lambda: mps.reducescatter(torch.zeros(4), op=mps.Max), "only supports AVERAGE and SUM"),
    ]
    for fn, match in cases:
        e = _raises(HIE, fn, match)
        assert isinstance(e, RuntimeError)
        _usable(n)
    # An argument error on one worker: it raises its own error, the others learn of it.
    bad = torch.tensor([n + 1] + [0] * (n - 1)) if r == 0 else None
    if r == 0:
        _raises(ValueError, lambda: mps.alltoall(torch.zeros(n), splits=bad), "splits")
    else:
        _raises(HIE, lambda: mps.alltoall(torch.zeros(n)), "invalid arguments")
    _usable(n)
    # Two collectives with the same name in flight: Horovod's ValueError, before any exchange.
    h = mps.allreduce_async(torch.ones(2), name="twice")
    _raises(ValueError, lambda: mps.allreduce_async(torch.ones(2), name="twice"), "in flight")
    assert mps.synchronize(h).tolist() == [1.0, 1.0]
    assert mps.synchronize(12345) is None
    _raises(ValueError, lambda: mps.poll(12345), "was not created")
    _raises(ValueError, lambda: mps.allreduce(torch.tensor([True])), "not supported")
    _raises(NotImplementedError, lambda: mps.allreduce(torch.ones(1), op=mps.Adasum), "Adasum")
    _usable(n)


def gradients(r, n):
    # allreduce: backward = allreduce of the gradient with the same op.
    for op, scale in ((mps.Average, 1.0 / n), (mps.Sum, 1.0)):
        x = _x(r, 4).requires_grad_()
        y = mps.allreduce(x, op=op, prescale_factor=2.0)
        _close(y.detach(), 2.0 * scale * sum(_x(k, 4) for k in range(n)), "allreduce")
        (y * _w(r, 4)).sum().backward()
        _close(x.grad, 2.0 * scale * sum(_w(k, 4) for k in range(n)), "allreduce grad")
    xs = [_x(r, 3).requires_grad_(), _x(r, 2, 2).requires_grad_()]
    ys = mps.grouped_allreduce(xs, op=mps.Sum)
    sum(((y * (i + 1)).sum() for i, y in enumerate(ys))).backward()
    _close(xs[1].grad, torch.full((2, 2), float(2 * n), dtype=torch.float64), "grouped grad")
    # allgather (rows differ per worker): backward averages, then takes this worker's rows.
    rows = [k + 1 for k in range(n)]
    x = _x(r, rows[r], 2).requires_grad_()
    y = mps.allgather(x)
    _close(y.detach(), torch.cat([_x(k, rows[k], 2) for k in range(n)]), "allgather")
    (y * _w(r, sum(rows), 2)).sum().backward()
    mean_w = sum(_w(k, sum(rows), 2) for k in range(n)) / n
    _close(x.grad, mean_w[sum(rows[:r]):sum(rows[:r + 1])], "allgather grad")
    # broadcast: the averaged gradient on the root, zeros elsewhere.
    root = n - 1
    x = _x(r, 3).requires_grad_()
    y = mps.broadcast(x, root_rank=root)
    _close(y.detach(), _x(root, 3), "broadcast")
    (y * _w(r, 3)).sum().backward()
    want = sum(_w(k, 3) for k in range(n)) / n if r == root else torch.zeros(3, dtype=torch.float64)
    _close(x.grad, want, "broadcast grad")
    # alltoall with splits: worker k sends k+1+j rows to worker j; backward sends back.
    splits = {k: [k + 1 + j for j in range(n)] for k in range(n)}
    x = _x(r, sum(splits[r])).requires_grad_()
    y, got_splits = mps.alltoall(x, splits=torch.tensor(splits[r]))
    parts = {k: torch.split(_x(k, sum(splits[k])), splits[k]) for k in range(n)}
    _close(y.detach(), torch.cat([parts[k][r] for k in range(n)]), "alltoall")
    assert got_splits.tolist() == [splits[k][r] for k in range(n)]
    (y * _w(r, y.shape[0])).sum().backward()
    back = [torch.split(_w(j, sum(splits[k][j] for k in range(n))),
                        [splits[k][j] for k in range(n)])[r] for j in range(n)]
    _close(x.grad, torch.cat(back), "alltoall grad")
    # reducescatter Sum: backward = allgather of the gradient times the number of workers.
    x = _x(r, 2 * n + 1).requires_grad_()
    y = mps.reducescatter(x, op=mps.Sum)
    counts = [2 + (1 if k == 0 else 0) for k in range(n)]
    start = sum(counts[:r])
    _close(y.detach(), sum(_x(k, 2 * n + 1) for k in range(n))[start:start + counts[r]], "rs")
    (y * _w(r, counts[r])).sum().backward()
    _close(x.grad, n * torch.cat([_w(k, counts[k]) for k in range(n)]), "reducescatter grad")


def optimizer_over_a_set(r, n, ps, members):
    """BSP on the ring averages a process set's gradients over the set (Horovod's
    DistributedOptimizer(process_set=)); every other policy refuses, naming itself."""
    model = torch.nn.Linear(2, 1)
    make = lambda: mps.DistributedOptimizer(  # noqa: E731
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        process_set=ps)
    if mps.config().policy != "bsp":
        _raises(ValueError, make, "policy=")
        return
    if r not in members:
        # Horovod: on a worker outside the set the optimizer is a plain one (local steps,
        # no collective).
        opt = make()
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        before = model.weight.detach().clone()
        opt.step()
        _close(model.weight.detach().double(), (before - 0.1).double(), "step outside the set")
        opt.synchronize()
        return
    mps.broadcast_parameters(model.state_dict(), root_rank=members[0], process_set=ps)
    w0 = model.weight.detach().clone()
    opt = make()
    for step in range(3):
        opt.zero_grad()
        x = _x(10 * r + step, 4, 2).float()
        model(x).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert all(torch.equal(flat, o) for o in mps.allgather_object(flat, process_set=ps))
    assert not torch.equal(model.weight.detach(), w0)
    # One step by hand: the gradient averaged over the members only.
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    _close(model.weight.detach().double(), (before - 0.1).double(), "set-averaged step")
    opt.synchronize()


def variants(r, n):
    h = mps.allgather_async(torch.full((r + 1,), float(r)))
    assert mps.synchronize(h).tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    a, b = mps.grouped_allgather([torch.tensor([r]), torch.tensor([[r, r]])])
    assert a.tolist() == list(range(n)) and b.shape == (n, 2)
    h = mps.grouped_allgather_async([torch.tensor([r])], name="ga")
    assert mps.synchronize(h)[0].tolist() == list(range(n))
    h = mps.reducescatter_async(torch.ones(n, 2), op=mps.Sum)
    assert mps.synchronize(h).tolist() == [[float(n)] * 2]
    outs = mps.grouped_reducescatter([torch.ones(n), 2 * torch.ones(n, 3)], op=mps.Sum)
    assert outs[0].tolist() == [float(n)] and outs[1].tolist() == [[2.0 * n] * 3]
    h = mps.grouped_reducescatter_async([torch.ones(n)], op=mps.Average)
    assert mps.synchronize(h)[0].tolist() == [1.0]
    # Sparse: every worker adds 1 at row r and 2 at row 0; the result stays sparse.
    t = torch.sparse_coo_tensor([[r, 0]], [1.0, 2.0], (n, )).coalesce()
    got = mps.synchronize(mps.sparse_allreduce_async(t, name="sp", op=mps.Sum))
    assert got.is_sparse and got.to_dense().tolist() == [2.0 * n + 1] + [1.0] * (n - 1)
    handle = mps.sparse_allreduce_async(t, name="sp", op=mps.Average)  # Horovod's callable
    want = torch.tensor([2.0 * n + 1] + [1.0] * (n - 1), dtype=torch.float64) / n
    _close(handle().to_dense().double(), want, "sparse average")


def process_sets(r, n):
    members = list(range(1, n))
    ps = mps.add_process_set(members)
    assert ps.process_set_id is not None and ps.size() == len(members)
    _raises(ValueError, lambda: mps.add_process_set(members), "duplicate")
    if r in members:
        assert ps.rank() == members.index(r) and ps.included()
        s = mps.allreduce(torch.tensor([float(r)]), op=mps.Sum, process_set=ps)
        assert s.tolist() == [float(sum(members))]
        g = mps.allgather(torch.tensor([r]), process_set=ps)
        assert g.tolist() == members
        b = mps.broadcast(torch.tensor([r]), root_rank=n - 1, process_set=ps)
        assert b.tolist() == [n - 1]
        _raises(ValueError, lambda: mps.broadcast(torch.tensor([r]), root_rank=0,
                                                  process_set=ps), "invalid root rank")
        assert mps.broadcast_object({"r": r}, root_rank=n - 1, process_set=ps) == {"r": n - 1}
        model = torch.nn.Linear(2, 1)
        mps.broadcast_parameters(model.state_dict(), root_rank=members[0], process_set=ps)
        mps.barrier(process_set=ps)
    else:
        _raises(ValueError, lambda: mps.allreduce(torch.ones(1), process_set=ps), "not a member")
    optimizer_over_a_set(r, n, ps, members)
    _usable(n)
    assert mps.remove_process_set(ps) and not mps.remove_process_set(ps)
    assert mps.global_process_set.process_set_id == 0
    _usable(n)


def joined(r, n):
    """Worker 0 joins first; the others run collectives (a grouped one too), then join."""
    if r == 0:
        last = mps.join()
    else:
        assert mps.allreduce(torch.ones(2), op=mps.Sum).tolist() == [float(n - 1)] * 2
        assert mps.allreduce(torch.tensor([3 * n]), op=mps.Average).tolist() == [3 * (n - 1)]
        # a group: zeros into each of its data steps (float32 fused, float64 apart)
        ys = mps.grouped_allreduce([torch.ones(3), torch.full((2,), 2.0),
                                    torch.ones(1, dtype=torch.float64)], op=mps.Sum)
        assert [y.tolist() for y in ys] == [[n - 1.0] * 3, [2.0 * (n - 1)] * 2, [n - 1.0]], ys
        # Horovod 0.28.1 answers these with an error while a worker has joined.
        _raises(mps.HorovodInternalError, lambda: mps.allgather(torch.tensor([r, r])),
                "Allgather is not supported with Join")
        _raises(mps.HorovodInternalError,
                lambda: mps.broadcast(torch.ones(1), root_rank=n - 1),
                "Broadcast is not supported with Join")
        mps.barrier()
        last = mps.join()
    # The workers that join last are the others, at about the same time: one of them.
    assert last in range(1, n) and last == mps.broadcast_object(last, root_rank=0), last
    _usable(n)


def optimizer_details(r, n):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    dopt = mps.DistributedOptimizer(opt)  # no named_parameters: Horovod allows it
    assert len(dopt._parameter_names) == 2
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    mps.broadcast_optimizer_state(dopt, root_rank=0)
    assert dopt.param_groups[0]["lr"] == 0.1, dopt.param_groups  # the wrapper sees root's
    assert all(p.grad is not None for p in model.parameters())
    dopt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    dopt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dopt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), caught
    dopt.synchronize()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert all(torch.equal(flat, o) for o in mps.allgather_object(flat))


def sparse_and_early(r, n, early):
    """SparseAdam's gradients stay sparse (Horovod's sparse allreduce); an optimizer built
    before init() works at its first step; a second optimizer in the process."""
    emb = torch.nn.Embedding(5, 3, sparse=True)
    mps.broadcast_parameters(emb.state_dict(), root_rank=0)
    opt = mps.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())
    opt.zero_grad()
    emb(torch.tensor([r, 4])).sum().backward()
    assert emb.weight.grad.is_sparse
    opt.step()
    assert emb.weight.grad.is_sparse
    want = torch.zeros(5, 3)
    for k in range(n):
        want[k] += 1.0 / n
        want[4] += 1.0 / n
    _close(emb.weight.grad.to_dense().double(), want.double(), "sparse grad")
    # sparse_as_dense: a dense allreduce, then sparse again for SparseAdam (Horovod's).
    emb2 = torch.nn.Embedding(5, 3, sparse=True)
    dense_opt = mps.DistributedOptimizer(torch.optim.SparseAdam(emb2.parameters(), lr=0.1),
                                         named_parameters=emb2.named_parameters(),
                                         sparse_as_dense=True)
    dense_opt.zero_grad()
    emb2(torch.tensor([r, 4])).sum().backward()
    dense_opt.step()
    assert emb2.weight.grad.is_sparse
    _close(emb2.weight.grad.to_dense().double(), want.double(), "sparse-as-dense grad")
    model, dopt = early
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(2):
        dopt.zero_grad()
        model(_x(r, 4, 3).float()).sum().backward()
        dopt.step()
    dopt.synchronize()
    for m in (emb, model):
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        assert all(torch.equal(flat, o) for o in mps.allgather_object(flat))


def two_optimizers(r, n):
    """Two models, two DistributedOptimizers stepped in turn, uneven step counts ending in
    join(): the second follows the first's rounds, so the workers never mix their
    aggregations, and both models end equal everywhere."""
    torch.manual_seed(5)
    models = [torch.nn.Linear(3, 2), torch.nn.Linear(4, 1)]
    opts = []
    for m in models:
        mps.broadcast_parameters(m.state_dict(), root_rank=0)
        opts.append(mps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                             named_parameters=m.named_parameters()))
    for i in range(6 + 3 * r):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            m(_x(10 * r + i, 2, m.in_features).float()).pow(2).sum().backward()
            opt.step()
        if i % 3 == 2:
            mps.allreduce(torch.ones(1), name=f"metric{i}")  # a script's own collective
    mps.join()
    for m in models:
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        assert all(torch.equal(flat, o) for o in mps.allgather_object(flat)), m


def dropped_optimizers(r, n):
    """An optimizer the script dropped (with its model) takes part in nothing after: it is
    freed, the next one made does not follow it, and join() runs only the live ones; the
    live model ends equal everywhere."""
    import weakref

    from mpsync.torch import _runtime

    def train(steps, seed):
        m = torch.nn.Linear(3, 1)
        mps.broadcast_parameters(m.state_dict(), root_rank=0)
        opt = mps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                       named_parameters=m.named_parameters())
        for i in range(steps):
            opt.zero_grad()
            m(_x(seed + 10 * r + i, 2, 3).float()).sum().backward()
            opt.step()
        return m, opt

    live = _runtime.worker_context("test").optimizers
    before = live.live()
    gone = weakref.ref(train(2, 0)[1])  # stepped, never synchronized, dropped
    m, opt = train(3, 50)
    assert gone() is None, "a dropped optimizer is still held"
    assert opt._leader is None or any(opt._leader is o for o in before), opt._leader
    assert [o for o in live.live() if not any(o is b for b in before)] == [opt]
    mps.join()
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    assert all(torch.equal(flat, o) for o in mps.allgather_object(flat))


def sync_batch_norm(r, n):
    bn = mps.SyncBatchNorm(3, momentum=0.5).double()
    ref = torch.nn.BatchNorm1d(3, momentum=0.5).double()
    x = _x(r, 4 + r, 3).requires_grad_()
    y = bn(x)
    (y * _w(r, 4 + r, 3)).sum().backward()
    xs = [_x(k, 4 + k, 3).requires_grad_() for k in range(n)]
    ys = ref(torch.cat(xs))
    (ys * torch.cat([_w(k, 4 + k, 3) for k in range(n)])).sum().backward()
    start = sum(4 + k for k in range(r))
    _close(y.detach(), ys.detach()[start:start + 4 + r], "SyncBatchNorm")
    _close(x.grad, xs[r].grad, "SyncBatchNorm grad")
    _close(bn.running_var, ref.running_var, "SyncBatchNorm running_var")
    # Each worker's weight gradient is its own loss's; their sum is the single-process one.
    _close(mps.allreduce(bn.weight.grad, op=mps.Sum), ref.weight.grad, "SyncBatchNorm dw")


def main():
    policy = _arg("policy", "bsp")
    early_model = torch.nn.Linear(3, 2)
    early = (early_model, mps.DistributedOptimizer(
        torch.optim.SGD(early_model.parameters(), lr=0.1)))  # before init, as Horovod allows
    mps.init(policy=policy, topology="ring", backend="mpi", server="colocated", deadline=30)
    mps.init()  # idempotent, as Horovod's
    r, n = mps.rank(), mps.size()
    checks = [integers, mismatches, gradients, variants, process_sets, joined, sync_batch_norm,
              two_optimizers]
    if _arg("optimizer", "yes") == "yes":
        checks += [optimizer_details, lambda r, n: sparse_and_early(r, n, early),
                   dropped_optimizers]
    trace = _arg("timeline", "")
    for check in checks:
        if check is optimizer_details and trace:
            mps.start_timeline(trace)  # Horovod's names on mpsync's own timeline
        check(r, n)
        if check is optimizer_details and trace:
            mps.stop_timeline()
        print(f"CHECK-OK {getattr(check, '__name__', check)} rank={r}", flush=True)
    mps.shutdown()
    print(f"SEMANTICS-OK rank={r}", flush=True)


def deadline():
    """A collective's set-up is bounded: worker 0's first barrier gives up at the deadline
    naming worker 1, which arrives late; its barrier pairs with worker 0's next one (unnamed
    collectives pair in order again after one was withdrawn)."""
    import time

    mps.init(policy="bsp", topology="ring", backend="mpi", server="colocated", deadline=3)
    r, n = mps.rank(), mps.size()
    if r == 0:
        t0 = time.monotonic()
        e = _raises(mps.CollectiveTimeout, mps.barrier, "no word from worker 1")
        assert isinstance(e, mps.HorovodInternalError) and "barrier" in str(e), e
        assert 3.0 <= time.monotonic() - t0 < 10.0
        mps.barrier()
    else:
        time.sleep(4.5)
        mps.barrier()
    _usable(n)
    mps.shutdown()
    print(f"DEADLINE-OK rank={r}", flush=True)
