"""The messages of named negotiation (:mod:`~mpsync.torch._negotiation`) over MPI.

Every member of a set has a :class:`Channel` on a communicator reserved for negotiation: it
sends its requests (submit a name, withdraw one, join) to member 0 and receives member 0's
answers, which arrive in the order they were sent (MPI keeps the order of messages between
two ranks on one tag), so every member sees the same sequence of ``EXEC`` answers.  Member 0
also runs the :class:`Coordinator`: it drains the requests whenever that worker is inside a
collective call (there is no background thread: a worker waiting for a name keeps member 0's
part going only while member 0 is itself inside mpsync, as with order-matched collectives).

Because every member sees the same ``EXEC`` answers in the same order, every member keeps
the same response cache (:mod:`~mpsync.torch._response_cache`): a name submitted unchanged
by every worker travels as one entry number each way, as in Horovod's cache-hit path.

Horovod's cycle time (``HOROVOD_CYCLE_TIME``, 1 ms by default) is how often its background
thread negotiates what was queued meanwhile; here there is no thread to wake, and member 0
answers a name as soon as it is ready when no other name waits.  What the cycle buys in
Horovod -- names queued close together fused in one buffer -- is kept by its counterpart:
a name ready while others still wait is held at most one cycle time for them.

Why not the state server: it would add a hop through the server's loop (a thread of rank 0,
or a dedicated rank) to every collective and compete with the policy decisions it answers;
the workers' own member 0 answers in the same two messages without touching the server.
``mpsync bench allreduce`` measures both (see bench/allreduce/README.md).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from mpsync.config import HOROVOD_CACHE_CAPACITY, HOROVOD_CYCLE_MS
from mpsync.torch import _negotiation as neg
from mpsync.torch._response_cache import ResponseCache

__all__ = ["Channel", "Coordinator"]

_REQUEST_TAG, _ANSWER_TAG = 7401, 7402


def _receive(comm, source, tag) -> list[np.ndarray]:
    """Every message waiting from ``source`` on ``tag``, in order (cheap when none)."""
    from mpi4py import MPI

    out = []
    status = MPI.Status()
    while comm.Iprobe(source=source, tag=tag, status=status):
        buf = np.empty(status.Get_count(MPI.INT64_T), dtype=np.int64)
        comm.Recv([buf, MPI.INT64_T], source=status.Get_source(), tag=tag)
        out.append((status.Get_source(), buf))
    return out


class _Sender:
    def __init__(self, comm):
        self.comm = comm
        self._sends: list = []

    def send(self, buf: np.ndarray, dest: int, tag: int) -> None:
        from mpi4py import MPI

        if len(self._sends) > 64:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        self._sends.append((self.comm.Isend([buf, MPI.INT64_T], dest=dest, tag=tag), buf))


class Channel(_Sender):
    """One member's end: requests to member 0, answers from it.  Every request starts with
    its kind and the number of answers this member has applied to its copy of the response
    cache (``cache``; member 0 forgets a retired entry once every member is past it)."""

    def __init__(self, comm, cache: ResponseCache):
        super().__init__(comm)
        self.cache = cache

    def request(self, kind: int, parts=(), extra=()) -> None:
        self.send(neg.frame([[kind, self.cache.applied, *extra], *parts]), 0, _REQUEST_TAG)

    def submit(self, name: str, rec: np.ndarray) -> None:
        self.request(neg.SUBMIT, [rec, neg.name_words(name)])

    def hit(self, number: int) -> None:
        """Submit the name of cache entry ``number``, with this member's record there."""
        self.request(neg.HIT, extra=[number])

    def cancel(self, name: str) -> None:
        self.request(neg.CANCEL, [neg.name_words(name)])

    def join(self) -> None:
        # With the wall-clock time of the call (µs): "the worker that joined last" is the
        # last caller (``Negotiator.join``), not the last member 0 happened to read.
        self.request(neg.JOIN, extra=[time.time_ns() // 1000])

    def answers(self) -> list[list[np.ndarray]]:
        return [neg.unframe(buf) for _src, buf in _receive(self.comm, 0, _ANSWER_TAG)]


class Coordinator(_Sender):
    """Member 0's table and answers (see the module doc).  ``fusion_bytes`` 0: no fusion;
    ``cycle_s``: the longest a ready name is held back while other names wait (Horovod's
    cycle time); ``cache_capacity``: the response cache's (0: none;
    :mod:`~mpsync.torch._response_cache`); names waiting ``stall_after`` seconds are
    reported once on stderr (``report`` replaces the printing, for tests).

    ``stats``: ``exchanges_full`` (names answered with every worker's records),
    ``exchanges_skipped`` (names answered from the cache: every worker sent its entry's
    number, and the answer is that number), ``hits`` (such requests received)."""

    def __init__(self, comm, size: int, *, stall_after: float, deadline: float,
                 fusion_bytes: int = neg.FUSION_BYTES, cycle_s: float = HOROVOD_CYCLE_MS / 1e3,
                 cache_capacity: int = HOROVOD_CACHE_CAPACITY, report=None):
        super().__init__(comm)
        self.table = neg.Negotiator(size)
        self.size = size
        self.stall_after, self.deadline = stall_after, deadline
        self.fusion_bytes = fusion_bytes
        self.cycle_s = cycle_s
        self.cache = ResponseCache(cache_capacity, keep_retired=True)
        self._hits: dict[tuple[str, int], int] = {}  # (name, worker) -> entry it hit
        self._applied = [0] * size  # answers each member has applied, as it last said
        self.stats = {"exchanges_full": 0, "exchanges_skipped": 0, "hits": 0}
        self.report = report or (lambda text: print(text, file=sys.stderr, flush=True))
        self.stall_reports: list[dict] = []
        self._next_stall_check = 0.0
        self._ready: list = []  # answered at the end of the burst that made them ready
        self._ready_since = 0.0

    def _broadcast(self, parts) -> None:
        buf = neg.frame(parts)
        for w in range(self.size):
            self.send(buf, w, _ANSWER_TAG)

    def _execute(self, ready: list) -> None:
        """One EXEC answer per fusion group: its head the kind, the count, the fusion
        threshold (a grouped call's parts fuse by it on every member) and per name its cache
        entry (-1: answered in full, its name, records and numbers follow).  The cache
        changes name by name, in the order every member applies them."""
        for group in neg.fusion_groups(ready, self.fusion_bytes):
            head, body = [neg.EXEC, len(group), self.fusion_bytes], []
            for name, recs, numbers in group:
                hit = self._common_hit(name)
                if hit is not None and self.cache.live(hit):
                    self.cache.use(hit)
                    head.append(hit)
                    self.stats["exchanges_skipped"] += 1
                else:
                    self.cache.answered(name, recs)
                    head.append(-1)
                    body += [neg.name_words(name), recs, numbers]
                    self.stats["exchanges_full"] += 1
            self.cache.applied += 1
            self._broadcast([head] + body)

    def _common_hit(self, name: str) -> int | None:
        """The entry every worker hit for the answered ``name``, if they all hit one."""
        hits = {self._hits.pop((name, w), None) for w in range(self.size)}
        return hits.pop() if len(hits) == 1 and None not in hits else None

    def step(self) -> bool:
        """Drain the requests, answer what became ready; True if anything arrived."""
        requests = _receive(self.comm, _any_source(), _REQUEST_TAG)
        now = time.monotonic()
        ready = list(self._ready)
        for src, buf in requests:
            parts = neg.unframe(buf)
            kind = int(parts[0][0])
            self._applied[src] = max(self._applied[src], int(parts[0][1]))
            if kind == neg.SUBMIT:
                name = neg.word_name(parts[2])
                self._hits.pop((name, src), None)
                ready += self.table.submit(src, name, parts[1], now)
            elif kind == neg.HIT:
                number = int(parts[0][2])
                entry = self.cache.entry(number)
                if entry is None:
                    raise RuntimeError(f"response cache out of step: worker {src} hit entry "
                                       f"{number}, unknown to member 0 (a bug in mpsync)")
                name, records = entry
                self._hits[(name, src)] = number
                self.stats["hits"] += 1
                ready += self.table.submit(src, name, records[src], now)
            elif kind == neg.CANCEL:
                name = neg.word_name(parts[1])
                missing = self.table.cancel(src, name, now, self.deadline)
                if missing == neg.EXTEND:
                    self.send(neg.frame([[neg.EXTENDED], parts[1]]), src, _ANSWER_TAG)
                elif missing is not None:
                    self._hits.pop((name, src), None)
                    self.send(neg.frame([[neg.CANCELLED], parts[1], missing]), src,
                              _ANSWER_TAG)
            elif kind == neg.JOIN:
                newly, last = self.table.join(
                    src, int(parts[0][2]) if parts[0].size > 2 else None)
                ready += newly
                if last is not None:
                    self._execute(ready)
                    ready = []
                    self._broadcast([[neg.ALL_JOINED, last]])
        # Answer at once when no other name is waiting; otherwise gather what becomes ready
        # for up to a cycle, so that names submitted together share a buffer (Horovod's
        # cycle) while a lone collective pays no wait.
        if ready and not self._ready:
            self._ready_since = now
        if ready and (not self.table.waiting or now - self._ready_since >= self.cycle_s):
            self._execute(ready)
            ready = []
        self._ready = ready
        if requests and self.cache.retired:
            self.cache.forget_retired(min(self._applied))
        if now >= self._next_stall_check:
            self._next_stall_check = now + min(1.0, self.stall_after / 4)
            stalled = self.table.stalled(now, self.stall_after)
            if stalled:
                self.stall_reports.append(stalled)
                self.report(neg.stall_text(stalled, self.stall_after, self.deadline))
        return bool(requests)


def _any_source() -> int:
    from mpi4py import MPI

    return MPI.ANY_SOURCE
