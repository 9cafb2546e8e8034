"""Named negotiation: which collectives every worker has submitted, and in which order all of
them run -- the decision Horovod's controller makes on rank 0 -- as pure functions and one
small table.  No MPI and no torch here: names and int64 records in, decisions out.

Workers submit collectives by name in any order.  The coordinator (member 0 of the set) keeps,
for every name, the records of the workers that have submitted it; a name is *ready* once
every worker that has not joined has submitted it, and ready names are answered to every
worker in the order they became ready, so every worker starts the same data steps in the same
order whatever order it submitted them in.  Ready allreduces of one dtype and op, and
allgathers of one shape on every worker, that were answered together are fused into one
buffer up to a byte threshold (Horovod's tensor fusion, 128 MB by default as in Horovod
0.28.1, ``HOROVOD_FUSION_THRESHOLD``).  A grouped call is one name whose record holds its
parts' (:func:`~mpsync.torch._metadata.group_record`): one submission, one answer, and its
parts fused by the same rule (:func:`group_steps`).  A name negotiated before, submitted
unchanged by every worker, skips the exchange of records (the response cache,
:mod:`~mpsync.torch._response_cache`); the table sees it as any submission.

A worker that gives up on a name at its deadline withdraws its record (``cancel``); the
coordinator answers with the workers that never submitted it, so the name never runs with
part of the workers and the next names are not disturbed.  Names waiting longer than the
warning time are reported once each (Horovod's stall inspector).

The wire form of every message is one int64 array (:func:`frame` / :func:`unframe`); names
travel as their UTF-8 bytes (:func:`name_words` / :func:`word_name`).
"""

from __future__ import annotations

import numpy as np

from mpsync.config import HOROVOD_FUSION_BYTES
from mpsync.torch import _metadata as meta

__all__ = ["SUBMIT", "CANCEL", "JOIN", "HIT", "EXEC", "CANCELLED", "ALL_JOINED", "EXTENDED",
           "FUSION_BYTES", "ALLGATHER_FUSION_BYTES", "allgather_fusion_bytes",
           "REDUCESCATTER_FUSION_BYTES", "frame",
           "unframe", "name_words",
           "word_name", "Negotiator", "fusion_groups", "group_steps", "stall_text",
           "unnamed_key", "local_name", "UNNAMED"]

# Message kinds: worker -> coordinator, then coordinator -> worker.  HIT: a SUBMIT by the
# number of a response cache entry (mpsync.torch._response_cache).
SUBMIT, CANCEL, JOIN, HIT = 1, 2, 3, 4
EXEC, CANCELLED, ALL_JOINED, EXTENDED = 11, 12, 13, 14

# Allgathers fuse up to this many bytes of output, below the fusion threshold; on 2 workers
# up to twice that.  Packing and cutting copy every byte once more, a fused output that
# reaches the progress engine's lane size (4 MB) runs as a blocking call on a thread, and
# several fused steps in flight at once crawl on shared cores.  Measured with a grouped
# allgather of 4 tensors (ms per call, medians of runs of 100-400 calls back to back,
# bench/collectives/README.md): 2 ranks, 2 MB of output fused 0.47-1.26 against 1.6-2.2 as
# four, 4 MB fused 1.3-2.0 against 0.77-0.99; 4 ranks sharing 2 cores, 4 MB as four 2.7,
# fused in two steps of 2 MB 12.9, in one 5.5.
ALLGATHER_FUSION_BYTES = 1 << 20


def allgather_fusion_bytes(workers: int) -> int:
    """The most output bytes allgathers fuse into one step on ``workers`` workers."""
    return 2 * ALLGATHER_FUSION_BYTES if workers <= 2 else ALLGATHER_FUSION_BYTES

# Reduce-scatters fuse, up to this many bytes of input, into one allreduce of the packed
# tensors, each worker keeping its rows of each.  An allreduce moves twice a reduce-scatter's
# bytes, but below this size a collective costs its latency, not its bytes: one allreduce of
# a group instead of a reduce-scatter per tensor.  (Packing every member's rows of every part
# together for one reduce-scatter was slower still: the packing is per member and per part.)
REDUCESCATTER_FUSION_BYTES = 256 << 10

EXTEND = "extend"  # :meth:`Negotiator.cancel`'s answer: wait one more deadline

# Horovod 0.28.1's default HOROVOD_FUSION_THRESHOLD, 128 MB (horovod/common/operations.cc:
# ``SetTensorFusionThresholdBytes(128 * 1024 * 1024)``); the variable is read in mpsync.config.
FUSION_BYTES = HOROVOD_FUSION_BYTES


def frame(parts) -> np.ndarray:
    """One int64 array holding ``parts`` (int64 arrays or int lists): count, lengths, data."""
    arrays = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
    head = np.array([len(arrays)] + [a.size for a in arrays], dtype=np.int64)
    return np.concatenate([head] + arrays)


def unframe(buf: np.ndarray) -> list[np.ndarray]:
    n = int(buf[0])
    sizes = buf[1:1 + n]
    out, at = [], 1 + n
    for s in sizes:
        out.append(buf[at:at + int(s)])
        at += int(s)
    return out


def name_words(name: str) -> np.ndarray:
    raw = name.encode()
    padded = raw + b"\0" * (-len(raw) % 8)
    return np.concatenate([[len(raw)], np.frombuffer(padded, dtype=np.int64)]).astype(np.int64)


def word_name(words: np.ndarray) -> str:
    n = int(words[0])
    return np.ascontiguousarray(words[1:]).tobytes()[:n].decode()


UNNAMED = "noname"


def unnamed_key(local: str) -> str | None:
    """``"noname.7"`` (a worker's 7th unnamed collective) -> ``"noname"``; a name -> None."""
    head, dot, tail = local.rpartition(".")
    return head if dot and head == UNNAMED and tail.isdigit() else None


class Negotiator:
    """The coordinator's table for ``size`` workers (member indices 0..size-1).

    A named collective waits under its name.  Unnamed ones wait together, each worker's in
    the order it submitted them, and the first of every worker's are matched -- what
    Horovod's handle-numbered names do while the workers agree; unlike those, the next ones
    pair again after one worker withdrew one of its own at a deadline, and an unnamed
    allreduce on one worker against an unnamed allgather on another is a mismatch error on
    both instead of a stall."""

    def __init__(self, size: int):
        self.size = size
        self.waiting: dict[str, dict[int, list]] = {}  # key -> worker -> [(local, rec, t, n)]
        self.reported: set[str] = set()
        self.joined: list[int] = []  # in the order they joined
        self.called: dict[int, int | None] = {}  # worker -> when it called join() (µs)
        self._count: dict[str, int] = {}
        self.extended: set[tuple[str, int]] = set()
        self.gave_up: dict[int, tuple[int, float]] = {}  # worker -> (arrival, when)
        self._arrivals = 0

    def _ready(self, key: str) -> bool:
        have = self.waiting[key]
        return all(have.get(w) or w in self.joined for w in range(self.size))

    def _take(self, key: str) -> tuple[str, np.ndarray, np.ndarray]:
        """(name, every worker's record, every worker's number for an unnamed one)."""
        have = self.waiting[key]
        width = next(q[0][1].size for q in have.values() if q)
        recs = np.empty((self.size, width), dtype=np.int64)
        numbers = np.full(self.size, -1, dtype=np.int64)
        for w in range(self.size):
            if have.get(w):
                local, rec, _t, _seq = have[w].pop(0)
                recs[w] = _fit(rec, width)
                if local != key:
                    numbers[w] = int(local.rpartition(".")[2])
            else:
                recs[w] = _fit(meta.joined_record(self.size, 0), width)
        if not any(have.values()):
            del self.waiting[key]
        self.reported.discard(key)
        name = key
        if key == UNNAMED:
            self._count[key] = self._count.get(key, 0) + 1
            name = f"{key}.{self._count[key]}"
        return name, recs, numbers

    def submit(self, worker: int, local: str, rec: np.ndarray, now: float) -> list:
        """Record ``worker``'s request ``local``; what became ready (see :meth:`_take`)."""
        key = unnamed_key(local) or local
        queue = self.waiting.setdefault(key, {}).setdefault(worker, [])
        self._arrivals += 1
        queue.append((local, np.asarray(rec, dtype=np.int64), now, self._arrivals))
        return [self._take(key)] if self._ready(key) else []

    def cancel(self, worker: int, local: str, now: float, patience: float):
        """``worker`` withdraws ``local`` at its deadline: the workers that never submitted it;
        None if it is not waiting (it was answered already, and that answer is on its way);
        ``EXTEND`` (once per request) when a missing worker is stuck behind an older request
        of its own, or gave one up within ``patience`` seconds: a worker that skipped part of
        a sequence (a failing test) and went on leaves the others waiting for the rest; the
        older collective fails first, and this one, submitted after it, should then pair."""
        key = unnamed_key(local) or local
        queue = self.waiting.get(key, {}).get(worker, [])
        at = next((i for i, e in enumerate(queue) if e[0] == local), None)
        if at is None:
            return None
        missing = self.missing(key)
        seq = queue[at][3]
        stuck = any(self._oldest(m) < seq or (m in self.gave_up and self.gave_up[m][0] < seq
                                              and now - self.gave_up[m][1] < patience)
                    for m in missing)
        if stuck and (local, worker) not in self.extended:
            self.extended.add((local, worker))
            return EXTEND
        self.extended.discard((local, worker))
        self.gave_up[worker] = (seq, now)
        queue.pop(at)
        if not any(self.waiting[key].values()):
            del self.waiting[key]
            self.reported.discard(key)
        return missing

    def _oldest(self, worker: int) -> float:
        """The arrival number of ``worker``'s oldest waiting request (inf if none)."""
        return min((q[0][3] for have in self.waiting.values() for w, q in have.items()
                    if w == worker and q), default=float("inf"))

    def missing(self, key: str) -> list[int]:
        have = self.waiting.get(key, {})
        return [w for w in range(self.size) if not have.get(w) and w not in self.joined]

    def join(self, worker: int, called: int | None = None) -> tuple[list, int | None]:
        """``worker`` has joined (``called``: when it called ``join()``, wall-clock µs): the
        names that are ready without it, and the worker that joined last once every worker
        has (the table then forgets the joins).

        The last is the last caller, where every join carried its time: member 0 reads the
        joins between its own steps and waits, and several waiting are matched by source,
        not by arrival, so the read order can put a worker that called 0.2 s earlier last
        (a loaded host).  Clocks of different nodes may differ by their synchronisation's
        error: calls closer than that are near-ties either way."""
        if worker not in self.joined:
            self.joined.append(worker)
            self.called[worker] = called
        ready = []
        for key in list(self.waiting):
            while key in self.waiting and self._ready(key):
                ready.append(self._take(key))
        if len(self.joined) == self.size:
            last = self.joined[-1]
            if all(self.called.get(w) is not None for w in self.joined):
                # (on a tie, the one read last: ``max`` keeps the first of equals)
                last = max(reversed(self.joined), key=self.called.__getitem__)
            self.joined, self.called = [], {}
            return ready, last
        return ready, None

    def stalled(self, now: float, warn_after: float) -> dict[str, list[int]]:
        """Names waiting longer than ``warn_after`` seconds not reported before, with the
        workers that have not submitted them."""
        out = {}
        for key, have in self.waiting.items():
            oldest = min((q[0][2] for q in have.values() if q), default=now)
            if now - oldest >= warn_after and key not in self.reported:
                self.reported.add(key)
                out[key] = self.missing(key)
        return out


def _fit(rec: np.ndarray, width: int) -> np.ndarray:
    """``rec`` cut or padded with zeros to ``width``: a grouped call's record is longer than
    a single one's, and a worker that grouped another number of tensors under the same name
    (or called a single collective) is told so by the check, whose fields stay in place."""
    if rec.size == width:
        return rec
    out = np.zeros(width, dtype=np.int64)
    out[:min(width, rec.size)] = rec[:width]
    return out


def stall_text(stalled: dict[str, list[int]], warn_after: float, deadline: float) -> str:
    """Horovod's stall warning, per missing worker the names it has not submitted."""
    by_worker: dict[int, list[str]] = {}
    for name, workers in stalled.items():
        for w in workers:
            by_worker.setdefault(w, []).append(name)
    lines = [f"mpsync: one or more collectives were submitted by a subset of the workers and "
             f"have waited for the others for more than {warn_after:g}s (they fail at the "
             f"{deadline:g}s deadline). Missing workers:"]
    lines += [f"  worker {w}: {sorted(names)}" for w, names in sorted(by_worker.items())]
    return "\n".join(lines)


def _fusion_key(recs: np.ndarray):
    """What a collective may share one data step with (None: it runs alone): allreduces of
    one dtype and op; reduce-scatters of one dtype and op (one allreduce of them all, each
    worker keeping its rows); allgathers of any dtype (they move bytes) whose every worker
    sends the same shape, so each worker's part of the fused buffer has one size."""
    F = meta.Field
    r = recs[0]
    head = recs[:, :meta.HEAD]
    if not (head == head[0]).all():  # a joined worker answers on its own; a mismatch fails
        return None
    if r[F.INVALID]:
        return None
    if r[F.KIND] in (meta.ALLREDUCE, meta.REDUCESCATTER):
        return int(r[F.KIND]), int(r[F.DTYPE]), int(r[F.OP])
    if r[F.KIND] == meta.ALLGATHER:
        return (meta.ALLGATHER,)
    return None


def _fused_bytes(recs: np.ndarray) -> int:
    """The bytes a collective adds to a fused buffer: an allreduce's input; an allgather's
    output (every worker's rows)."""
    F = meta.Field
    r = recs[0]
    if r[F.KIND] == meta.ALLGATHER:
        return int(r[F.DIMS]) * int(r[F.ROW_BYTES]) * len(recs)
    return int(r[F.NBYTES])


def group_steps(parts: list[np.ndarray], threshold: int) -> list[list[int]]:
    """A grouped call's parts (each its workers' records, :func:`~mpsync.torch._metadata.
    group_parts`) cut into the data steps they run as, in order: parts fuse by the rule of
    :func:`fusion_groups`, as names answered together do.  Every worker cuts them alike from
    the same records and ``threshold`` (member 0's, sent with the answer)."""
    items = [(i, recs, None) for i, recs in enumerate(parts)]
    return [[item[0] for item in group] for group in fusion_groups(items, threshold)]


def local_name(name: str, numbers: np.ndarray, worker: int) -> str:
    """The name ``worker`` submitted for an answered ``name`` (its own number if unnamed)."""
    if int(numbers[worker]) < 0:
        return name
    return f"{UNNAMED}.{int(numbers[worker])}"


class _Codes(dict):
    """Renders any code (the cache's check needs only whether records differ)."""

    def __missing__(self, key):
        return str(key)

    def __getitem__(self, key):
        return str(key)


_CODES = _Codes()


def _kind_limit(kind: int, workers: int, threshold: int) -> int:
    if kind == meta.ALLGATHER:
        return min(threshold, allgather_fusion_bytes(workers))
    if kind == meta.REDUCESCATTER:
        return min(threshold, REDUCESCATTER_FUSION_BYTES)
    return threshold


def fusion_groups(ready: list, threshold: int = FUSION_BYTES) -> list[list]:
    """``ready`` (name, records) in order, cut into the groups that run as one data step:
    consecutive allreduces (or reduce-scatters) with the same dtype and op, or consecutive
    allgathers of one shape on every worker, with no mismatch, up to ``threshold`` bytes
    (Horovod fuses all three kinds; allgathers to :func:`allgather_fusion_bytes` of output and
    reduce-scatters to ``REDUCESCATTER_FUSION_BYTES`` of input at most); everything else
    alone.  ``threshold`` 0 turns fusion off."""
    if len(ready) < 2:
        return [list(ready)] if ready else []  # nothing to fuse with (the usual case)
    groups: list[list] = []
    key = None
    total = 0
    for item in ready:
        k = _fusion_key(item[1]) if threshold > 0 else None
        nbytes = _fused_bytes(item[1])  # item: (name, records, numbers)
        limit = threshold if k is None else _kind_limit(k[0], len(item[1]), threshold)
        if k is not None and k == key and total + nbytes <= limit:
            groups[-1].append(item)
            total += nbytes
        else:
            groups.append([item])
            key, total = k, nbytes
    return groups
