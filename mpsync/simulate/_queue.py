"""The compiled engines' event queue: one FIFO per event kind, a heap only for iteration ends.

The exact engine keeps every event in one heap ordered by (time, kind, scheduling order).  In
the compiled engines every kind but one is scheduled at a time that never decreases from one
event to the next of that kind: a report reaches the server ``half`` a round trip after the
iteration that sent it ended (and iteration ends are handled in time order), a reply ``half``
after the server answered (the server answers at the time of the message it handles), a
transfer ends when the shards are free again (a time that only grows) or a fixed service after
it started.  So each of those kinds is a FIFO of its own, already in (time, scheduling order),
and only the iteration ends, whose times depend on each worker's draw, need a heap.  The next
event is the earliest of the FIFO heads and the heap's top, ties to the lower kind: the order of
the single heap, at O(1) per event for the FIFOs and a heap the size of the computing workers.

The queue is a named tuple of arrays (Numba passes it as it is): ``fifo_t``/``fifo_w`` [kinds,
capacity] ring buffers with ``head``/``size`` per kind (a kind holds at most one event per
worker: capacity = workers + 1), and a binary heap for the kind ``HEAP_KIND`` in
``heap_t``/``heap_key`` (key = sequence << 20 | worker, so equal times keep scheduling order)
with ``counters`` = [heap size, heap pushes so far].
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from numba import literal_unroll

from mpsync.sched._numba import jit

__all__ = ["EventQueue", "new_queue", "push", "pop", "MAX_WORKERS"]

MAX_WORKERS = 1 << 20    # the heap key keeps the worker in its low 20 bits
# Every engine numbers its event kinds 0..KINDS-1 with the iteration end HEAP_KIND (constants,
# so the compiled ``pop`` unrolls its scan of the FIFO heads).
KINDS = 7
HEAP_KIND = 4
_SIZE, _SEQ = 0, 1
_ALL_KINDS = tuple(range(KINDS))


class EventQueue(NamedTuple):
    fifo_t: np.ndarray     # float64 [kinds, capacity]
    fifo_w: np.ndarray     # int64 [kinds, capacity]
    head: np.ndarray       # int64 [kinds]
    size: np.ndarray       # int64 [kinds]
    heap_t: np.ndarray     # float64 [capacity]
    heap_key: np.ndarray   # int64 [capacity]
    counters: np.ndarray   # int64 [3]


def new_queue(workers: int) -> EventQueue:
    if workers > MAX_WORKERS:
        raise ValueError(f"the compiled engines handle up to {MAX_WORKERS} workers, "
                         f"got {workers}")
    cap = workers + 1
    return EventQueue(np.zeros((KINDS, cap)), np.zeros((KINDS, cap), np.int64),
                      np.zeros(KINDS, np.int64), np.zeros(KINDS, np.int64),
                      np.zeros(cap), np.zeros(cap, np.int64), np.zeros(2, np.int64))


@jit(refcount=False)
def _before(t, key, t2, key2):
    """Whether the heap entry (t, key) comes before (t2, key2): earlier, or at the same time
    scheduled first (keys are unique)."""
    return t < t2 or (t == t2 and key < key2)


@jit(refcount=False)
def _place(ht, hk, i, n, t, key):
    """Put the entry (t, key) into the hole ``i`` of the heap of ``n`` entries: entries that
    must come after it move down into the hole, towards the root (a new leaf) or from below
    (the last leaf put at the root)."""
    while i > 0 and _before(t, key, ht[(i - 1) >> 1], hk[(i - 1) >> 1]):
        ht[i], hk[i] = ht[(i - 1) >> 1], hk[(i - 1) >> 1]
        i = (i - 1) >> 1
    while 2 * i + 1 < n:
        c = 2 * i + 1
        if c + 1 < n and _before(ht[c + 1], hk[c + 1], ht[c], hk[c]):
            c += 1
        if not _before(ht[c], hk[c], t, key):
            break
        ht[i], hk[i] = ht[c], hk[c]
        i = c
    ht[i] = t
    hk[i] = key


@jit(refcount=False)
def push(q, kind, t, w):
    """Event ``kind`` of worker ``w`` at ``t``, after every event of that kind already
    scheduled for ``t``."""
    if kind == HEAP_KIND:
        q.counters[_SEQ] += 1
        size = q.counters[_SIZE] + 1
        q.counters[_SIZE] = size
        _place(q.heap_t, q.heap_key, size - 1, size, t, (q.counters[_SEQ] << 20) | w)
        return
    i = q.head[kind] + q.size[kind]
    if i >= q.fifo_t.shape[1]:
        i -= q.fifo_t.shape[1]
    q.fifo_t[kind, i] = t
    q.fifo_w[kind, i] = w
    q.size[kind] += 1


@jit(refcount=False)
def pop(q):
    """The next event ``(time, kind, worker)``, removed; kind -1 when there is none."""
    best_k = -1
    best_t = np.inf
    for k in literal_unroll(_ALL_KINDS):
        if k == HEAP_KIND:
            if q.counters[_SIZE] > 0 and q.heap_t[0] < best_t:
                best_t = q.heap_t[0]
                best_k = k
        elif q.size[k] > 0 and q.fifo_t[k, q.head[k]] < best_t:
            best_t = q.fifo_t[k, q.head[k]]
            best_k = k
    if best_k < 0:
        return best_t, best_k, 0
    if best_k == HEAP_KIND:
        w = q.heap_key[0] & 0xFFFFF
        size = q.counters[_SIZE] - 1
        q.counters[_SIZE] = size
        _place(q.heap_t, q.heap_key, 0, size, q.heap_t[size], q.heap_key[size])
        return best_t, best_k, w
    i = q.head[best_k]
    w = q.fifo_w[best_k, i]
    i += 1
    if i == q.fifo_t.shape[1]:
        i = 0
    q.head[best_k] = i
    q.size[best_k] -= 1
    return best_t, best_k, w
