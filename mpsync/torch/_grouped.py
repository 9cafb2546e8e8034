"""Grouped calls of plain host tensors, without a collective per tensor.

``grouped_allreduce``, ``grouped_allgather`` and ``grouped_reducescatter`` of CPU tensors,
uncompressed -- the usual case: a custom loop's gradients, metrics or embeddings -- are
submitted here as one collective whose record is kept by the call's shape (its parts'
dtypes, shapes, op, scale factors and name), and whose data step packs, moves and delivers
the tensors together.  The general path (``mpi_ops.start_grouped_*`` through
:class:`~mpsync.torch._collectives.Parts`) builds every part as a collective of its own and
then fuses them: per tensor a record, a compressor, closures, a view, a copy and two
scalings, which on 4 ranks sharing 2 cores cost more than moving the bytes (a grouped
allreduce of four 16 KB tensors: 1.7 ms against 0.8 ms for one allreduce of the same 64 KB).

Both paths submit the same record for the same call (each part's is
:func:`~mpsync.torch._metadata.record` with the fields the part alone would send), cut the
parts into the same data steps (``_collectives._group_plan``) and run the same MPI calls with
the same arithmetic (Horovod's: ``prescale_factor`` before the sum, ``postscale_factor`` --
divided by the number of workers for ``op=Average`` -- after it, integers scaled in float64
and truncated), so one worker may take either path while another takes the other.  An
allreduce group runs here whatever its steps; an allgather or reduce-scatter group only when
its parts fuse into one step (one allgather of the packed bytes; one allreduce of the packed
tensors, each worker keeping its rows), else its parts are built as the general path builds
them once the records are in.
"""

from __future__ import annotations

import torch

from mpsync.torch import _metadata as meta
from mpsync.torch._collectives import (Average, Sum, UserOps, _group_plan, _GroupTest,
                                       _start_group, average_scales, dtype_code, pack_scaled,
                                       packed_allgather, scale_)
from mpsync.torch._moves import (_REDUCIBLE, _allgatherv, _reduce_started, _row_bytes,
                                 reducescatter_rows)
from mpsync.torch.dataplane.compression import NoneCompressor
from mpsync.torch.dataplane.scratch import pool

__all__ = ["submit_plain_group", "submit_plain_allgather", "submit_plain_reducescatter",
           "part_name"]


def part_name(name, i: int):
    """The name of a grouped call's ``i``-th part (None: an unnamed group's)."""
    return None if name is None else f"{name}.{i}"


def submit_plain_group(ops: UserOps, tensors, op: int, pre: float, post: float,
                       compression, name, in_place: bool):
    """Submit the grouped allreduce of ``tensors`` (its :class:`~mpsync.torch._collectives.
    _Op`), or None where the general path must take it: a device tensor, mixed or
    non-reducible dtypes, compression, a scale factor of zero (its sign travels in the
    record), or no tensors."""
    if compression not in (None, NoneCompressor) or not pre or not post or not tensors:
        return None
    dtype = tensors[0].dtype
    if dtype not in _REDUCIBLE:
        return None
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu:
            return None
    shapes = tuple(t.shape for t in tensors)

    def make():
        return meta.group_record([
            meta.record(ops.size, meta.ALLREDUCE, dtype=dtype_code(dtype), shape=tuple(s),
                        op=op, prescale=pre, postscale=post, name=part_name(name, i),
                        nbytes=t.numel() * t.element_size())
            for i, (t, s) in enumerate(zip(tensors, shapes))])

    rec = _kept((meta.ALLREDUCE, ops.size, op, pre, post, name, dtype, shapes), make)
    group = _PlainGroup(ops, tensors, shapes, op, *average_scales(op, dtype, ops.size, pre, post),
                        in_place)
    return ops.submit("grouped allreduce", name, rec, group.start)


# Group records by the call's fields (a loop submits the same group at every step).
_RECORDS: dict = {}


def _kept(key, make):
    rec = _RECORDS.get(key)
    if rec is None:
        if len(_RECORDS) >= 1024:
            _RECORDS.clear()
        rec = _RECORDS[key] = make()
    return rec.copy()


def _plain(tensors, same_dtype: bool) -> bool:
    """Host tensors of at least one dimension (of one dtype, if asked), at least one."""
    if not tensors:
        return False
    dtype = tensors[0].dtype
    return all(t.is_cpu and t.dim() and (t.dtype is dtype or not same_dtype) for t in tensors)


def submit_plain_allgather(ops: UserOps, tensors, name, general):
    """Submit the grouped allgather of ``tensors``, or None (a device or 0-d tensor: the
    general path).  When its parts fuse into one data step (every worker sends one shape,
    within the allgather fusion limit) they are packed and cut here; otherwise the parts are
    built by ``general()`` (a list of :class:`~mpsync.torch._collectives._Part`) once the
    records are in, and run as the general path runs them."""
    if not _plain(tensors, same_dtype=False):
        return None
    shapes = tuple(t.shape for t in tensors)
    dtypes = tuple(t.dtype for t in tensors)

    def make():
        return meta.group_record([
            meta.record(ops.size, meta.ALLGATHER, dtype=dtype_code(t.dtype), shape=tuple(s),
                        name=part_name(name, i), row_bytes=_row_bytes(t))
            for i, (t, s) in enumerate(zip(tensors, shapes))])

    rec = _kept((meta.ALLGATHER, ops.size, name, dtypes, shapes), make)

    def start(records):
        _parts, steps = _group_plan(records, ops.answered_fusion_bytes)
        if len(steps) != 1 or len(steps[0]) != len(tensors):
            return _start_group(ops, general(), records)
        return packed_allgather(ops, [t.detach() for t in tensors],
                                lambda send, out, counts: _allgatherv(ops, send, out, counts))

    return ops.submit("grouped allgather", name, rec, start)


def submit_plain_reducescatter(ops: UserOps, tensors, op: int, pre: float, post: float,
                               compression, name, general):
    """Submit the grouped reduce-scatter of ``tensors``, or None (the general path: a device
    or 0-d tensor, mixed or non-reducible dtypes, compression, an op other than Sum or
    Average, a scale factor of zero).  When its parts fuse into one data step (below the
    reduce-scatter fusion limit) they are reduced here as one allreduce, each worker keeping
    its rows of each; otherwise ``general()`` builds the parts, as for an allgather."""
    if compression not in (None, NoneCompressor) or not pre or not post or \
            op not in (Average, Sum) or not _plain(tensors, same_dtype=True) or \
            tensors[0].dtype not in _REDUCIBLE:
        return None
    shapes = tuple(t.shape for t in tensors)
    dtype = tensors[0].dtype

    def make():
        return meta.group_record([
            meta.record(ops.size, meta.REDUCESCATTER, dtype=dtype_code(dtype),
                        shape=tuple(s), op=op, prescale=pre, postscale=post,
                        name=part_name(name, i), nbytes=t.numel() * t.element_size())
            for i, (t, s) in enumerate(zip(tensors, shapes))])

    rec = _kept((meta.REDUCESCATTER, ops.size, op, pre, post, name, dtype, shapes), make)
    group = _PlainGroup(ops, tensors, shapes, op, *average_scales(op, dtype, ops.size, pre, post),
                        False, scatter=True)

    def start(records):
        _parts, steps = _group_plan(records, ops.answered_fusion_bytes)
        if len(steps) != 1 or len(steps[0]) != len(tensors):  # (the general path's steps:
            return _start_group(ops, general(), records)        # reduce-scatters)
        return group.start(records)

    return ops.submit("grouped reducescatter", name, rec, start)


class _PlainGroup:
    """One grouped allreduce's data: ``start(records)`` packs each data step's tensors into
    one buffer and starts reducing it; ``finish()`` scales each buffer once and gives the
    results in order (new tensors, or the callers' own in place)."""

    __slots__ = ("ops", "tensors", "shapes", "op", "pre", "post", "in_place", "scatter",
                 "steps")

    def __init__(self, ops, tensors, shapes, op, pre, post, in_place, scatter=False):
        self.ops, self.tensors, self.shapes = ops, list(tensors), shapes
        self.op, self.pre, self.post, self.in_place = op, pre, post, in_place
        self.scatter = scatter  # a reduce-scatter's: each result is this worker's rows
        self.steps: list = []

    def start(self, records):
        _parts, steps = _group_plan(records, self.ops.answered_fusion_bytes)
        tests = []
        for step in steps:
            xs = [self.tensors[i].detach() for i in step]
            if len(xs) == 1:  # its own buffer: the result itself unless it goes in place
                buf = pool().result((xs[0].numel(),), xs[0].dtype)
            else:
                buf = pool().take(sum(x.numel() for x in xs) * xs[0].element_size(),
                                  xs[0].dtype)
            pack_scaled(xs, buf, self.pre)
            tests.append(_reduce_started(self.ops, buf, self.op))
            self.steps.append((step, buf))
        return _GroupTest(tests), self.finish

    def finish(self) -> list:
        out = [None] * len(self.tensors)
        for step, buf in self.steps:
            scale_(buf, self.post)
            if len(step) == 1:
                i = step[0]
                out[i] = self._deliver(i, buf.view(self.shapes[i]), fresh=True)
                continue
            for i, piece in zip(step, buf.split([self.tensors[i].numel() for i in step])):
                out[i] = self._deliver(i, piece.view(self.shapes[i]), fresh=False)
            pool().give(buf)
        self.steps = []
        return out

    def _deliver(self, i: int, y: torch.Tensor, fresh: bool) -> torch.Tensor:
        if self.in_place:
            with torch.no_grad():
                return self.tensors[i].copy_(y)
        if self.scatter:
            first, count = reducescatter_rows(self.shapes[i][0], self.ops.size, self.ops.rank)
            return pool().copy_of(y[first:first + count])
        return y if fresh else pool().copy_of(y)  # (a pooled buffer is reused: the caller's own)
