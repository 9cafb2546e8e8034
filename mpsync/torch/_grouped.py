"""A grouped allreduce of plain host tensors, without a collective per tensor.

``grouped_allreduce`` of CPU tensors of one reducible dtype, uncompressed -- the usual case:
a custom loop's gradients or metrics -- is submitted here as one collective whose record is
kept by the call's shape (its parts' dtype, shapes, op, scale factors and name), and whose
data steps pack, reduce and deliver the tensors together.  The general path
(:func:`mpsync.torch.mpi_ops.start_grouped_allreduce` through
:class:`~mpsync.torch._collectives.Parts`) builds every part as a collective of its own and
then fuses them: per tensor a record, a compressor, four closures, a view, a copy and two
scalings, which on 4 ranks sharing 2 cores cost more than moving the bytes (a group of four
16 KB tensors: 1.7 ms against 0.8 ms for one allreduce of the same 64 KB).

Both paths submit the same record for the same call (each part's is
:func:`~mpsync.torch._metadata.record` with the same fields), cut the parts into the same
data steps (``_collectives._group_plan``), and reduce them with the same
arithmetic (Horovod's: ``prescale_factor`` before the sum, ``postscale_factor`` -- divided by
the number of workers for ``op=Average`` -- after it, integers scaled in float64 and
truncated), so one worker may take either path while another takes the other.
"""

from __future__ import annotations

import torch

from mpsync.torch import _metadata as meta
from mpsync.torch._collectives import (Average, UserOps, _group_plan, _GroupTest, dtype_code,
                                       scale_)
from mpsync.torch._moves import _REDUCIBLE, _reduce_started
from mpsync.torch.dataplane.compression import NoneCompressor

__all__ = ["submit_plain_group", "part_name"]


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
    key = (ops.size, op, pre, post, name, dtype, shapes)
    rec = _RECORDS.get(key)
    if rec is None:
        if len(_RECORDS) >= 1024:
            _RECORDS.clear()
        code = dtype_code(dtype)
        rec = _RECORDS[key] = meta.group_record([
            meta.record(ops.size, meta.ALLREDUCE, dtype=code, shape=tuple(s), op=op,
                        prescale=pre, postscale=post, name=part_name(name, i),
                        nbytes=t.numel() * t.element_size())
            for i, (t, s) in enumerate(zip(tensors, shapes))])
    group = _PlainGroup(ops, tensors, shapes, op, pre,
                        post / ops.size if op == Average else post, in_place)
    return ops.submit("grouped allreduce", name, rec.copy(), group.start)


# Group records by the call's fields (a loop submits the same group at every step).
_RECORDS: dict = {}


class _PlainGroup:
    """One grouped allreduce's data: ``start(records)`` packs each data step's tensors into
    one buffer and starts reducing it; ``finish()`` scales each buffer once and gives the
    results in order (new tensors, or the callers' own in place)."""

    __slots__ = ("ops", "tensors", "shapes", "op", "pre", "post", "in_place", "steps")

    def __init__(self, ops, tensors, shapes, op, pre, post, in_place):
        self.ops, self.tensors, self.shapes = ops, list(tensors), shapes
        self.op, self.pre, self.post, self.in_place = op, pre, post, in_place
        self.steps: list = []

    def start(self, records):
        from mpsync.torch.dataplane.scratch import pool

        _parts, steps = _group_plan(records, self.ops.answered_fusion_bytes)
        tests = []
        for step in steps:
            xs = [self.tensors[i].detach() for i in step]
            if len(xs) == 1:  # its own buffer: the result itself unless it goes in place
                buf = torch.empty(xs[0].numel(), dtype=xs[0].dtype)
                buf.copy_(xs[0].reshape(-1))
            else:
                total = sum(x.numel() for x in xs)
                buf = pool().take(total * xs[0].element_size(), xs[0].dtype)
                torch.cat([x.reshape(-1) for x in xs], out=buf)
            scale_(buf, self.pre)
            tests.append(_reduce_started(self.ops, buf, self.op))
            self.steps.append((step, buf))
        return _GroupTest(tests), self.finish

    def finish(self) -> list:
        from mpsync.torch.dataplane.scratch import pool

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
        return y if fresh else y.clone()  # (a pooled buffer is reused: the caller's own)
