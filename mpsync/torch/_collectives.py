"""The machinery under :mod:`mpsync.torch.mpi_ops`: reduce ops, bounded waits that keep
answering the state server, and :class:`UserOps`, the script's collectives over one set of
workers (all of them, or a process set).

Every collective runs in two steps, like a request to Horovod's coordinator and its answer:

1. a small allgather of one int64 record per worker on the ``meta`` communicator
   (:mod:`~mpsync.torch._metadata`): kind, dtype, shape, reduce op, scale factors, root,
   name; every worker checks the records with the same pure function, so a mismatch raises
   :class:`~mpsync.torch.HorovodInternalError` with the same message on every worker before
   any data moves, and the next collective runs normally;
2. the data collective on the ``comm`` communicator (:mod:`~mpsync.torch._moves`), started
   only once the records are in.

Collectives start their data step in the order they were called (a FIFO), so non-blocking
collectives on ``comm`` are matched in the same order on every worker, even when a script
synchronizes its handles in another order.  A worker inside ``join()`` answers each record
exchange with a ``JOINED`` record and takes part in the data step (zeros into reductions,
Horovod's join semantics; see :mod:`~mpsync.torch.joining`).
"""

from __future__ import annotations

import collections
import itertools
import time

import numpy as np
import torch

from mpsync.torch import _metadata as meta
from mpsync.torch._wait import poll_until_done
from mpsync.torch.exceptions import HorovodInternalError

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "reduce_op", "UserOps",
           "wait_while_stepping", "AdasumRefused", "DTYPES"]

# Horovod's values, so ``op=horovod.torch.Average`` means the same here.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}
# dtype codes carried in the records (index in this tuple).
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
          torch.complex128)
_DTYPE_NAMES = [str(d).replace("torch.", "") for d in DTYPES]


class AdasumRefused(NotImplementedError, ValueError):
    """op=Adasum: Horovod raises NotImplementedError where it cannot run Adasum; mpsync never
    can (a ValueError too, what earlier mpsync versions raised)."""


def reduce_op(average=None, op=None) -> int:
    """Horovod's rule: ``op`` wins; the deprecated ``average`` flag maps to Average/Sum;
    neither means Average.  Adasum is refused with what to use instead."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduce op {op!r}; use Average, Sum, Min, Max or Product")
    if op == Adasum:
        raise AdasumRefused("op=Adasum is not supported by mpsync; use op=Average (Adasum "
                            "needs Horovod's own DistributedOptimizer: run the script on "
                            "horovod.torch)")
    return op


# A script's collective that has waited this long while a policy with local steps runs:
# the others may be inside an aggregation this worker has not been told about yet (they
# finished their loop at another point of the sync schedule), so it starts taking part.
_IDLE_AFTER_S = 0.2


def wait_while_stepping(test, *, deadline: float, what: str, idle=None, watch=None,
                        seq: int = 0) -> None:
    """``test()`` until True, within ``deadline``; after ``_IDLE_AFTER_S`` each poll also runs
    ``idle()`` (the strategies' idle iterations: ask the server, aggregate on SYNC).
    ``watch`` (a :class:`~mpsync.torch._wait.PeerWatch`) names the workers that never
    reached collective ``seq`` when the deadline passes."""
    if idle is None:
        poll_until_done(test, deadline=deadline, what=what, watch=watch, seq=seq, sleep=1e-4,
                        spin_for=2e-3)
        return
    try:
        poll_until_done(test, deadline=_IDLE_AFTER_S, what=what, watch=None, seq=seq,
                        sleep=1e-4, spin_for=2e-3)
        return
    except TimeoutError:
        pass
    start = time.monotonic()
    announced = False
    while not test():
        if not idle():
            time.sleep(1e-3)
        waited = time.monotonic() - start
        if watch is not None and not announced and waited > min(1.0, deadline / 4):
            watch.announce(seq)
            announced = True
        if waited > deadline:
            if watch is not None:
                raise watch.timeout(what, seq, deadline)
            from mpsync.torch._wait import CollectiveTimeout

            raise CollectiveTimeout(what, deadline, [], why="which worker is missing is not "
                                    "known (this wait exchanges no notices)")


class _Op:
    """A collective in flight: waiting for the records, then for its data step.

    ``start(records)`` starts the data step and returns ``(test, finish)``; ``finish()``
    gives the result that ``synchronize(handle)`` returns."""

    def __init__(self, ops: "UserOps", what: str, name, start, local_error=None):
        self.ops, self.what, self.name, self._start = ops, what, name, start
        self.local_error = local_error
        self.records = None
        self.error: BaseException | None = None
        self._test = self._finish = None
        self.done = False
        self.result = None
        self.seq = 0  # the record exchange's number, the same on every member

    def begin_data(self, records: np.ndarray) -> None:
        self.records = records
        if self._start is None:  # a joined worker's round (joining) reads the records
            return
        msg = meta.mismatch(records, _DTYPE_NAMES, _OP_NAMES)
        if self.local_error is not None:
            self.error = self.local_error
        elif msg is not None:
            self.error = HorovodInternalError(msg)
        else:
            self._test, self._finish = self._start(records)

    def test_records(self) -> bool:
        self.ops.advance()
        return self.records is not None

    def test(self) -> bool:
        if self.done:
            return True
        self.ops.advance()
        if self.records is None:
            return False
        if self.error is None and not self._test():
            return False
        self.done = True
        self.ops.release(self.name)
        if self.error is None:
            self.result = self._finish()
        return True

    def wait(self):
        if not self.done:
            wait_while_stepping(self.test, deadline=self.ops.deadline, what=self.what,
                                idle=self.ops.idle, watch=self.ops.watch, seq=self.seq)
        if self.error is not None:
            raise self.error
        return self.result


class _Group:
    """Several collectives behind one handle (grouped ops, sparse allreduce)."""

    def __init__(self, parts: list, combine=list):
        self.parts, self.combine = parts, combine
        self.what = parts[0].what if parts else "group"

    def test(self) -> bool:
        return all([p.test() for p in self.parts])

    def wait(self):
        errors, results = [], []
        for p in self.parts:
            try:
                results.append(p.wait())
            except Exception as e:  # every part is waited for, then the first error raised
                errors.append(e)
        if errors:
            raise errors[0]
        return self.combine(results)


class _Done:
    """A result that is already there, behind a handle."""

    def __init__(self, result, what: str):
        self.result, self.what = result, what

    def test(self) -> bool:
        return True

    def wait(self):
        return self.result


class UserOps:
    """The script's collectives over the workers of ``comm`` (a ``Dup()`` reserved for them;
    the record exchanges get a ``Dup()`` of their own).  ``ranks``: the worker ranks of the
    members in ``comm``'s order (a process set); ``idle``: called while a collective waits
    (see :func:`wait_while_stepping`), True if it did something."""

    def __init__(self, comm, deadline: float, hvd=None, idle=None, ranks=None,
                 checked: bool = True, world_ranks=None):
        from mpsync.torch._wait import PeerWatch

        self.comm = comm
        self.meta = comm.Dup()
        self.watch = PeerWatch(comm.Dup(), world_ranks)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ranks = list(range(self.size)) if ranks is None else list(ranks)
        self.deadline = float(deadline)
        self.hvd = hvd  # kept for callers' signatures: every collective here is mpi4py
        self.idle = idle
        self.handles: dict[int, object] = {}
        self._ids = itertools.count(1)
        self._queue: collections.deque[tuple[_Op, object, np.ndarray]] = collections.deque()
        self._names: set[str] = set()
        self.exchanges = 0  # record exchanges started: the same count on every member
        # False: no record exchange, the data step starts at once (``mpsync bench allreduce``
        # measures what the check costs; reductions only, nothing else may be queued).
        self.checked = checked

    def free(self) -> None:
        """Release the communicators (a removed process set)."""
        for c in (self.meta, self.watch.comm, self.comm):
            c.Free()

    def keep(self, op) -> int:
        handle = next(self._ids)
        self.handles[handle] = op
        return handle

    # -- the record exchange ------------------------------------------------------------------
    def submit(self, what: str, name, rec: np.ndarray, start, local_error=None) -> _Op:
        """Post ``rec`` and queue the collective; raises ``local_error`` (after posting, so the
        others learn of it and raise too) or a duplicate in-flight ``name`` (before)."""
        if name is not None:
            if name in self._names:
                raise ValueError(f"{what}: requested a collective named {name!r} while another "
                                 f"one with that name is in flight (not yet synchronized); "
                                 f"use a different name")
            self._names.add(name)
        op = _Op(self, what, name, start, local_error)
        if not self.checked:
            if local_error is not None or self._queue:
                raise RuntimeError(f"{what}: unchecked collectives take valid reductions only")
            op.records = rec[None, :]
            op._test, op._finish = start(op.records)
            return op
        if local_error is not None:
            rec[meta.Field.INVALID] = 1
        self._post(op, rec)
        if local_error is not None:
            self.release(name)
            raise local_error
        return op

    def _post(self, op, rec: np.ndarray) -> None:
        from mpi4py import MPI

        rec = np.ascontiguousarray(rec, dtype=np.int64)
        out = np.empty((self.size, rec.size), dtype=np.int64)
        req = self.meta.Iallgather([rec, MPI.INT64_T], [out, MPI.INT64_T])
        self.exchanges += 1
        op.seq = self.exchanges
        self.watch.drain()
        self._queue.append((op, req, out))

    def advance(self) -> None:
        """Start the data step of every queued collective whose records are in, in order."""
        while self._queue:
            op, req, out = self._queue[0]
            if not req.Test():
                return
            self._queue.popleft()
            op.begin_data(out)

    def release(self, name) -> None:
        self._names.discard(name)

    def drain(self) -> None:
        """Wait until every queued collective has its records (before ``join``)."""
        while self._queue:
            op = self._queue[0][0]
            wait_while_stepping(lambda: (self.advance(), op.records is not None)[1],
                                deadline=self.deadline, what=op.what, idle=self.idle,
                                watch=self.watch, seq=op.seq)

    def _wait(self, req, what: str) -> None:
        wait_while_stepping(req.Test, deadline=self.deadline, what=what, idle=self.idle,
                            watch=self.watch, seq=self.exchanges)

    def exchange(self, rec: np.ndarray) -> _Op:
        """Post a record with no data step of its own (a joined worker's round): the
        returned op's ``test_records()`` says when every member's record is in."""
        op = _Op(self, "join", None, None)
        self._post(op, rec)
        return op

    def check(self, records: np.ndarray) -> str | None:
        return meta.mismatch(records, _DTYPE_NAMES, _OP_NAMES)


def make_user_ops(ctx) -> UserOps:
    """The global set's :class:`UserOps` (at ``init``: ``Dup()`` is collective)."""

    def idle() -> bool:
        stepped = False
        for opt in ctx.optimizers:
            stepped = opt.strategy.idle_step() or stepped
        return stepped

    return UserOps(ctx.workers.Dup(), ctx.config.deadline, None, idle,
                   world_ranks=ctx.world_ranks)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def name_of(name) -> str | None:
    return None if name is None else str(name)

