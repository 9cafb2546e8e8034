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


@jit(inline=True)
def _heap_push(q, t, key):
    ht, hk = q.heap_t, q.heap_key
    i = q.counters[_SIZE]
    q.counters[_SIZE] = i + 1
    while i > 0:
        parent = (i - 1) >> 1
        if ht[parent] < t or (ht[parent] == t and hk[parent] < key):
            break
        ht[i] = ht[parent]
        hk[i] = hk[parent]
        i = parent
    ht[i] = t
    hk[i] = key


@jit(inline=True)
def _heap_pop(q):
    """The top's key, removed (its time is ``heap_t[0]`` before the call)."""
    ht, hk = q.heap_t, q.heap_key
    top = hk[0]
    n = q.counters[_SIZE] - 1
    q.counters[_SIZE] = n
    t, key = ht[n], hk[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (ht[c + 1] < ht[c] or (ht[c + 1] == ht[c] and hk[c + 1] < hk[c])):
            c += 1
        if t < ht[c] or (t == ht[c] and key < hk[c]):
            break
        ht[i] = ht[c]
        hk[i] = hk[c]
        i = c
    ht[i] = t
    hk[i] = key
    return top


@jit(inline=True)
def push(q, kind, t, w):
    """Event ``kind`` of worker ``w`` at ``t``, after every event of that kind already
    scheduled for ``t``."""
    if kind == HEAP_KIND:
        q.counters[_SEQ] += 1
        _heap_push(q, t, (q.counters[_SEQ] << 20) | w)
        return
    i = q.head[kind] + q.size[kind]
    if i >= q.fifo_t.shape[1]:
        i -= q.fifo_t.shape[1]
    q.fifo_t[kind, i] = t
    q.fifo_w[kind, i] = w
    q.size[kind] += 1


@jit(inline=True)
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
        return best_t, best_k, _heap_pop(q) & 0xFFFFF
    i = q.head[best_k]
    w = q.fifo_w[best_k, i]
    i += 1
    if i == q.fifo_t.shape[1]:
        i = 0
    q.head[best_k] = i
    q.size[best_k] -= 1
    return best_t, best_k, w
