"""Host buffers that a collective needs only while it runs, reused from one collective to the
next.

A large buffer allocated afresh is paid for in page faults at its first touch: glibc hands
allocations of 32 MB and more straight from ``mmap`` and gives them back at ``free``, so every
such buffer starts with no pages.  Here 64 MB allocated and filled took 31-37 ms against 6.5 ms
to copy into one already touched (one core, float32; ``bench/collectives/README.md``).  A
collective's own temporaries -- a fused step's packed buffer, the parts a reduce-scatter
receives, the half sum's received halves -- never leave it, so they come from a
:class:`ScratchPool` and go back when the collective has finished; only what the caller keeps
(its result) is allocated fresh, as in Horovod, whose fusion buffer is likewise kept.

A buffer is handed to one collective at a time: :meth:`ScratchPool.take` removes it from the
pool and :meth:`ScratchPool.give` returns it.  A collective that is abandoned (its wait gave
up while a lane may still write into its buffer) never gives its buffer back; it is then
simply collected when nothing refers to it any more.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["ScratchPool", "KEEP_BYTES", "FRESH_BELOW", "pool"]

# The most the pool keeps while idle: Horovod's fusion threshold (128 MB) twice over, so that
# a fused step and a reduce-scatter of that size both find theirs.
KEEP_BYTES = 256 << 20

# Below this a buffer is allocated fresh and never kept: glibc serves such sizes from pages
# the process already holds, in 1.8 us, against 19 us for the pool's take and give (one core;
# a group of 4 small allreduces paid it at every call).
FRESH_BELOW = 1 << 20


class ScratchPool:
    """Reusable uint8 host buffers.  ``keep_bytes``: the most kept between collectives (the
    largest buffers given back beyond it are dropped, the smallest kept); ``fresh_below``:
    smaller buffers are allocated fresh and dropped when given back."""

    def __init__(self, keep_bytes: int = KEEP_BYTES, fresh_below: int = FRESH_BELOW):
        self.keep_bytes = int(keep_bytes)
        self.fresh_below = int(fresh_below)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made afresh (the rest were reused)
        self.reused = 0

    def take(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat buffer of ``nbytes // itemsize`` elements of ``dtype`` (its contents
        undefined), the smallest kept one that fits, else a new one."""
        nbytes = max(int(nbytes), 0)
        if nbytes < self.fresh_below:
            return torch.empty(nbytes // dtype.itemsize, dtype=dtype)
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            raw = min(fits, key=torch.Tensor.numel) if fits else None
            if raw is not None:
                self._free = [b for b in self._free if b is not raw]
                self.reused += 1
        if raw is None:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            self.allocated += 1
        itemsize = dtype.itemsize
        return raw[:nbytes - nbytes % itemsize].view(dtype)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer :meth:`take` handed out (any view of it)."""
        if buf.untyped_storage().nbytes() < self.fresh_below:
            return
        raw = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())
        with self._lock:
            if any(b.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
                   for b in self._free):
                return
            self._free.append(raw)
            self._free.sort(key=torch.Tensor.numel)
            while self._free and sum(b.numel() for b in self._free) > self.keep_bytes:
                self._free.pop()

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


_POOL = ScratchPool()


def pool() -> ScratchPool:
    """The process's pool (shared by every set of collectives in the process)."""
    return _POOL
