"""The machinery under :mod:`mpsync.torch.mpi_ops`: reduce ops, bounded waits that keep
answering the state server, and :class:`UserOps`, the script's collectives over one set of
workers (all of them, or a process set).

Every collective runs in two steps, like a request to Horovod's coordinator and its answer:

1. negotiation by name (:mod:`~mpsync.torch._negotiation`, its messages in
   :mod:`~mpsync.torch._coordinator`): the worker sends member 0 one int64 record (kind,
   dtype, shape, reduce op, scale factors, root; :mod:`~mpsync.torch._metadata`) under the
   collective's name; once every worker has submitted that name, in whatever order, member 0
   answers every worker with all the records.  Every worker checks them with the same pure
   function, so a mismatch raises :class:`~mpsync.torch.HorovodInternalError` with the same
   message on every worker before any data moves, and the next collective runs normally;
2. the data step on the ``comm`` communicator (:mod:`~mpsync.torch._moves`), started in the
   order of member 0's answers -- the same on every worker -- several small allreduces
   answered together sharing one buffer (tensor fusion).

A name this set has negotiated before, submitted again unchanged by every worker, skips the
exchange of records: each worker sends the number of its response cache entry, member 0
answers with that number, and the records come from every worker's copy of the cache
(:mod:`~mpsync.torch._response_cache`, Horovod's response cache).

A name some worker never submits fails at the deadline on the workers that did, naming the
missing workers, and is withdrawn, so it never disturbs the names after it.  A worker inside
``join()`` takes part in the answered collectives it has not submitted (zeros into
allreduces, Horovod's join semantics; see :mod:`~mpsync.torch.joining`).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from mpsync.torch import _metadata as meta
from mpsync.torch import _negotiation as neg
from mpsync.torch._response_cache import MISS
from mpsync.torch.dataplane.progress import engine
from mpsync.torch.dataplane.exceptions import HorovodInternalError
from mpsync.torch.dataplane.scratch import pool

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "reduce_op", "UserOps",
           "wait_while_stepping", "AdasumRefused", "DTYPES", "Parts", "Fusable", "scale_",
           "packed_allgather"]

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


# How often a waiter whose data moves on a lane still serves negotiation (member 0 answers
# the others' requests, every member starts the data steps answered meanwhile).
_SERVE_EVERY_S = 5e-4


def wait_while_stepping(test, *, deadline: float, what: str, idle=None, watch=None,
                        seq: int = 0, event=None, started=None) -> None:
    """``test()`` until True, within ``deadline``, through the progress engine
    (:meth:`~mpsync.torch.dataplane.progress.ProgressEngine.wait`: no sleeping while data
    moves); after ``_IDLE_AFTER_S`` it also runs ``idle()`` about every millisecond (the
    strategies' idle iterations: ask the server, aggregate on SYNC).  ``event`` (or a function
    giving it): the data step runs on a lane and sets it; ``started()``: whether the data step
    has started.  ``watch`` (a :class:`~mpsync.torch.dataplane.waiting.PeerWatch`) names the
    workers that never reached collective ``seq`` when the deadline passes."""
    engine().wait(test, deadline=deadline, what=what, watch=watch, seq=seq, event=event,
                  poll_every=_SERVE_EVERY_S, started=started, idle=idle,
                  idle_after=_IDLE_AFTER_S)


class _Op:
    """A collective in flight: waiting for its name to be negotiated, then for its data step.

    ``start(records)`` starts the data step and returns ``(test, finish)``; ``finish()``
    gives the result that ``synchronize(handle)`` returns.  ``fusion`` (a :class:`Fusable`):
    how it shares one data step with others."""

    def __init__(self, ops: "UserOps", what: str, name, start, local_error=None,
                 fusion=None):
        self.ops, self.what, self.name, self._start = ops, what, name, start
        self.local_error = local_error
        self.fusion = fusion
        self.records = None
        self.error: BaseException | None = None
        self._test = self._finish = None
        self.done = False
        self.abandoned = False  # its wait gave up; the data step still runs if it comes
        self.cancelled: list[int] | None = None  # member 0 withdrew it: who never submitted
        self.extended = False  # member 0 asked for one more deadline (see Negotiator.cancel)
        self.result = None
        self.seq = 0  # the data step's number, the same on every member

    def _checked(self, records: np.ndarray, known_good: bool = False) -> bool:
        """``known_good``: the records come from the response cache (they agreed when cached,
        and this worker's own is the one it submitted)."""
        self.records = records
        msg = None if known_good else meta.mismatch(records, _DTYPE_NAMES, _OP_NAMES)
        if self.local_error is not None:
            self.error = self.local_error
        elif msg is not None:
            self.error = HorovodInternalError(msg)
        return self.error is None

    def begin_data(self, records: np.ndarray, known_good: bool = False) -> None:
        if self._checked(records, known_good):
            self._test, self._finish = self._start(records)

    def test(self) -> bool:
        if self.done:
            return True
        self.ops.advance()
        return self.poll()

    def lane_event(self):
        """The event of the data step's lane call (None: not started, or not on a lane)."""
        return None if self.done else getattr(self._test, "event", None)

    def data_started(self) -> bool:
        return self.records is not None

    def poll(self) -> bool:
        """``test`` without advancing the negotiation."""
        if self.done:
            return True
        if self.records is None:
            return False
        if self.error is None and not self._test():
            return False
        self.done = True
        self.ops.release(self.name)
        if self.error is None and not self.abandoned:
            self.result = self._finish()
        return True

    def wait(self):
        while not self.done:
            try:
                wait_while_stepping(self.test, deadline=self.ops.deadline, what=self.what,
                                    idle=self.ops.idle, watch=self.ops.watch,
                                    seq=self.seq or self.ops.execs + 1,
                                    event=self.lane_event, started=self.data_started)
            except TimeoutError as timeout:
                if not self.ops.give_up(self, timeout):
                    continue  # member 0 asked for one more deadline
        if self.error is not None:
            raise self.error
        return self.result


class Fusable:
    """How a collective joins a fused data step (tensor fusion): ``source()`` is this
    worker's tensor to pack (read, never written); ``reduce(buf)`` starts the step on the
    packed buffer (an allgather: ``reduce(send, out, counts)``) and returns its ``test``;
    ``deliver(x)`` the result from this collective's piece ``x`` of the finished buffer.  A
    reduction's piece is scaled by ``prescale`` before the step and ``postscale`` after it
    (Horovod's arithmetic, :func:`scale_`)."""

    __slots__ = ("source", "reduce", "deliver", "prescale", "postscale")

    def __init__(self, source, reduce, deliver, prescale: float = 1.0,
                 postscale: float = 1.0):
        self.source, self.reduce, self.deliver = source, reduce, deliver
        self.prescale, self.postscale = prescale, postscale


def scale_(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` in ``x``'s dtype; integers go through float64 and truncate (Horovod)."""
    if factor == 1.0:
        return x
    if x.is_floating_point():
        return x.mul_(factor)
    return x.copy_((x.to(torch.float64) * factor).trunc().to(x.dtype))


def average_scales(op: int, dtype: torch.dtype, size: int, prescale: float,
                   postscale: float) -> tuple[float, float]:
    """The factors a reduction over ``size`` workers scales each worker's part by before
    the sum and the sum by after it: Horovod's arithmetic (``op=Average`` divides the
    postscale by ``size``), except that a float average over a power-of-two number of
    workers divides the prescale instead.  Scaling by a power of two is exact short of
    subnormal values, so the bits are the same; the copy a reduction makes anyway then does
    the scaling (:func:`pack_scaled`), and the pass over the result after the sum is saved."""
    if op != Average:
        return prescale, postscale
    if dtype in (torch.float32, torch.float64) and size & (size - 1) == 0:
        return prescale / size, postscale
    return prescale, postscale / size


# Up to this many tensors are packed into a buffer one ``torch.mul`` each, which scales them
# in the copy's pass; more are packed by one ``torch.cat`` and then scaled (a call per
# tensor would cost more than the pass it saves).
_PACK_SCALED_MAX = 16


def pack_scaled(xs: list, buf: torch.Tensor, factor: float) -> None:
    """``buf`` (flat, CPU) <- the tensors ``xs`` one after the other, times ``factor``
    (:func:`scale_`'s arithmetic): one pass over the bytes where the tensors are few and of
    a float dtype."""
    if factor == 1.0 or not buf.is_floating_point() or len(xs) > _PACK_SCALED_MAX:
        torch.cat([x.reshape(-1) for x in xs], out=buf)
        scale_(buf, factor)
        return
    offset = 0
    for x in xs:
        n = x.numel()
        torch.mul(x.reshape(-1), factor, out=buf[offset:offset + n])
        offset += n


def _scale_pieces(buf: torch.Tensor, pieces, factors: list) -> None:
    """Each piece of ``buf`` scaled by its factor: one pass over the buffer when they agree
    (the usual case: a group, or one optimizer's gradients, share them)."""
    if all(f == factors[0] for f in factors):
        scale_(buf, factors[0])
        return
    for piece, f in zip(pieces, factors):
        scale_(piece, f)


def _start_fused(ops: "UserOps", group: list, seq: int) -> None:
    """One data step for several allreduces: their tensors packed into one scratch buffer
    (one ``torch.cat``, straight from the callers' tensors), scaled, reduced in place; the
    first of them to complete scales the whole buffer and each copies its result out of it;
    the buffer goes back to the pool after the last one
    (:mod:`~mpsync.torch.dataplane.scratch`: a fresh buffer of this size would cost its page
    faults at every step).  Per tensor, only what cannot be shared is done one by one: a
    group of 4 took 111 us here before (a view, a copy and a scale each), 4 ranks on 2 cores
    pay it twice."""
    specs = [op.fusion for op in group]
    xs = [spec.source() for spec in specs]
    sizes = [x.numel() for x in xs]
    total = sum(sizes)
    buf = pool().take(total * xs[0].element_size(), xs[0].dtype)
    pieces = buf.split(sizes)
    factors = [spec.prescale for spec in specs]
    if all(f == factors[0] for f in factors):
        pack_scaled(xs, buf, factors[0])
    else:
        torch.cat([x.reshape(-1) for x in xs], out=buf)
        _scale_pieces(buf, pieces, factors)
    test = specs[0].reduce(buf)
    left, scaled = [len(group)], [False]
    where = buf.untyped_storage().data_ptr()

    def finish(i):
        try:
            if not scaled[0]:
                _scale_pieces(buf, pieces, [spec.postscale for spec in specs])
                scaled[0] = True
            result = specs[i].deliver(pieces[i].view(xs[i].shape))
            if isinstance(result, torch.Tensor) and \
                    result.untyped_storage().data_ptr() == where:
                result = pool().copy_of(result)  # the buffer goes back to the pool
            return result
        finally:
            left[0] -= 1
            if left[0] == 0:
                pool().give(buf)

    for i, op in enumerate(group):
        op._test, op._finish = test, (lambda i=i: finish(i))
        op.seq = seq


def _start_fused_allgather(ops: "UserOps", group: list, seq: int) -> None:
    """One data step for several allgathers whose every worker sends one shape (member 0
    fuses only those, :func:`~mpsync.torch._negotiation.fusion_groups`): see
    :func:`packed_allgather`; each op delivers its piece when it completes."""
    test, results = packed_allgather(ops, [op.fusion.source() for op in group],
                                     group[0].fusion.reduce)

    def finish(i, op):
        return op.fusion.deliver(results()[i])

    for i, op in enumerate(group):
        op._test, op._finish = test, (lambda i=i, op=op: finish(i, op))
        op.seq = seq


def packed_allgather(ops: "UserOps", xs: list, gather):
    """Allgather host tensors ``xs`` (every worker sends the same shapes) as one: each worker
    packs their bytes one after another, ``gather(send, out, counts)`` starts one allgather
    of the packed bytes, and each result is cut out of it -- every worker's piece, in worker
    order.  Returns ``(test, results)``; ``results()`` cuts them, once."""
    sizes = [x.numel() * x.element_size() for x in xs]
    width = sum(sizes)
    # (one cat of byte views, and numpy slices for the cutting: per tensor, each torch call
    # costs microseconds, a numpy slice a fraction of one)
    send = torch.cat([x.reshape(-1).view(torch.uint8) for x in xs])
    out = np.empty(ops.size * width, dtype=np.uint8)
    test = gather(send.numpy(), out, np.full(ops.size, width, dtype=np.int64))
    cut: list = []

    def results() -> list:
        if not cut:
            grid, at = out.reshape(ops.size, width), 0
            for x, n in zip(xs, sizes):
                # (a copy, flat: aligned for any dtype, an empty piece and one worker too)
                piece = torch.from_numpy(grid[:, at:at + n].copy().reshape(-1))
                cut.append(piece.view(x.dtype).view(ops.size * x.shape[0], *x.shape[1:]))
                at += n
        return cut

    return test, results


class Parts:
    """Collects a grouped call's parts: pass its ``submit`` to a ``start_*`` of
    :mod:`~mpsync.torch._moves` instead of :meth:`UserOps.submit`, then hand ``parts`` to
    :meth:`UserOps.submit_group`."""

    def __init__(self):
        self.parts: list[_Part] = []

    def submit(self, what: str, name, rec: np.ndarray, start, local_error=None,
               fusion=None) -> "_Part":
        if local_error is not None:
            rec[meta.Field.INVALID] = 1  # the others learn of it and fail the group too
        part = _Part(what, rec, start, local_error, fusion)
        self.parts.append(part)
        return part


class _Part:
    """One tensor of a grouped call: what its collective alone would have submitted; its
    data step is started by the group's (:func:`_start_group`)."""

    __slots__ = ("what", "rec", "start", "local_error", "fusion", "records", "_test",
                 "_finish", "seq")

    def __init__(self, what: str, rec: np.ndarray, start, local_error, fusion):
        self.what, self.rec, self.start = what, rec, start
        self.local_error, self.fusion = local_error, fusion
        self.records = self._test = self._finish = None
        self.seq = 0


class _GroupTest:
    """The test of a grouped call's data steps (one test per step: fused parts share one):
    True once every step's is.  Only the first step still in flight is tested: one ``Test``
    makes Open MPI progress every request of the rank, so testing each step at every poll
    only multiplied the calls (and, with ``mpi_yield_when_idle``, the yields inside them;
    4 ranks, a group of 4 fused into one step: 1.73 ms a call against 0.79 for one
    allreduce of the same bytes).  Every worker completes the steps in the order they
    started.  ``event`` is the lane event of that first step (the waiter blocks on it while
    its bytes move on a lane, as it would for the step alone)."""

    __slots__ = ("pending",)

    def __init__(self, tests: list):
        self.pending = tests

    def __call__(self) -> bool:
        pending = self.pending
        while pending and pending[0]():
            del pending[0]
        return not pending

    @property
    def event(self):
        return getattr(self.pending[0], "event", None) if self.pending else None


def _start_group(ops: "UserOps", parts: list, records: np.ndarray):
    """A grouped call's data steps, in order: its parts fused as member 0's threshold says
    (:func:`~mpsync.torch._negotiation.group_steps`), each other part alone; ``(test,
    finish)``, ``finish()`` giving the parts' results in order."""
    part_records, steps = _group_plan(records, ops.answered_fusion_bytes)
    tests = []
    for step in steps:
        members = [parts[i] for i in step]
        for i in step:
            parts[i].records = part_records[i]
        if len(members) > 1:
            if _kind(part_records[step[0]]) == meta.ALLGATHER:
                _start_fused_allgather(ops, members, 0)
            else:
                _start_fused(ops, members, 0)
        else:
            members[0]._test, members[0]._finish = members[0].start(part_records[step[0]])
        tests.append(members[0]._test)
    return _GroupTest(tests), lambda: [p._finish() for p in parts]


def _group_plan(records: np.ndarray, threshold: int) -> tuple[list, list]:
    """A grouped call's parts' records (:func:`~mpsync.torch._metadata.group_parts`) and its
    data steps (:func:`~mpsync.torch._negotiation.group_steps`), kept by the records' bytes:
    a loop submits the same group at every step, and cutting it (a fusion key per part, each
    a few numpy calls) cost more than looking its bytes up.  The parts are views of a copy
    kept with them, never of the caller's array."""
    key = (threshold, records.shape, records.tobytes())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        parts = meta.group_parts(records.copy())
        plan = _PLANS[key] = (parts, neg.group_steps(parts, threshold))
    return plan


_PLANS: dict = {}


def _kind(records: np.ndarray) -> int:
    """The kind of collective the active members' records describe."""
    return int(meta.reference(records)[meta.Field.KIND])


class _Group:
    """Several collectives behind one handle (sparse allreduce)."""

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
    negotiation gets a ``Dup()`` of its own).  ``ranks``: the worker ranks of the members in
    ``comm``'s order (a process set); ``idle``: called while a collective waits (see
    :func:`wait_while_stepping`), True if it did something.

    A data step of ``THREAD_MIN_BYTES`` or more (an allreduce's: ``REDUCE_THREAD_MIN_BYTES``;
    the same size on every member) runs as a blocking call on the progress engine's lane of
    ``lane`` (a ``Dup()``), everything else non-blocking on ``comm``; the waits go through
    the engine either way.

    Collectives are matched by name (:mod:`~mpsync.torch._negotiation`): an unnamed one is
    ``noname.<n>``, this set's n-th unnamed collective, matched with the others' in order
    (as Horovod's handle-numbered names are).  ``negotiation``: the fusion threshold, cycle
    time and response cache capacity (:class:`mpsync.config.Negotiation`, Horovod's defaults
    if None); ``fusion_bytes`` overrides its threshold (0 turns tensor fusion off).  The
    cache capacity is member 0's on every member (their caches must stay the same).
    ``stall_after`` (default: half the deadline, at most Horovod's 60 s) is when member 0
    reports the names some workers have not submitted.  ``heartbeat``: called at every
    submission, tells the state server this worker is alive (rate-limited by the client)."""

    def __init__(self, comm, deadline: float, hvd=None, idle=None, ranks=None,
                 checked: bool = True, world_ranks=None, fusion_bytes: int | None = None,
                 stall_after: float | None = None, heartbeat=None, negotiation=None):
        from mpsync.config import Negotiation
        from mpsync.torch._coordinator import Channel, Coordinator
        from mpsync.torch._response_cache import ResponseCache
        from mpsync.torch.dataplane.waiting import PeerWatch

        self.comm = comm
        self.meta = comm.Dup()
        # Large data steps run blocking on the progress engine's lane of this communicator.
        self.lane = comm.Dup()
        self.watch = PeerWatch(comm.Dup(), world_ranks)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ranks = list(range(self.size)) if ranks is None else list(ranks)
        self.world_ranks = list(world_ranks) if world_ranks is not None else self.ranks
        self.deadline = float(deadline)
        self.hvd = hvd  # kept for callers' signatures: every collective here is mpi4py
        self.idle = idle
        self.heartbeat = heartbeat
        self.handles: dict[int, object] = {}
        self._ids = itertools.count(1)
        self._names: set[str] = set()      # in flight (submitted, not yet completed)
        self._waiting: dict[str, _Op] = {}  # submitted, not yet answered
        self._unnamed = 0                  # unnamed collectives submitted
        self._running: list[_Op] = []      # abandoned ops whose data step still runs
        # Data steps started and not yet seen complete: polled on every advance, so a name
        # leaves ``_names`` when its collective completes, whether or not the script ever
        # synchronizes its handle (as in Horovod, where a name is in flight until its
        # operation is done, not until the handle is read).
        self._started: list[_Op] = []
        self.background: list = []         # a joined worker's parts in others' collectives
        self.execs = 0                     # data steps started: the same count on every member
        self.exchanges = 0                 # requests sent by this member
        self.cache_hits = 0                # of them, submissions by a cache entry's number
        self.joined = None                 # a joined worker's answerer (joining)
        self.all_joined: int | None = None
        self.negotiation = negotiation or Negotiation()
        # Member 0's fusion threshold, as its last answer carried it (a group's parts fuse
        # by it on every member alike).
        self.answered_fusion_bytes = self.negotiation.fusion_bytes
        capacity = self.meta.bcast(self.negotiation.cache_capacity if self.rank == 0 else None,
                                   root=0)
        self.cache = ResponseCache(capacity)
        self.channel = Channel(self.meta, self.cache)
        stall = min(60.0, self.deadline / 2) if stall_after is None else stall_after
        self.coordinator = Coordinator(
            self.meta, self.size, stall_after=stall, deadline=self.deadline,
            fusion_bytes=self.negotiation.fusion_bytes if fusion_bytes is None else fusion_bytes,
            cycle_s=self.negotiation.cycle_s, cache_capacity=capacity) \
            if self.rank == 0 else None
        # False: no negotiation, the data step starts at once (``mpsync bench allreduce``
        # measures what negotiation costs; reductions only, nothing else may be queued).
        self.checked = checked

    def free(self) -> None:
        """Release the communicators (a removed process set)."""
        for c in (self.meta, self.lane, self.watch.comm, self.comm):
            c.Free()

    def keep(self, op) -> int:
        handle = next(self._ids)
        self.handles[handle] = op
        return handle

    # -- negotiation ----------------------------------------------------------------------------
    def submit(self, what: str, name, rec: np.ndarray, start, local_error=None,
               fusion=None) -> _Op:
        """Submit the collective named ``name`` (None: the next unnamed one of its kind);
        raises ``local_error`` (after submitting, so the others learn of it and raise too)
        or a duplicate in-flight ``name`` (before)."""
        if name is not None and name in self._names:
            self._reap()  # its earlier collective may have completed since the last advance
        if name is not None and name in self._names:
            raise ValueError(f"{what}: requested a collective named {name!r} while another "
                             f"one with that name is in flight (not yet completed); "
                             f"use a different name")
        if self.heartbeat is not None:
            self.heartbeat()
        if name is None:
            self._unnamed += 1
            name = f"{neg.UNNAMED}.{self._unnamed}"
        self._names.add(name)
        op = _Op(self, what, name, start, local_error, fusion)
        if not self.checked:
            if local_error is not None:
                raise RuntimeError(f"{what}: unchecked collectives take valid reductions only")
            op.records = rec[None, :]
            op._test, op._finish = start(op.records)
            return op
        if local_error is not None and rec[meta.Field.KIND] != meta.GROUP:
            rec[meta.Field.INVALID] = 1  # (a group's parts carry their own, Parts.submit)
        self._waiting[name] = op
        rec = np.ascontiguousarray(rec, dtype=np.int64)
        number = self.cache.lookup(name, self.rank, rec)
        if number != MISS:
            self.channel.hit(number)
            self.cache_hits += 1
        else:
            self.channel.submit(name, rec)
        self.exchanges += 1
        self.watch.drain()
        if local_error is not None:
            self.release(name)
            raise local_error
        return op

    def submit_group(self, what: str, name, parts: list) -> _Op:
        """One collective for a grouped call's ``parts`` (collected by :class:`Parts`): one
        name (None: the next unnamed), one record, one answer -- Horovod negotiates a group
        as one request too -- and the parts' data steps started together; its result is the
        parts' results in order.  A part's error fails the whole group on every worker."""
        rec = meta.group_record([p.rec for p in parts])
        error = next((p.local_error for p in parts if p.local_error is not None), None)
        return self.submit(what, name, rec, lambda records: _start_group(self, parts, records),
                           error)

    def advance(self) -> bool:
        """Member 0: answer the requests in; every member: start the data steps answered,
        in the order answered.  True if anything happened."""
        busy = self.coordinator.step() if self.coordinator is not None else False
        for parts in self.channel.answers():
            busy = True
            kind = int(parts[0][0])
            if kind == neg.EXEC:
                self._execute(parts)
            elif kind == neg.CANCELLED:
                op = self._waiting.pop(neg.word_name(parts[1]), None)
                if op is not None:
                    op.cancelled = [int(w) for w in parts[2]]
                    self.release(op.name)
            elif kind == neg.EXTENDED:
                op = self._waiting.get(neg.word_name(parts[1]))
                if op is not None:
                    op.extended = True
            elif kind == neg.ALL_JOINED:
                self.all_joined = int(parts[0][1])
        if self._running:
            self._running = [op for op in self._running if not op.poll()]
        self._reap()
        if self.background:
            self.background = [test for test in self.background if not test()]
        return busy

    def _reap(self) -> None:
        """Complete the started data steps that have finished (their names leave flight)."""
        if self._started:
            self._started = [op for op in self._started if not op.poll()]

    def _execute(self, parts: list) -> None:
        """One EXEC answer (see ``Coordinator._execute``): its names, each from the response
        cache or in full, the cache changed name by name as member 0 changed its own."""
        count = int(parts[0][1])
        self.answered_fusion_bytes = int(parts[0][2])
        group = []
        at = 1
        for i in range(count):
            number = int(parts[0][3 + i])
            if number != MISS:  # every worker hit this entry: the records are known good
                name, records = self.cache.use(number)
                local, known = name, True
            else:
                name = neg.word_name(parts[at])
                records = parts[at + 1].reshape(self.size, -1)
                local, known = neg.local_name(name, parts[at + 2], self.rank), False
                at += 3
                self.cache.answered(name, records)
            op = self._waiting.pop(local, None)
            if op is None:  # a joined worker, or a name this worker withdrew in the meantime
                self.execs += 1
                test = self.joined(records) if self.joined is not None else None
                if test is not None:
                    self.background.append(test)
                continue
            if op.abandoned:
                self._running.append(op)
            group.append((op, records, known))
        self.cache.applied += 1
        if count > 1:  # member 0 fused these: one data step on every worker
            for op, records, known in group:
                op._checked(records, known)
            self.execs += 1
            fused = [op for op, _, _ in group]
            if _kind(group[0][1]) == meta.ALLGATHER:
                _start_fused_allgather(self, fused, self.execs)
            else:
                _start_fused(self, fused, self.execs)
            self._started += [op for op, _, _ in group if not op.abandoned]
            return
        for op, records, known in group:
            self.execs += 1
            op.seq = self.execs
            op.begin_data(records, known)
            if not op.abandoned:
                self._started.append(op)

    def stats(self) -> dict:
        """This member's negotiation counters: ``requests`` (collectives submitted),
        ``cache_hits`` (of them, sent as a cache entry's number), ``cache_entries``; on
        member 0 also the coordinator's (``exchanges_full``, ``exchanges_skipped``, ``hits``,
        and the cache's ``evicted`` / ``replaced`` / ``erased`` entries)."""
        out = {"requests": self.exchanges, "cache_hits": self.cache_hits,
               "cache_entries": len(self.cache), "cache_capacity": self.cache.capacity}
        if self.coordinator is not None:
            out.update(self.coordinator.stats)
            out.update(self.coordinator.cache.counts)
        return out

    def give_up(self, op: _Op, timeout: BaseException) -> bool:
        """``op`` passed its deadline: withdraw its name if it is still waiting and raise,
        naming the workers that never submitted it (member 0 knows them).  If the answer to
        run it crosses the withdrawal, it runs (and may still complete in the grace time);
        False: member 0 asked for one more deadline (a missing worker is stuck behind an
        older collective of its own)."""
        op.abandoned = True
        if op.records is None and op.name in self._waiting:
            op.cancelled, op.extended = None, False
            self.channel.cancel(op.name)
            end = time.monotonic() + min(1.0, self.deadline / 4)
            while time.monotonic() < end and op.records is None and op.cancelled is None \
                    and not op.extended:
                self.advance()
                time.sleep(1e-4)
            if op.extended and op.records is None:
                op.abandoned = False
                return False
            if op.records is None:
                missing = op.cancelled  # None: member 0 did not answer; a late answer runs it
                if missing:
                    from mpsync.torch.dataplane.waiting import CollectiveTimeout

                    raise CollectiveTimeout(
                        f"{op.what} {op.name!r}", self.deadline, missing,
                        [self.world_ranks[w] for w in missing]) from None
                raise timeout
        if op.test():
            op.abandoned = False
            if op.error is None:
                op.result = op._finish()
            return True
        self._running.append(op)
        raise timeout

    def release(self, name) -> None:
        self._names.discard(name)

    def drain(self) -> None:
        """Start the data step of every collective this worker has submitted whose answer is
        in (kept for callers: negotiation needs no draining before ``join``)."""
        self.advance()

    def _wait(self, req, what: str) -> None:
        wait_while_stepping(req.Test, deadline=self.deadline, what=what, idle=self.idle,
                            watch=self.watch, seq=self.execs)

    def check(self, records: np.ndarray) -> str | None:
        return meta.mismatch(records, _DTYPE_NAMES, _OP_NAMES)


def make_user_ops(ctx) -> UserOps:
    """The global set's :class:`UserOps` (at ``init``: ``Dup()`` is collective)."""

    def idle() -> bool:
        stepped = False
        for opt in ctx.optimizers:
            stepped = opt.strategy.idle_step() or stepped
        return stepped

    def heartbeat() -> None:
        if ctx.client is not None:  # set after the user ops (no server: nobody to tell)
            ctx.client.alive()

    return UserOps(ctx.workers.Dup(), ctx.config.deadline, None, idle,
                   world_ranks=ctx.world_ranks, heartbeat=heartbeat,
                   negotiation=ctx.negotiation)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def name_of(name) -> str | None:
    return None if name is None else str(name)
