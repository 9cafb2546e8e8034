"""What the compiled engines keep so that a rule's scan over every worker becomes O(1) or
O(log n): the minimum and maximum of counts that only grow by one (push counts, rounds), the
lowest index at that minimum (DSSP's slowest worker), and the largest value with its lowest
index (ESync's slowest device).

The server scans its tables at every message (``sched.ssp_may_continue``'s minimum,
``sched.dssp_slowest``'s argmin, ``sched.esync_slowest``'s argmax, ``rules.esync_step``'s "is anyone a round behind?"); at
4,096 workers that is most of a simulated report's cost.  These structures give the same
answers (ties included: the lowest index, as the scans pick) and the rules are then asked with
them (``sched.within_staleness``, ``sched.dssp_on_push_given``, ``sched.esync_ready_given_slowest``,
``rules.round_pulled``).
``tests/test_simulate_index.py`` checks them against the scans on seeded random and adversarial
sequences.
"""

from __future__ import annotations

import numpy as np

from mpsync.sched._numba import jit

__all__ = ["new_counts", "count_up", "HistogramFull", "new_lowest_at_min", "lowest_at_min",
           "lowest_at_min_reference", "new_argmax_tree", "tree_set", "tree_top"]


class HistogramFull(ValueError):
    """The counts in a histogram of :func:`new_counts` spread over more values than it holds;
    the caller starts again with a larger one."""


@jit
def new_counts(n, capacity=1024):
    """The histogram of n counts that all start at 0, for counts that span at most
    ``capacity`` (a power of two) consecutive values at any time: indexed modulo
    ``capacity``."""
    if capacity < 1 or capacity & (capacity - 1):
        raise ValueError("the histogram's capacity must be a power of two")
    count = np.zeros(capacity, dtype=np.int64)
    count[0] = n
    return count


@jit(refcount=False)
def count_up(count, old, lo, hi):
    """A count went from ``old`` to ``old + 1``: move it in the histogram ``count`` and keep
    min (``lo``) and max (``hi``) of the counts without a scan; returns (count, lo, hi,
    whether the minimum rose).  The histogram is indexed modulo its length, so it never
    grows (the compiled loops do not allocate); :class:`HistogramFull` when the counts would
    span more values than it holds."""
    mask = count.shape[0] - 1
    count[old & mask] -= 1
    count[(old + 1) & mask] += 1
    if old + 1 > hi:
        hi = old + 1
        if hi - lo > mask:
            raise HistogramFull("the counts spread wider than the histogram holds")
    raised = False
    while count[lo & mask] == 0:
        lo += 1
        raised = True
    return count, lo, hi, raised


def new_lowest_at_min() -> np.ndarray:
    """The state of :func:`lowest_at_min`: [the minimum it last answered for, its cursor]."""
    return np.array([-1, 0], dtype=np.int64)


@jit(refcount=False)
def lowest_at_min(state, counts, lo):
    """The lowest index whose count is the minimum ``lo`` (``sched.dssp_slowest``'s answer),
    for counts that only grow.  While the minimum stays ``lo`` no count can come down to it,
    so the lowest index holding it only moves up: a cursor that starts at 0 each time the
    minimum has changed and steps over the indices that have left it.  Each value of the
    minimum costs at most one pass over the counts, however often it is asked, where a scan
    costs a pass per question (at 65,536 workers DSSP's controller is asked often enough
    that its scans made the run quadratic in the workers)."""
    if state[0] != lo:
        state[0] = lo
        state[1] = 0
    i = state[1]
    n = counts.shape[0]
    while i < n and counts[i] != lo:
        i += 1
    if i == n:
        raise ValueError("no count is at the minimum given")
    state[1] = i
    return i


def lowest_at_min_reference(counts, lo: int) -> int:
    """Reference of :func:`lowest_at_min`: the scan."""
    return [int(c) for c in counts].index(int(lo))


def new_argmax_tree(values: np.ndarray) -> np.ndarray:
    """A tournament tree over ``values``: node i holds the index of the largest value below
    it, the lowest index among equals (leaves past the end: -1)."""
    n = values.shape[0]
    size = 1
    while size < n:
        size *= 2
    tree = np.full(2 * size, -1, dtype=np.int64)
    tree[size:size + n] = np.arange(n)
    for i in range(size - 1, 0, -1):
        tree[i] = _winner(values, tree[2 * i], tree[2 * i + 1])
    return tree


@jit(refcount=False)
def _winner(values, a, b):
    """The left index unless the right one's value is strictly larger (the left subtree holds
    the lower indices, so ties go to the lowest index, as ``sched.esync_slowest``)."""
    if b < 0:
        return a
    if a < 0 or values[b] > values[a]:
        return b
    return a


@jit(refcount=False)
def tree_set(tree, values, i):
    """``values[i]`` has changed: replay the matches on its path to the root."""
    node = (tree.shape[0] // 2 + i) // 2
    while node >= 1:
        tree[node] = _winner(values, tree[2 * node], tree[2 * node + 1])
        node //= 2


@jit(refcount=False)
def tree_top(tree):
    """The index of the largest value (lowest among equals)."""
    return tree[1]
