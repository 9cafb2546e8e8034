"""The response cache: a name's negotiation remembered, so that the next time every worker
submits it unchanged the exchange is one number each way instead of every worker's record --
Horovod's response cache (horovod/common/response_cache.cc), fitted to mpsync's coordinator.

Why: a training loop submits the same names with the same tensors every step.  Horovod skips
its coordinator's gather of requests and broadcast of responses for them: each rank sets the
cache bit of every name it has queued unchanged, one bitwise allreduce finds the names every
rank has, and every rank runs those from its own copy of the cache.  mpsync's coordinator is
member 0 answering point-to-point requests (:mod:`~mpsync.torch._coordinator`), with no
cycle-wide collective to carry a bit vector, so the cache works per request:

* every member holds the same cache.  Entries change only at member 0's ``EXEC`` answers,
  which every member receives in the same order, and every member makes the same change for
  each answered name (:meth:`ResponseCache.answered`, :meth:`ResponseCache.use`) -- what
  Horovod gets from every rank applying the same response list;
* a worker whose record for a name equals its own row of the cached entry sends a ``HIT``
  carrying the entry's number only; one whose record differs (another shape, dtype, reduce
  op, scale factors, root; an invalid argument) or that finds no entry sends its full record
  (Horovod's INVALID and MISS);
* when every worker hit the same live entry, member 0 answers with that number alone (the
  full exchange skipped) and the members take the records from their cache; those records
  agreed when they were cached, so nobody checks them again.  Anything else is answered with
  every worker's records, exactly as without a cache -- a worker that hit contributes its row
  of the entry, the record it would have sent -- so a mismatch is reported with the same
  message on every worker; that answer replaces the entry (under a new number) or, for an
  error, erases it (Horovod erases an invalid entry before the full negotiation).

Entry numbers are never reused (Horovod reuses bits: its ranks change the cache in lock step,
within one cycle).  A worker's ``HIT`` may cross member 0's answer that retired its entry
(evicted, replaced, erased); member 0 keeps retired entries until every member has applied
that answer (each request carries the number of answers its sender has applied), so a late
``HIT`` still resolves to the record its sender compared.

What is cached: named allreduces, allgathers, alltoalls, reduce-scatters and broadcasts whose
records agree (grouped calls when all their parts are of those kinds).  Not barriers, nor
unnamed collectives (their names, ``noname.<n>``, never repeat); an answer while a worker is
joined leaves the cache as it is.  Horovod 0.28.1 caches fewer (controller.cc puts only
allreduce, allgather, alltoall and adasum responses), so its reduce-scatters and broadcasts
pay the full exchange at every call; nothing in a record makes them unsafe to cache (a
worker's own row is compared, so another root or shape is a miss), and a grouped
reduce-scatter of 4 tensors on 4 ranks took 2.5 ms uncached against 0.9 for the grouped
allreduce of the same tensors, cached.  The least recently used entry is evicted beyond
``capacity``; capacity 0: no cache.
The process set is the cache's own (one per set); the device is not part of a record here
(tensors are staged through host memory), so it is not part of the key.

No MPI and no torch here.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mpsync.torch import _metadata as meta
from mpsync.torch._negotiation import _CODES, unnamed_key

__all__ = ["ResponseCache", "MISS", "CACHED_KINDS"]

MISS = -1
CACHED_KINDS = (meta.ALLREDUCE, meta.ALLGATHER, meta.ALLTOALL, meta.REDUCESCATTER,
                meta.BROADCAST)


class ResponseCache:
    """One member's copy of the cache (see the module doc).  ``keep_retired``: member 0's
    coordinator, which must still resolve a ``HIT`` on an entry it has retired since."""

    def __init__(self, capacity: int, *, keep_retired: bool = False):
        self.capacity = max(0, int(capacity))
        self._names: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._live: dict[int, tuple[str, np.ndarray]] = {}
        self._next = 0
        self.applied = 0  # EXEC answers applied: the same sequence on every member
        self.retired: dict[int, tuple[str, np.ndarray, int]] | None = \
            {} if keep_retired else None
        self.counts = {"evicted": 0, "replaced": 0, "erased": 0}

    def __len__(self) -> int:
        return len(self._live)

    def lookup(self, name: str, worker: int, rec: np.ndarray) -> int:
        """The number of ``name``'s entry if ``worker``'s record ``rec`` equals its row there,
        else ``MISS``."""
        number = self._names.get(name)
        if number is None:
            return MISS
        row = self._live[number][1][worker]
        # (bytes compared: a record is a few hundred bytes, and np.array_equal's checks cost
        # more than the comparison itself on every collective)
        return number if row.shape == rec.shape and row.tobytes() == rec.tobytes() else MISS

    def live(self, number: int) -> bool:
        return number in self._live

    def entry(self, number: int) -> tuple[str, np.ndarray] | None:
        """(name, every worker's record) of a live or retired entry; None if unknown."""
        if number in self._live:
            return self._live[number]
        if self.retired is not None and number in self.retired:
            return self.retired[number][:2]
        return None

    def use(self, number: int) -> tuple[str, np.ndarray]:
        """An answer from the cache: the entry becomes the most recently used."""
        if number not in self._live:
            raise RuntimeError(f"response cache out of step: entry {number} was answered but "
                               f"is not in this member's cache (a bug in mpsync)")
        name, records = self._live[number]
        self._names.move_to_end(name)
        return name, records

    def answered(self, name: str, records: np.ndarray) -> None:
        """A full answer for ``name``: cache it if it may be, else forget any entry of it."""
        if self.capacity == 0 or unnamed_key(name) is not None:
            return
        kinds = records[:, meta.Field.KIND]
        if np.any(kinds == meta.JOINED):
            return
        ok = meta.mismatch(records, _CODES, _CODES) is None and \
            all(k in CACHED_KINDS for k in meta.part_kinds(records))
        number = self._names.get(name)
        if number is not None:
            if ok and np.array_equal(self._live[number][1], records):
                self._names.move_to_end(name)
                return
            self._retire(name, "replaced" if ok else "erased")
        if not ok:
            return
        frozen = np.array(records, dtype=np.int64)
        frozen.setflags(write=False)
        self._names[name] = self._next
        self._live[self._next] = (name, frozen)
        self._next += 1
        while len(self._names) > self.capacity:
            self._retire(next(iter(self._names)), "evicted")

    def _retire(self, name: str, why: str) -> None:
        number = self._names.pop(name)
        _, records = self._live.pop(number)
        self.counts[why] += 1
        if self.retired is not None:  # this answer is number ``applied + 1``
            self.retired[number] = (name, records, self.applied + 1)

    def forget_retired(self, applied_by_all: int) -> None:
        """Drop the retired entries every member has seen retired."""
        if self.retired:
            self.retired = {n: e for n, e in self.retired.items() if e[2] > applied_by_all}
