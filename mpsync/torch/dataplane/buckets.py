"""Gradient buckets started during backward: communication begins when its data is ready, not
when ``step()`` is called.

The design is PyTorch DDP's Reducer (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, §3.2.3-3.2.4) on mpsync's fusion buffers:

* **Buckets are slices of the fusion buffer.**  The gradients already live as views into
  :class:`~mpsync.torch.dataplane.fusion.FusionBuffer`'s ``flat`` (``bind_grads``), so a bucket
  is a contiguous range of the buffer's ``wire`` and needs no copy in or out: the collective
  reduces the gradients where backward left them.  Buckets are cut walking the parameters from
  the last registered to the first (backward produces gradients roughly in that order), at most
  ``cap_bytes`` each (DDP's 25 MB by default); the buffer's header (the strategy's few counts,
  ``FusionBuffer.add_header``) sits at the end of ``wire``, so it travels with bucket 0, the
  first launched.
* **Each bucket starts from a post-accumulate-grad hook** the moment its last gradient is
  final, and buckets start strictly in index order (bucket k only after buckets 0..k-1), so
  every worker issues the same collectives in the same order whatever order its hooks fired
  in (DDP §3.2.3: a mismatched order across processes would hang or mix up buckets).
* **Unused parameters do not stall their bucket.**  DDP's ``find_unused_parameters`` walks
  the autograd graph from the outputs before backward.  Here the first hook of a backward pass
  queues a callback on the autograd engine that runs when that pass ends
  (``Variable._execution_engine.queue_callback``, what DDP's own finalization uses); at that
  point a parameter whose hook never fired got no gradient in this pass: its slice is zeroed
  when it has no gradient at all (as the whole-model path's ``pack_grads`` does), it is
  counted ready, and every bucket not yet started starts, in order.  So a bucket with an
  unused parameter starts at the end of backward instead of during it, and nothing waits on a
  gradient that will never come.  The detection costs nothing per step.
* **Gradient accumulation** (``backward_passes_per_step = k``): ``should_launch()`` is asked
  at the first hook of each pass; only the k-th pass starts buckets, the earlier ones only
  accumulate into the views.
* **``zero_grad(set_to_none=True)``** leaves ``param.grad`` None; the next backward makes a new
  gradient tensor, which the hook copies into its slice once and replaces by the view again.

What is started and how is the caller's (``launch(bucket)`` returns something with ``wait()``:
a ``Pending`` of the aggregators, or ``WireSum.start_sum``'s); :meth:`wait_all` waits for what
is in flight, in order.  ``start_all`` covers a step that had no backward with hooks (a joined
worker contributing zeros, gradients set by hand).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mpsync.torch.dataplane.fusion import FusionBuffer

__all__ = ["Bucket", "GradientBuckets", "plan_buckets"]


@dataclass
class Bucket:
    """A contiguous range ``[start, stop)`` of ``buffer.wire``; ``payload`` of its elements are
    gradients, the rest (bucket 0 of the first buffer only) the strategy's header."""

    index: int
    buffer: FusionBuffer
    start: int
    stop: int
    payload: int
    has_header: bool
    params: list = field(default_factory=list)   # the parameters whose gradients it holds
    expected: int = 0                            # of them, those that get gradients
    ready: int = 0

    @property
    def wire(self) -> torch.Tensor:
        return self.buffer.wire[self.start:self.stop]

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.buffer.wire.element_size()


def plan_buckets(buffers: list[FusionBuffer], cap_bytes: int) -> list[Bucket]:
    """Cut every buffer into buckets of at most ``cap_bytes`` (a parameter larger than that is
    a bucket of its own), walking its parameters from the last to the first.  The buckets of
    ``buffers[0]`` come first, then those of the next buffer (one buffer per dtype)."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {cap_bytes}")
    out: list[Bucket] = []
    for b_index, buf in enumerate(buffers):
        item = buf.wire.element_size()
        header = buf.wire.numel() - buf.numel
        stop = buf.wire.numel()
        start = buf.numel
        params: list = []
        for slot in reversed(buf.slots):
            if params and (stop - slot.offset) * item > cap_bytes:
                out.append(_bucket(len(out), buf, start, stop, header, params))
                stop, params, header = start, [], 0
            start = slot.offset
            params.append(slot.param)
        out.append(_bucket(len(out), buf, start, stop, header, params))
    return out


def _bucket(index, buf, start, stop, header, params) -> Bucket:
    b = Bucket(index, buf, start, stop, stop - start - header, header > 0, list(params))
    b.expected = sum(1 for p in params if p.requires_grad)
    return b


class GradientBuckets:
    """Buckets over ``buffers`` (whose gradients are bound: ``FusionBuffer.bind_grads``),
    started from gradient hooks through ``launch(bucket)`` while ``should_launch()`` said yes
    at the pass's first hook.  ``close()`` removes the hooks."""

    def __init__(self, buffers: list[FusionBuffer], cap_bytes: int, launch, should_launch):
        self.buckets = plan_buckets(buffers, cap_bytes)
        self._launch = launch
        self._should_launch = should_launch
        self._bucket_of: dict[int, Bucket] = {}
        self._view_of: dict[int, torch.Tensor] = {}
        for buf in buffers:
            for slot, view in zip(buf.slots, buf.views()):
                self._view_of[id(slot.param)] = view
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[id(p)] = b
        self._seen: set[int] = set()
        self._in_pass = False
        self._launching = False
        self.started: list = []       # what launch() returned, bucket by bucket, this step
        self.next_bucket = 0          # the next bucket to start (every earlier one has)
        # Observers (tests, the timeline): called with the bucket index when one starts, and
        # with "end" when a launching pass's backward ends.
        self.on_event = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                       for b in self.buckets for p in b.params if p.requires_grad]

    # -- during backward ------------------------------------------------------------------------
    def _gradient_ready(self, param: torch.Tensor) -> None:
        if not self._in_pass:
            self._begin_pass()
        view = self._view_of[id(param)]
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            # A gradient made anew (after zero_grad(set_to_none=True)): into its slice, once.
            with torch.no_grad():
                view.copy_(grad)
            param.grad = view
        if not self._launching or id(param) in self._seen:
            return
        self._seen.add(id(param))
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == bucket.expected:
            self._start_ready()

    def _begin_pass(self) -> None:
        self._in_pass = True
        self._launching = self.next_bucket == 0 and bool(self._should_launch())
        if self._launching:
            self._seen.clear()
            for b in self.buckets:
                b.ready = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._in_pass = False
        if not self._launching:
            return
        self._launching = False
        # Parameters whose hook never fired got no gradient in this pass (module doc).
        with torch.no_grad():
            for b in self.buckets[self.next_bucket:]:
                for p in b.params:
                    if p.requires_grad and id(p) not in self._seen:
                        self._bind_missing(p)
                b.ready = b.expected
        self._start_ready()
        if self.on_event is not None:
            self.on_event("end")

    def _bind_missing(self, param: torch.Tensor) -> None:
        view = self._view_of[id(param)]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        param.grad = view

    def _start_ready(self) -> None:
        while self.next_bucket < len(self.buckets):
            b = self.buckets[self.next_bucket]
            if b.ready < b.expected:
                return
            self.next_bucket += 1
            self.started.append(self._launch(b))
            if self.on_event is not None:
                self.on_event(b.index)

    # -- at step() --------------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """Buckets were started for this step (some, or all)."""
        return self.next_bucket > 0

    def start_all(self) -> None:
        """Start every bucket not started yet, their gradients as they are now (bound, or
        packed in by the caller)."""
        for b in self.buckets[self.next_bucket:]:
            b.ready = b.expected
        self._start_ready()

    def wait_all(self, deadline: float | None = None) -> None:
        """Wait for every started bucket, in order; then the next step starts afresh."""
        try:
            for pending in self.started:
                pending.wait(deadline)
        finally:
            self.started = []
            self.next_bucket = 0
            self._seen.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
