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

A result the caller keeps is fresh memory, but from 32 MB up a fresh buffer is the page
faults above at every call (below it, at a process's first calls: :data:`LEASE_MIN`), the
caller's loop dropping last call's result as it gets this one's.  :meth:`ScratchPool.result`
hands such a result memory of the pool's instead, and the memory goes back to the pool only
once nothing refers to the tensor any more (its storage, views included): a loop of calls
reuses one buffer, and a result kept is simply not returned.  Horovod allocates every result
afresh; this is where mpsync departs.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["ScratchPool", "KEEP_BYTES", "FRESH_BELOW", "LEASE_MIN", "pool"]

# The most the pool keeps while idle: Horovod's fusion threshold (128 MB) twice over, so that
# a fused step and a reduce-scatter of that size both find theirs.
KEEP_BYTES = 256 << 20

# Below this a buffer is allocated fresh and never kept: glibc serves such sizes from pages
# the process already holds, in 1.8 us, against 19 us for the pool's take and give (one core;
# a group of 4 small allreduces paid it at every call).
FRESH_BELOW = 1 << 20

# Results from this size on are leased (:meth:`ScratchPool.result`).  From 32 MB every
# allocation is a fresh mmap (glibc's mmap threshold rises to a freed chunk's size, up to
# 32 MB on 64-bit): a result written into (filled from a tensor) and dropped, in a loop, one
# core: 32 MB 23-25 ms fresh against 3.4-4.7 reused; 64 MB 44-49 against 6.7.  Below it,
# glibc's reuse of freed memory comes only after the first calls: a broadcast of 16 MB on 2
# ranks, median of calls 2-8 of a process, 9-13 ms in 2 of 3 runs with results fresh, 5.9-6.6
# in 3 of 3 leased (later calls: 5.4-7.9 either way).  The lane's size is where it starts.
LEASE_MIN = 4 << 20


class _Leased(np.ndarray):
    """The numpy array a leased result's tensor is made from: the tensor's storage holds it,
    and when the storage is gone its finalizer gives the memory back (``_back``; views of
    it, numpy's or torch's, keep it alive and have no ``_back`` of their own)."""

    def __del__(self):
        back = self.__dict__.get("_back")
        if back is not None:
            try:
                back()
            except Exception:  # (at interpreter exit the pool may be gone already)
                pass


class ScratchPool:
    """Reusable uint8 host buffers.  ``keep_bytes``: the most kept between collectives (the
    longest unused dropped first, one larger than it never kept); ``fresh_below``: smaller
    buffers are allocated fresh and dropped when given back; ``lease_min``: results from
    this size on are leased (:meth:`result`)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES, fresh_below: int = FRESH_BELOW,
                 lease_min: int = LEASE_MIN):
        self.keep_bytes = int(keep_bytes)
        self.fresh_below = int(fresh_below)
        self.lease_min = int(lease_min)
        self._free: list[torch.Tensor] = []
        # reentrant: a leased result collected while this thread holds the lock gives back
        self._lock = threading.RLock()
        self.allocated = 0  # buffers made afresh (the rest were reused)
        self.reused = 0

    def take(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat buffer of ``nbytes // itemsize`` elements of ``dtype`` (its contents
        undefined), the smallest kept one that fits in at most twice its size, else a new
        one."""
        nbytes = max(int(nbytes), 0)
        if nbytes < self.fresh_below:
            return torch.empty(nbytes // dtype.itemsize, dtype=dtype)
        with self._lock:
            # (one more than twice the size stays for a larger request: a result may be kept)
            fits = [b for b in self._free if nbytes <= b.numel() <= 2 * nbytes]
            raw = min(fits, key=torch.Tensor.numel) if fits else None
            if raw is not None:
                self._free = [b for b in self._free if b is not raw]
                self.reused += 1
        if raw is None:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            self.allocated += 1
        itemsize = dtype.itemsize
        return raw[:nbytes - nbytes % itemsize].view(dtype)

    def result(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of ``shape`` and ``dtype`` (contents undefined) for a result the
        caller keeps: fresh below ``lease_min``, else memory of the pool's that goes back to
        it once nothing refers to the tensor."""
        shape = tuple(int(d) for d in shape)
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if nbytes < max(self.lease_min, 1):
            return torch.empty(shape, dtype=dtype)
        raw = self.take(nbytes)
        leased = raw.numpy()[:nbytes].view(_Leased)
        leased._back = lambda: self.give(raw)
        return torch.from_numpy(leased).view(dtype).view(shape)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        """``t.clone()`` (contiguous) in :meth:`result`'s memory: a result cut out of a
        buffer that goes back to the pool."""
        return self.result(t.shape, t.dtype).copy_(t)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer :meth:`take` handed out (any view of it)."""
        if buf.untyped_storage().nbytes() < self.fresh_below:
            return
        raw = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())
        with self._lock:
            if any(b.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
                   for b in self._free):
                return
            if raw.numel() > self.keep_bytes:
                return
            # Kept in the order given back; beyond the bound the longest unused go first.  The
            # one just given back is the likeliest to be taken next (a loop's next call): with
            # the largest dropped instead, a loop of 128 MB allgathers beside other buffers
            # allocated (and page-faulted) its output afresh at every call.
            self._free.append(raw)
            while sum(b.numel() for b in self._free) > self.keep_bytes:
                self._free.pop(0)

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


_POOL = ScratchPool()


def pool() -> ScratchPool:
    """The process's pool (shared by every set of collectives in the process)."""
    return _POOL
