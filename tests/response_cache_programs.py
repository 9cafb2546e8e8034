"""Multi-rank programs for tests/test_response_cache.py: the response cache of named
negotiation on 2 workers of a co-located server (bsp, ring), and Horovod's negotiation
variables read at init.

Each part prints ``PART-OK <name> rank=<r>``; every value is checked against what each worker
computes alone from both workers' inputs, and every count of skipped exchanges is read from
the coordinator's stats (member 0, rank 0) or the worker's own (any rank).
"""

from __future__ import annotations

import time

import torch

import mpsync.torch as mps
from mpsync.config import Negotiation
from mpsync.torch import _moves, _runtime
from mpsync.torch.process_sets import ops_of


def _x(k: int, i: int, n: int = 4) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * (k + 1) + 10 * i


def _total(i: int, size: int, n: int = 4) -> torch.Tensor:
    return sum(_x(k, i, n) for k in range(size))


def _ops():
    return _runtime.worker_context("test").user_ops


def _delta(before: dict, ops=None) -> dict:
    after = (ops or _ops()).stats()
    return {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)}


def hits(r, n):
    """The second and third call of the same names skip the full exchange: every worker sends
    its entry's number, member 0 answers with it.  Allgathers with rows differing by worker
    are cached too, and broadcasts (Horovod's cache leaves them out)."""
    before = _ops().stats()
    for round_ in range(3):
        for i in range(4):
            got = mps.allreduce(_x(r, i), name=f"w.{i}", op=mps.Sum)
            assert torch.equal(got, _total(i, n)), (round_, i, got)
        rows = mps.allgather(torch.full((r + 1, 2), float(r)), name="rows")
        assert rows[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
        assert mps.broadcast(torch.full((2,), float(r)), root_rank=1, name="cast").tolist() \
            == [1.0, 1.0]
    d = _delta(before)
    assert d["requests"] == 18 and d["cache_hits"] == 12, d  # rounds 2 and 3: 4 + 1 + 1
    if r == 0:
        assert d["exchanges_skipped"] == 12 and d["exchanges_full"] == 6, d
        assert d["hits"] == 24, d  # both workers' requests


def shape_change(r, n):
    """A cached name submitted with another shape on one worker: the full exchange runs and
    both workers raise today's mismatch error; the entry is erased; the next collectives, the
    name among them, work, and it is cached again."""
    for _ in range(2):
        assert torch.equal(mps.allreduce(_x(r, 1), name="s.x", op=mps.Sum), _total(1, n))
    before = _ops().stats()
    try:
        mps.allreduce(_x(r, 1, 4 + r), name="s.x", op=mps.Sum)
        raise AssertionError("a shape mismatch on a cached name did not raise")
    except mps.HorovodInternalError as e:
        assert str(e) == ("Mismatched allreduce tensor shapes: worker 0 sent a tensor of shape "
                          "[4], but worker 1 sent a tensor of shape [5]"), e
    d = _delta(before)
    assert d["cache_hits"] == (1 if r == 0 else 0), d  # worker 1's record differs: in full
    if r == 0:
        assert d["erased"] == 1 and d["exchanges_skipped"] == 0, d
    assert torch.equal(mps.allreduce(_x(r, 2), name="s.next", op=mps.Sum), _total(2, n))
    before = _ops().stats()
    for _ in range(2):
        assert torch.equal(mps.allreduce(_x(r, 3), name="s.x", op=mps.Sum), _total(3, n))
    d = _delta(before)
    assert d["cache_hits"] == 1, d  # erased: in full once, then from the cache again
    if r == 0:
        assert d["exchanges_full"] == 1 and d["exchanges_skipped"] == 1, d


def deadline_and_stall(r, n):
    """A cached name one worker submits late is reported by the stall inspector and still
    completes; one it never submits fails at the deadline naming it, is withdrawn, and the
    next collectives -- the same cached name included -- complete."""
    ops = _ops()
    for _ in range(2):
        assert torch.equal(mps.allreduce(_x(r, 4), name="d.x", op=mps.Sum), _total(4, n))
    if r == 0:
        ops.coordinator.stall_after = 0.5
    if r == 1:
        time.sleep(1.5)
    before = ops.stats()
    assert torch.equal(mps.allreduce(_x(r, 4), name="d.x", op=mps.Sum), _total(4, n))
    assert _delta(before)["cache_hits"] == 1
    if r == 0:
        assert any(rep.get("d.x") == [1] for rep in ops.coordinator.stall_reports)
        ops.coordinator.stall_after = 15.0
    ops.deadline = 3.0  # the job's deadline stays longer: start-up on a loaded node
    if r == 0:
        try:
            mps.allreduce(_x(r, 4), name="d.x", op=mps.Sum)
            raise AssertionError("d.x completed without worker 1")
        except mps.CollectiveTimeout as e:
            assert "d.x" in str(e) and e.silent_ranks == [1], e
        _HOLD[0].send("go", dest=1)
    else:  # submits nothing until worker 0 has given up (outside negotiation)
        req = _HOLD[0].irecv(source=0)
        while not req.test()[0]:
            time.sleep(0.01)
    mps.barrier()
    ops.deadline = 30.0
    before = ops.stats()
    for _ in range(2):
        assert torch.equal(mps.allreduce(_x(r, 5), name="d.x", op=mps.Sum), _total(5, n))
    assert torch.equal(mps.allreduce(_x(r, 6), op=mps.Sum), _total(6, n))
    assert _delta(before)["cache_hits"] == 2  # d.x is still cached: both calls hit


def joined(r, n):
    """While worker 1 is joined a cached name is answered in full (zeros from the joined
    worker) and the cache is left as it was: after the join it hits again."""
    ops = _ops()
    for _ in range(2):
        mps.allreduce(_x(r, 7), name="j.x", op=mps.Sum)
    if r == 0:
        before = ops.stats()
        assert torch.equal(mps.allreduce(_x(r, 7), name="j.x", op=mps.Sum), _x(0, 7))
        d = _delta(before)
        assert d["exchanges_full"] == 1 and d["exchanges_skipped"] == 0, d
    assert mps.join() in range(n)
    before = ops.stats()
    assert torch.equal(mps.allreduce(_x(r, 8), name="j.x", op=mps.Sum), _total(8, n))
    d = _delta(before)
    assert d["cache_hits"] == 1, d
    if r == 0:
        assert d["exchanges_skipped"] == 1, d


def process_sets(r, n):
    """A process set has a cache of its own: a name cached on the set is not on the world."""
    sets = [mps.add_process_set([0]), mps.add_process_set([1])]
    mine = sets[r]
    set_ops = ops_of(mine, "test")
    for _ in range(2):
        assert torch.equal(mps.allreduce(_x(r, 9), name="p.x", op=mps.Sum, process_set=mine),
                           _x(r, 9))
    assert set_ops.stats()["exchanges_skipped"] == 1  # this worker is the set's member 0
    before = _ops().stats()
    assert torch.equal(mps.allreduce(_x(r, 9), name="p.x", op=mps.Sum), _total(9, n))
    assert _delta(before)["cache_hits"] == 0


def small_cache(r, n):
    """Capacity 2 over 3 names: least recently used entries are evicted, and a worker's hit
    on an entry member 0 evicted meanwhile (worker 1 submits the next name before it has
    heard the answer that evicts it) still runs with the right records."""
    ctx = _runtime.worker_context("test")
    ops = type(ctx.user_ops)(ctx.workers.Dup(), 30.0, negotiation=Negotiation(cache_capacity=2))

    def reduce(i, name):
        return _moves.start_allreduce(ops, _x(r, i), mps.Sum, 1.0, 1.0, None, name)

    for name in ("a", "b", "c", "a", "b"):
        assert torch.equal(reduce(1, name).wait(), _total(1, n)), name
    for _ in range(5):
        if r == 0:
            got = [reduce(2, "c").wait(), reduce(2, "a").wait()]
        else:  # "a" submitted before the answer to "c", which evicts it, is read
            pending = [reduce(2, "c"), reduce(2, "a")]
            got = [op.wait() for op in pending]
        assert all(torch.equal(g, _total(2, n)) for g in got), got
    counts = ops.stats()
    # Worker 1 hit "a" once more than worker 0: in the first round, where only it had "a".
    assert counts["cache_hits"] == (8 if r == 0 else 9), counts
    if r == 0:
        assert counts["evicted"] >= 3 and counts["cache_entries"] == 2, counts


_HOLD: list = []  # a communicator of the test's own, to hold a worker outside mpsync


def main():
    mps.init(policy="bsp", topology="ring", backend="mpi", server="colocated", deadline=30)
    r, n = mps.rank(), mps.size()
    _HOLD.append(_runtime.worker_context("test").workers.Dup())
    assert _ops().stats()["cache_capacity"] == 1024
    for part in (hits, shape_change, deadline_and_stall, joined, process_sets, small_cache):
        part(r, n)
        print(f"PART-OK {part.__name__} rank={r}", flush=True)
    mps.shutdown()


def from_environment():
    """HOROVOD_FUSION_THRESHOLD=64, HOROVOD_CYCLE_TIME=2.5, HOROVOD_CACHE_CAPACITY=0 (set by
    the test): no name is ever answered from a cache, and 16 allreduces of 32 bytes ready
    together run as 8 data steps of two."""
    mps.init(policy="bsp", topology="ring", backend="mpi", server="colocated", deadline=30)
    r, n = mps.rank(), mps.size()
    ops = _ops()
    assert ops.negotiation == Negotiation(fusion_bytes=64, cycle_ms=2.5, cache_capacity=0)
    if r == 0:
        assert ops.coordinator.fusion_bytes == 64 and ops.coordinator.cycle_s == 0.0025
    before = ops.stats()
    for _ in range(3):
        assert torch.equal(mps.allreduce(_x(r, 1), name="e.x", op=mps.Sum), _total(1, n))
    d = _delta(before)
    assert d["cache_hits"] == 0 and ops.stats()["cache_capacity"] == 0, d
    if r == 0:
        assert d["exchanges_skipped"] == 0 and d["exchanges_full"] == 3, d
    mps.barrier()
    execs = ops.execs
    handles = [mps.allreduce_async(_x(r, i), name=f"small.{i}", op=mps.Sum) for i in range(16)]
    time.sleep(0.5)  # every request is in before member 0 reads them
    for i, h in enumerate(handles):
        assert torch.equal(mps.synchronize(h), _total(i, n)), i
    assert ops.execs - execs == 8, ops.execs - execs
    print(f"ENV-OK rank={r}", flush=True)
    mps.shutdown()
