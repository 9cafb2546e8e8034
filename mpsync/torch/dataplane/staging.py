"""Device buffers over a transport that needs host memory: pinned mirrors, copies on a side
stream, ordered with CUDA events.

The fusion buffers (and so the buckets) live on the parameters' device.  NCCL takes them as
they are, and so does an MPI built with CUDA support; the mpi4py path of an MPI without it,
Horovod's CPU operations and gloo (whose aggregator works on host tensors) need host memory.
:class:`HostStaged` wraps such an aggregator: each device tensor it is given gets one pinned
host mirror (a bucket's, reused every step), one non-blocking copy device-to-host before the
collective and one host-to-device after it, both on a side stream:

* the device-to-host copy waits (a CUDA event recorded on the caller's stream) for the
  kernels that made the bucket's gradients, and the collective starts only once the copy has
  landed (its event queried, never waited on by the caller), so during backward the copy of
  bucket k runs on the copy engine while bucket k-1 is being reduced on the host;
* collectives start strictly in the order they were asked for (a queue: one whose copy
  landed waits for the ones before it), so every worker issues the same collectives in the
  same order (DDP, VLDB 2020, §3.2.3);
* the host-to-device copy is queued when the collective has finished, and the caller's
  stream waits on its event: the optimizer's kernels run after the averaged gradients are
  back, without the CPU waiting for the copy.

The pinned mirror is written again only by the next copy on the same side stream, which the
stream orders after the previous host-to-device copy, so one mirror per bucket suffices.
``copies`` counts the host<->device copies made (two per bucket per step in steady state);
``make gpu-check`` reads it beside the profiler's count.

On CPU tensors the wrapper forwards every call untouched, and :func:`stage_if_needed` does
not wrap at all where the tensors are on the CPU: the host path costs nothing.
"""

from __future__ import annotations

import torch

from mpsync.torch.dataplane.backends import Aggregator, Pending

__all__ = ["HostStaged", "needs_host_memory", "stage_if_needed"]

_MAX_MIRRORS = 256   # a compressor making new tensors each call must not grow the cache forever


def needs_host_memory(aggregator: Aggregator, *, cuda_aware_mpi: bool | None,
                      horovod_nccl: bool = False) -> bool:
    """Whether ``aggregator`` needs host tensors for device buffers: the mpi backend without
    a CUDA-aware MPI, Horovod without NCCL, gloo (its aggregator works on host tensors).
    NCCL takes device buffers directly."""
    name = getattr(aggregator, "name", "")
    if name.startswith("mpi"):
        return not cuda_aware_mpi
    if name.startswith("horovod"):
        return not horovod_nccl
    if name.startswith("gloo"):
        return True
    return False


def stage_if_needed(aggregator: Aggregator, device: torch.device, **kw) -> Aggregator:
    """``aggregator`` behind :class:`HostStaged` where the buffers are on a CUDA ``device``
    and the transport needs host memory (:func:`needs_host_memory`); else itself."""
    if torch.device(device).type != "cuda" or not needs_host_memory(aggregator, **kw):
        return aggregator
    return HostStaged(aggregator)


class _Staged:
    """One device tensor's trip: the copy out (an event), then the host collective, then the
    copy back; ``test``/``wait`` as a :class:`Pending`."""

    def __init__(self, owner: "HostStaged", device_tensor, host, copied, what):
        self.owner = owner
        self.device_tensor = device_tensor
        self.host = host
        self.copied = copied          # CUDA event: the mirror holds the tensor
        self.what = what
        self.inner: Pending | None = None


class HostStaged(Aggregator):
    """``inner`` (an aggregator of host tensors) given device tensors through pinned host
    mirrors (module doc).  Host tensors go straight to ``inner``."""

    def __init__(self, inner: Aggregator):
        super().__init__(inner.rank, inner.size, inner.deadline, inner.watch)
        self.inner = inner
        self.name = f"{inner.name}+host"
        self.poll_sleep, self.poll_spin = 1e-4, 2e-3
        self.copies = 0               # host<->device copies made
        self._mirrors: dict[tuple, torch.Tensor] = {}
        self._streams: dict[torch.device, object] = {}
        self._queue: list[_Staged] = []   # copied out or copying, collective not started yet

    # joining.py sets the hook on the aggregators it knows (ctx.backend): the inner one.
    @property
    def while_waiting(self):
        return self.inner.while_waiting

    @while_waiting.setter
    def while_waiting(self, hook) -> None:
        if hasattr(self, "inner"):
            self.inner.while_waiting = hook

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _mirror(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.numel(), t.dtype)
        host = self._mirrors.get(key)
        if host is None:
            if len(self._mirrors) >= _MAX_MIRRORS:
                self._mirrors.clear()
            host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
            self._mirrors[key] = host
        return host

    def _copy_out(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Queue the device-to-host copy of ``t`` after the caller's stream's work on it."""
        host = self._mirror(t)
        side = self._stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            host.copy_(t.reshape(-1), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        self.copies += 1
        return host, copied

    def _copy_back(self, t: torch.Tensor, host: torch.Tensor) -> None:
        """Queue the host-to-device copy; the caller's stream waits for it (not the CPU)."""
        side = self._stream(t.device)
        with torch.cuda.stream(side):
            t.reshape(-1).copy_(host, non_blocking=True)
            back = torch.cuda.Event()
            back.record(side)
        torch.cuda.current_stream(t.device).wait_event(back)
        self.copies += 1

    def _pump(self) -> None:
        """Start, in order, the collectives whose copy out has landed."""
        while self._queue and self._queue[0].copied.query():
            job = self._queue.pop(0)
            job.inner = self.inner.start_allreduce_average(job.host, job.what)

    # -- the interface ---------------------------------------------------------------------------
    def start_allreduce_average(self, flat, what="allreduce"):
        if flat.device.type != "cuda":
            return self.inner.start_allreduce_average(flat, what)
        label, seq = self._next(what)
        host, copied = self._copy_out(flat)
        job = _Staged(self, flat, host, copied, what)
        self._queue.append(job)
        self._pump()

        def test() -> bool:
            if job.inner is None:
                self._pump()
                if job.inner is None:
                    return False
            return job.inner.test()

        def finish():
            job.inner.wait()      # done already: re-raises a failure, runs its finishing step
            self._copy_back(flat, host)

        return Pending(test, finish, label, seq, self)

    def _blocking(self, flat: torch.Tensor, op) -> torch.Tensor:
        """A blocking collective on a device tensor: out, ``op(host)``, back."""
        if flat.device.type != "cuda":
            return op(flat)
        while self._queue:             # what was asked for before goes first
            self._queue[0].copied.synchronize()
            self._pump()
        host, copied = self._copy_out(flat)
        copied.synchronize()
        op(host)
        self._copy_back(flat, host)
        return flat

    def allreduce_sum_(self, flat, what="allreduce"):
        return self._blocking(flat, lambda t: self.inner.allreduce_sum_(t, what))

    def broadcast_(self, flat, root, what="broadcast", deadline=None):
        return self._blocking(flat, lambda t: self.inner.broadcast_(t, root, what, deadline))

    def broadcast_bytes(self, data, root, what="broadcast", deadline=None):
        return self.inner.broadcast_bytes(data, root, what, deadline)

    def barrier(self, what="barrier", deadline=None):
        self.inner.barrier(what, deadline)
