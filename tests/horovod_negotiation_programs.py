"""Multi-rank program for tests/test_horovod_negotiation.py: collectives matched by name on 2
workers of a co-located server (bsp, ring), as Horovod's coordinator matches them.

Each part prints ``PART-OK <name> rank=<r>``; every value is checked against what each worker
computes alone from both workers' inputs.
"""

from __future__ import annotations

import time

import torch

import mpsync.torch as mps
from mpsync.torch import _runtime


def _x(k: int, i: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float64) * (k + 1) + 10 * i


def _total(i: int, n: int) -> torch.Tensor:
    return sum(_x(k, i) for k in range(n))


def any_order(r, n):
    """Named async collectives submitted in opposite orders, across a barrier that one
    worker crosses with its collectives in flight; Horovod's results on every worker."""
    names = [f"grad.{i}" for i in range(6)]
    order = names if r == 0 else names[::-1]
    if r == 0:
        handles = {nm: mps.allreduce_async(_x(r, int(nm[-1])), name=nm, op=mps.Sum)
                   for nm in order}
        gathered = mps.allgather_async(torch.full((r + 1, 2), float(r)), name="rows")
        mps.barrier()
        cast = mps.broadcast_async(torch.full((3,), float(r)), root_rank=1, name="cast")
    else:
        mps.barrier()
        cast = mps.broadcast_async(torch.full((3,), float(r)), root_rank=1, name="cast")
        handles = {nm: mps.allreduce_async(_x(r, int(nm[-1])), name=nm, op=mps.Sum)
                   for nm in order}
        gathered = mps.allgather_async(torch.full((r + 1, 2), float(r)), name="rows")
    for nm in names[::-1] if r == 0 else names:  # synchronized in yet another order
        assert torch.equal(mps.synchronize(handles[nm]), _total(int(nm[-1]), n)), nm
    rows = mps.synchronize(gathered)
    assert rows[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)], rows
    assert mps.synchronize(cast).tolist() == [1.0] * 3
    # Horovod's duplicate-name error: worker 0 holds "dup" in flight across a barrier that
    # worker 1 reaches before it submits "dup"; the second "dup" raises on both.
    h = mps.allreduce_async(torch.ones(2), name="dup") if r == 0 else None
    mps.barrier()
    if r == 1:
        h = mps.allreduce_async(torch.ones(2), name="dup")
    try:
        mps.allreduce_async(torch.ones(2), name="dup")
        raise AssertionError("a second 'dup' in flight did not raise")
    except ValueError as e:
        assert "in flight" in str(e), e
    assert mps.synchronize(h).tolist() == [1.0, 1.0]


def error_in_sequence(r, n):
    """Worker 1 raises inside a sequence and skips its remaining collectives, as a failing
    test does; worker 0's pending one raises at the deadline naming worker 1, and the next
    collectives, named or not, succeed on both."""
    ops = _runtime.worker_context("test").user_ops
    ops.deadline = 3.0  # the job's deadline stays longer: start-up on a loaded node
    t0 = time.monotonic()
    try:
        mps.allreduce(_x(r, 0), name="seq.1")
        if r == 1:
            raise KeyError("a failing check on worker 1")
        mps.allreduce(_x(r, 1), name="seq.2")
        mps.allreduce(_x(r, 2), name="seq.3")
        raise AssertionError("seq.2 completed without worker 1")
    except KeyError:
        assert r == 1
    except mps.CollectiveTimeout as e:
        waited = time.monotonic() - t0
        assert r == 0 and "seq.2" in str(e) and "worker 1" in str(e), e
        assert e.silent_ranks == [1], e.silent_ranks
        assert 3.0 <= waited < 12.0, waited
    assert torch.equal(mps.allreduce(_x(r, 3), name="next.a", op=mps.Sum), _total(3, n))
    assert torch.equal(mps.allreduce(_x(r, 4), op=mps.Sum), _total(4, n))
    assert mps.allgather(torch.tensor([r]), name="next.b").tolist() == list(range(n))
    ops.deadline = 30.0


def stall_report(r, n):
    """A name one worker submits late is reported on worker 0 after the warning time (the
    stall report goes to stderr), and still completes before the deadline."""
    ops = _runtime.worker_context("test").user_ops
    if r == 0:
        ops.coordinator.stall_after = 0.5
    if r == 1:
        time.sleep(1.5)
    assert torch.equal(mps.allreduce(_x(r, 5), name="late", op=mps.Sum), _total(5, n))
    if r == 0:
        reports = ops.coordinator.stall_reports
        assert any(rep.get("late") == [1] for rep in reports), reports
        ops.coordinator.stall_after = 15.0


def fusion(r, n):
    """Small allreduces ready together share one data step (tensor fusion); with fusion off
    each has its own; the results are the same."""
    ops = _runtime.worker_context("test").user_ops
    for fused in (True, False):
        if r == 0:
            ops.coordinator.fusion_bytes = 64 << 20 if fused else 0
        mps.barrier()
        before = ops.execs
        handles = [mps.allreduce_async(_x(r, i), name=f"small.{i}", op=mps.Sum)
                   for i in range(16)]
        time.sleep(0.5)  # every request is in before member 0 reads them
        for i, h in reversed(list(enumerate(handles))):
            assert torch.equal(mps.synchronize(h), _total(i, n)), i
        steps = ops.execs - before
        assert steps == (1 if fused else 16), (fused, steps)


def gather_fusion(r, n):
    """Small allgathers of one shape on every worker, ready together, share one data step
    whatever their dtypes (a grouped allgather's parts too); ragged ones (each worker its own
    number of rows) run one by one; every result is each worker's tensors in worker order."""
    ops = _runtime.worker_context("test").user_ops

    def mine(k):
        return [torch.arange(6, dtype=torch.float64).view(2, 3) + 10 * k,
                torch.tensor([[k % 2 == 0, True]]), torch.full((3,), k + 0.5).bfloat16(),
                torch.arange(4, dtype=torch.int32) * (k + 1), torch.empty((0, 2))]

    want = [torch.cat([mine(k)[i] for k in range(n)]) for i in range(5)]
    for fused in (True, False):
        if r == 0:
            ops.coordinator.fusion_bytes = 64 << 20 if fused else 0
        mps.barrier()
        before = ops.execs
        handles = [mps.allgather_async(t, name=f"rows.{i}") for i, t in enumerate(mine(r))]
        time.sleep(0.5)  # every request is in before member 0 reads them
        got = [mps.synchronize(h) for h in handles]
        assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)), got
        assert ops.execs - before == (1 if fused else 5), (fused, ops.execs - before)
    mps.barrier()
    before = ops.execs
    got = mps.grouped_allgather(mine(r), name="grouped.rows")
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and ops.execs - before <= 5
    mps.barrier()
    before = ops.execs
    handles = [mps.allgather_async(torch.full((r + 1, 2), float(i)), name=f"ragged.{i}")
               for i in range(3)]
    time.sleep(0.5)
    for i, h in enumerate(handles):
        assert torch.equal(mps.synchronize(h), torch.full((n * (n + 1) // 2, 2), float(i)))
    assert ops.execs - before == 3, ops.execs - before


def unread_handles(r, n):
    """A collective whose handle is never synchronized leaves flight once it completes (as in
    Horovod): its name can be used again, while a name still waiting for the other worker is
    refused as a duplicate, and that one too is free once the other worker has submitted it."""
    for _ in range(3):  # the same name, never read, three times over
        mps.allreduce_async(_x(r, 7), name="never.read", op=mps.Sum)
        mps.allgather_async(torch.tensor([r]), name="never.read.rows")
        assert torch.equal(mps.allreduce(_x(r, 8), name="after", op=mps.Sum), _total(8, n))
    if r == 0:
        mps.allreduce_async(_x(r, 9), name="one.side")
        try:
            mps.allreduce_async(_x(r, 9), name="one.side")
            raise AssertionError("a name in flight was accepted twice")
        except ValueError as e:
            assert "in flight" in str(e), e
    mps.barrier()
    if r == 1:
        mps.allreduce_async(_x(r, 9), name="one.side")
    mps.barrier()
    mps.allreduce(_x(r, 10), name="after.one.side")
    h = mps.allreduce_async(_x(r, 9), name="one.side", op=mps.Sum)
    assert torch.equal(mps.synchronize(h), _total(9, n))


def _fails_at_once(call, words: str) -> None:
    """``call()`` raises, naming ``words``, well before the 30 s deadline."""
    t0 = time.monotonic()
    try:
        call()
    except (mps.HorovodInternalError, ValueError) as e:
        assert words in str(e), e
    else:
        raise AssertionError(f"no error (expected one naming {words!r})")
    assert time.monotonic() - t0 < 10.0, time.monotonic() - t0


def grouped_as_one(r, n):
    """A grouped call is one negotiation entry: one request however many tensors (one cache
    entry number once seen); a worker that grouped another number of tensors, or called a
    single collective under the group's name, fails the group on every worker at once, and
    so does one worker's invalid first part (the others never wait for its later parts);
    the next collectives run."""
    ops = _runtime.worker_context("test").user_ops
    xs = [_x(r, i) for i in range(4)]
    for seen in (False, True):
        before = ops.stats()
        ys = mps.grouped_allreduce(xs, name="g.four", op=mps.Sum)
        assert all(torch.equal(y, _total(i, n)) for i, y in enumerate(ys)), ys
        after = ops.stats()
        assert after["requests"] - before["requests"] == 1, (before, after)
        assert after["cache_hits"] - before["cache_hits"] == int(seen), (before, after)
    _fails_at_once(lambda: mps.grouped_allreduce(xs[:2 + r], name="g.count"),
                   "grouped 2 tensors, but worker 1 grouped 3")
    single = (lambda: mps.allreduce(xs[0], name="g.kind")) if r else \
        (lambda: mps.grouped_allreduce(xs[:1], name="g.kind"))
    _fails_at_once(single, "worker 0 called a grouped collective, but worker 1 called "
                           "allreduce")
    first = torch.ones(()) if r == 1 else torch.ones(n)  # a 0-d tensor cannot be scattered
    _fails_at_once(lambda: mps.grouped_reducescatter([first, torch.ones(n), torch.ones(n)],
                                                     name="g.invalid"),
                   "at least one dimension" if r == 1 else "Mismatched reducescatter")
    assert torch.equal(mps.allreduce(_x(r, 5), name="g.after", op=mps.Sum), _total(5, n))
    got = mps.grouped_allgather([torch.tensor([r]), torch.full((r + 1, 2), r)])
    assert got[0].tolist() == list(range(n)) and got[1].shape == (n * (n + 1) // 2, 2), got


def main():
    mps.init(policy="bsp", topology="ring", backend="mpi", server="colocated", deadline=30)
    r, n = mps.rank(), mps.size()
    for part in (any_order, error_in_sequence, stall_report, fusion, gather_fusion,
                 unread_handles, grouped_as_one):
        part(r, n)
        print(f"PART-OK {part.__name__} rank={r}", flush=True)
    mps.shutdown()


def busy_outside_steps():
    """A worker that stepped its optimizer and then runs only its script's collectives for
    longer than the silent timeout plus the deadline (an evaluation between epochs, a test
    suite after its optimizer tests), or only a second optimizer's steps, is alive, not
    silent: the server must not abort the ring."""
    mps.init(policy="bsp", topology="ring", backend="mpi", server="colocated", deadline=3.0,
             silent_timeout=3.0)
    r, n = mps.rank(), mps.size()
    model = torch.nn.Linear(4, 2)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    # Fixed counts (the same on every worker), each loop at least 9 s: the server gives up
    # on silent workers after 3 s + 3 s.
    for i in range(450):
        assert torch.equal(mps.allreduce(_x(r, i), name=f"eval.{i % 50}", op=mps.Sum),
                           _total(i, n))
        time.sleep(0.02)
    # A second model's optimizer (a follower: only the first talks to the server) stepped
    # alone for as long, the first one's model done with.
    other = torch.nn.Linear(4, 2)
    follower = mps.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                        named_parameters=other.named_parameters())
    for _ in range(450):
        follower.zero_grad()
        other(torch.ones(3, 4)).sum().backward()
        follower.step()
        time.sleep(0.02)
    # Into the final join together: a worker already waiting there for the server while the
    # other, descheduled on a loaded machine, still finishes its loop would be the one case
    # of a worker silent for 3 s that this check is not about.
    mps.barrier()
    mps.shutdown()
    print(f"BUSY-OK rank={r}", flush=True)


def joins_in_call_order():
    """Member 0 joins first, then is busy for 0.5 s while worker 2 joins and, 0.1 s later,
    worker 1: the worker that joined last is worker 1, whose call came last, whatever order
    member 0's reads matched the waiting requests in."""
    from mpi4py import MPI

    from mpsync.torch import _negotiation as neg
    from mpsync.torch._coordinator import Channel, Coordinator
    from mpsync.torch._response_cache import ResponseCache

    comm = MPI.COMM_WORLD.Dup()
    r = comm.Get_rank()
    coordinator = Coordinator(comm, 3, stall_after=60.0, deadline=60.0) if r == 0 else None
    channel = Channel(comm, ResponseCache(0))
    comm.Barrier()
    time.sleep({0: 0.0, 1: 0.15, 2: 0.05}[r])
    channel.join()
    if r == 0:
        time.sleep(0.5)            # busy: the others' joins wait to be read together
    last, t0 = None, time.monotonic()
    while last is None and time.monotonic() - t0 < 30:
        if coordinator is not None:
            coordinator.step()
        for parts in channel.answers():
            if int(parts[0][0]) == neg.ALL_JOINED:
                last = int(parts[0][1])
        time.sleep(1e-3)
    comm.Barrier()
    print(f"JOINED-LAST rank={r} last={last}", flush=True)
