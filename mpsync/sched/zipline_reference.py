"""Plain-Python references for :mod:`mpsync.sched.zipline` (tests, ``NUMBA_DISABLE_JIT=1``).

Written independently of the kernels, from the paper's text: Ω is built with ``sorted`` on
(timestamp, worker, index) tuples, Z is a dict, the brute force enumerates all R^n solutions.
All return ``(z, d, t_sync, candidates)`` like the kernels.
"""

from __future__ import annotations

import bisect
import heapq
import itertools

import numpy as np

__all__ = [
    "brute_force",
    "canonical_z",
    "zipline_alg2",
    "zipline_opt",
    "zipline_optbs",
    "window_reference",
    "gridscan_reference",
    "check_reference",
    "omega",
]


def canonical_z(M, t_sync: float) -> np.ndarray:
    """For each row, the last index whose timestamp is <= t_sync."""
    return np.array([bisect.bisect_right(list(row), t_sync) - 1 for row in np.asarray(M)], dtype=np.int64)


def omega(M) -> list[tuple[float, int, int]]:
    """Ω of §5.2 Step 1: every (t, p, i), ascending by time, then worker id, then index."""
    M = np.asarray(M, dtype=np.float64)
    return sorted((float(M[p, i]), p, i) for p in range(M.shape[0]) for i in range(M.shape[1]))


def brute_force(M):
    """Naive search (§5.1): all R^n solutions; minimum d, then earliest t_sync. O(R^n n)."""
    M = np.asarray(M, dtype=np.float64)
    n, R = M.shape
    best = None
    for choice in itertools.product(range(R), repeat=n):
        values = [float(M[p, i]) for p, i in enumerate(choice)]
        key = (max(values) - min(values), max(values))
        if best is None or key < best:
            best = key
    d, t = best
    return canonical_z(M, t), d, t, None


def zipline_alg2(M):
    """ZipLine, Alg. 2, literally: fill Z from the left of Ω, then one candidate per element."""
    M = np.asarray(M, dtype=np.float64)
    n = M.shape[0]
    elements = omega(M)
    Z: dict[int, float] = {}
    pos = 0
    while len(Z) < n:
        t, p, _ = elements[pos]
        Z[p] = t
        pos += 1
    candidates = [t - min(Z.values())]
    best_d, best_t = candidates[0], t
    for t, p, _ in elements[pos:]:
        Z[p] = t
        d = t - min(Z.values())
        candidates.append(d)
        if d < best_d:
            best_d, best_t = d, t
    return canonical_z(M, best_t), best_d, best_t, np.array(candidates)


def _opt_scan(M, locate):
    """The scan shared by ZipLineOpt and ZipLineOptBS (§5.3.1): Z is a list of (t, p, i) in
    arrival order, i.e. in Ω order, so Z[0] is min(Z) and the newest element max(Z). ``locate``
    finds the index in Z of the incoming worker's previous element."""
    M = np.asarray(M, dtype=np.float64)
    n = M.shape[0]
    Z: list[tuple[float, int, int]] = []
    workers: set[int] = set()
    best = None
    candidates = []
    for t, p, i in omega(M):
        complete = len(Z) == n
        evaluate = False
        if p not in workers:
            workers.add(p)
            evaluate = len(workers) == n  # the first complete Z
        else:
            j = locate(Z, M, t, p, i)
            # Case (i): the oldest element is the incoming worker's, min(Z') is its successor.
            # Case (ii): Thm. 3, d_Z' >= d_Z, so Z' is not evaluated.
            evaluate = complete and j == 0
            del Z[j]
        Z.append((t, p, i))
        if len(Z) == n:
            d = t - Z[0][0]
            # Skipped d_Z' are recorded too: they are the Alg. 2 candidates the kernels report.
            candidates.append(d)
            if evaluate and (best is None or d < best[0]):
                best = (d, t)
    return canonical_z(M, best[1]), best[0], best[1], np.array(candidates)


def zipline_opt(M):
    """ZipLineOpt (§5.3.1): Z kept in arrival order; case (i) drops the oldest element and
    evaluates d_Z' = e' - (new oldest); case (ii) finds the worker's old element by a linear
    traversal, removes it and, by Thm. 3, does not evaluate Z'."""

    def linear(Z, M, t, p, i):
        return next(j for j, e in enumerate(Z) if e[1] == p)

    return _opt_scan(M, linear)


def zipline_optbs(M):
    """ZipLineOptBS (§5.3.2): ZipLineOpt, but the old element e_{i-1}^p is located by binary
    search on its timestamp read from 𝓜 (``bisect`` on (t, p, i); equal timestamps are ordered
    by worker id, the "rare case" of §5.3.2) and removed by shifting (``del``)."""

    def binary(Z, M, t, p, i):
        old = (float(M[p, i - 1]), p, i - 1)
        j = bisect.bisect_left(Z, old)
        assert Z[j] == old, "Z is not in Ω order"
        return j

    return _opt_scan(M, binary)


def check_reference(M) -> tuple[int, int]:
    """The validation behind ``zipline``'s ValueErrors (§5.1: rows of 𝓜 are predicted pushes in
    time order): ``(1, p)`` for the first row p with NaN/inf, ``(2, p)`` for the first row p
    that decreases, ``(0, -1)`` otherwise; a row is judged by its first problem."""
    for p, row in enumerate(np.asarray(M, dtype=np.float64).tolist()):
        for i, x in enumerate(row):
            if x != x or x in (float("inf"), float("-inf")):
                return 1, p
            if i and x < row[i - 1]:
                return 2, p
    return 0, -1


def window_reference(M):
    """k-way merge (``heapq.merge``) + two-pointer window over worker counts."""
    M = np.asarray(M, dtype=np.float64)
    n = M.shape[0]
    rows = [[(float(M[p, i]), p, i) for i in range(M.shape[1])] for p in range(n)]
    merged = list(heapq.merge(*rows))
    count = [0] * n
    covered = left = 0
    best = None
    candidates = []
    for t, p, _ in merged:
        covered += count[p] == 0
        count[p] += 1
        if covered < n:
            continue
        while count[merged[left][1]] > 1:
            count[merged[left][1]] -= 1
            left += 1
        d = t - merged[left][0]
        candidates.append(d)
        if best is None or d < best[0]:
            best = (d, t)
    return canonical_z(M, best[1]), best[0], best[1], np.array(candidates)


def gridscan_reference(M, full: bool = False):
    """GridScan (Alg. 1) or, with ``full``, FullGridScan (§5.1). For each designated element e,
    every other row contributes its earliest element not before e."""
    M = np.asarray(M, dtype=np.float64)
    n, R = M.shape
    rows = range(n) if full else [min(range(n), key=lambda p: (M[p, 0], p))]
    best = None
    candidates = []
    for q in rows:
        for i in range(R):
            e = float(M[q, i])
            picks = [i if p == q else bisect.bisect_left(list(M[p]), e) for p in range(n)]
            if any(j == R for j in picks):
                candidates.append(np.inf)
                continue
            hi = max(float(M[p, j]) for p, j in enumerate(picks))
            candidates.append(hi - e)
            if best is None or (hi - e, hi) < best[:2]:
                best = (hi - e, hi, picks)
    d, t, picks = best
    z = canonical_z(M, t) if full else np.array(picks, dtype=np.int64)
    return z, d, t, np.array(candidates)
