"""Numba kernels of the ZipLine variants that scan Ω or the grid (ZipLine paper §5.1-5.3);
Ω itself, the input checks and the conventions every kernel follows (ordering, tie rule,
canonical ``z``) are in :mod:`mpsync.sched.zipline_omega`.  References in
:mod:`mpsync.sched.zipline_reference`. :func:`scan_keys` runs the search of ZipLineOptBS and
the window from Ω's sorted keys, without unpacking them.
"""

from __future__ import annotations

import numpy as np

from mpsync.sched._numba import jit

__all__ = ["z_at", "scan_basic", "scan_opt", "scan_optbs", "scan_window", "scan_keys",
           "scan_grid", "scan_fullgrid"]

@jit
def z_at(M, t_sync):
    """Canonical z: for each row the last index whose timestamp is <= t_sync (binary search)."""
    n, R = M.shape
    z = np.empty(n, dtype=np.int64)
    for p in range(n):
        lo = 0
        hi = R
        while lo < hi:
            m = (lo + hi) >> 1
            if M[p, m] <= t_sync:
                lo = m + 1
            else:
                hi = m
        z[p] = lo - 1
    return z


@jit
def scan_basic(M, ts, ws, want_candidates):
    """ZipLine, Alg. 2 (§5.2): O(Rn^2).

    Z is an unordered array of n (timestamp, worker) slots: finding the slot of the incoming
    worker and finding min(Z) are both linear scans, as in §5.2 ("the removal or replacement
    operation of an element costs O(n) ... it takes O(n) to find the element in Z with the
    earliest timestamp").
    """
    n, R = M.shape
    N = n * R
    cand = np.empty(N if want_candidates else 0, dtype=np.float64)
    nc = 0
    zt = np.empty(n, dtype=np.float64)
    zw = np.empty(n, dtype=np.int32)
    size = 0
    pos = 0
    t = 0.0
    # Lines 5-9: fill Z from the left of Ω, replacing an element of the same worker.
    while size < n:
        t = ts[pos]
        w = ws[pos]
        pos += 1
        j = 0
        while j < size and zw[j] != w:
            j += 1
        zt[j] = t
        if j == size:
            zw[j] = w
            size += 1
    mn = zt[0]
    for j in range(1, n):
        if zt[j] < mn:
            mn = zt[j]
    best_d = t - mn
    best_t = t
    if want_candidates:
        cand[nc] = best_d
        nc += 1
    # Lines 13-23: every further element of Ω replaces its worker's element and forms a Z.
    while pos < N:
        t = ts[pos]
        w = ws[pos]
        pos += 1
        j = 0
        while zw[j] != w:
            j += 1
        zt[j] = t
        mn = zt[0]
        for j in range(1, n):
            if zt[j] < mn:
                mn = zt[j]
        d = t - mn
        if want_candidates:
            cand[nc] = d
            nc += 1
        if d < best_d:
            best_d = d
            best_t = t
    return z_at(M, best_t), best_d, best_t, cand[:nc]


@jit
def scan_opt(M, ts, ws, want_candidates):
    """ZipLineOpt (§5.3.1): Z kept in arrival order, hence sorted; Thm. 3 pruning.

    Case (i), the oldest element of Z is the incoming worker's: drop it from the front and
    compute d_Z' = e' - (new oldest) in O(1). Case (ii): by Thm. 3 d_Z' >= d_Z, so d_Z' cannot
    be a strict improvement and is not evaluated; the worker's old element is found by a linear
    traversal and removed by shifting the elements after it one slot left, O(n).
    (With ``want_candidates`` the skipped d_Z' = e' - min(Z') is still recorded, for tests.)
    """
    n, R = M.shape
    N = n * R
    cand = np.empty(N if want_candidates else 0, dtype=np.float64)
    nc = 0
    zt = np.empty(N, dtype=np.float64)
    zw = np.empty(N, dtype=np.int32)
    present = np.zeros(n, dtype=np.bool_)
    head = 0
    tail = 0
    size = 0
    best_d = np.inf
    best_t = np.inf
    for pos in range(N):
        t = ts[pos]
        w = ws[pos]
        evaluate = False
        if not present[w]:
            present[w] = True
            size += 1
            evaluate = size == n  # the first complete Z (end of lines 5-9)
        elif size == n and zw[head] == w:
            head += 1  # case (i)
            evaluate = True
        else:
            j = head  # case (ii), or a repeat during the initial fill
            while zw[j] != w:
                j += 1
            for k in range(j + 1, tail):
                zt[k - 1] = zt[k]
                zw[k - 1] = zw[k]
            tail -= 1
        zt[tail] = t
        zw[tail] = w
        tail += 1
        if size == n:
            if evaluate:
                d = t - zt[head]
                if d < best_d:
                    best_d = d
                    best_t = t
                if want_candidates:
                    cand[nc] = d
                    nc += 1
            elif want_candidates:
                cand[nc] = t - zt[head]
                nc += 1
    return z_at(M, best_t), best_d, best_t, cand[:nc]


@jit
def _scan_latest(M, ts, ws, want_candidates, prune):
    """The scan shared by ZipLineOptBS and the window: Z as the elements of Ω that are their
    worker's latest so far, its front min(Z) found by skipping the others.

    ``slot[p]`` is the Ω position of worker p's element in Z. The incoming element of worker p
    replaces it; if that was the front (case (i) of §5.3.1), the front moves on to the next
    element that is still its worker's latest (amortised O(1) each). With ``prune`` only the
    first complete Z and the Z' of case (i) are evaluated (Thm. 3; ZipLineOptBS), else every Z
    (the window; the skipped ones cannot be strict improvements either). ``candidates`` is the
    Alg. 2 sequence either way.
    """
    n, R = M.shape
    N = n * R
    cand = np.empty(N if want_candidates else 0, dtype=np.float64)
    nc = 0
    # Unsigned positions: numba adds negative-index wraparound code to every array access
    # through a signed index (unsigned: about 25 % faster on these scans).
    one = np.uint64(1)
    absent = np.uint64(N)  # no element of this worker scanned yet
    slot = np.full(n, absent, dtype=np.uint64)
    head = np.uint64(0)  # Ω position of min(Z)
    size = 0
    best_d = np.inf
    best_t = np.inf
    for pos in range(N):
        upos = np.uint64(pos)
        w = np.uint64(ws[upos])
        j = slot[w]
        slot[w] = upos
        evaluate = not prune
        if j == absent:
            size += 1
            evaluate = True  # the first complete Z, once size == n
        elif j == head:
            evaluate = True  # case (i): the oldest element is replaced
            head += one
            while slot[np.uint64(ws[head])] != head:  # stops at upos at the latest
                head += one
        if size == n:
            if evaluate:
                t = ts[upos]
                d = t - ts[head]
                if d < best_d:
                    best_d = d
                    best_t = t
                if want_candidates:
                    cand[nc] = d
                    nc += 1
            elif want_candidates:
                cand[nc] = ts[upos] - ts[head]
                nc += 1
    return z_at(M, best_t), best_d, best_t, cand[:nc]


@jit
def scan_optbs(M, ts, ws, want_candidates):
    """ZipLineOptBS (§5.3.2): ZipLineOpt whose case (ii) finds the old element without a
    linear traversal.

    Z is kept in arrival order, i.e. in Ω order, as in ZipLineOpt (§5.3.1): case (i), the
    oldest element of Z is the incoming worker's, drops it and evaluates d_Z' = e' - (new
    oldest); case (ii) removes the worker's old element e_{i-1}^p and, by Thm. 3, does not
    evaluate Z' (:func:`_scan_latest` with pruning). What differs from §5.3.2 is how e_{i-1}^p
    is found and removed; neither changes which candidates are evaluated or the result:

    * Departure [zipline-optbs-dead-marks]: Z is not a separate array but Ω itself: an element
      of Ω is in Z while it is its worker's latest element so far, so removing e_{i-1}^p is
      only a matter of that worker's newer element arriving, and nothing is shifted. Shifting
      costs O(n) per case (ii), which the paper's (1-α)·O(Rn log n) bound leaves out; with the
      §6.1 data α is small (the incoming worker is rarely the oldest in Z), so it would make
      the variant O(Rn^2) in practice. The front of Z, min(Z), moves past the dead elements
      (amortised O(1) each).
    * Departure [zipline-optbs-finger]: where §5.3.2 reads e_{i-1}^p's timestamp from 𝓜 and
      binary searches Z for it (O(log n)), each worker's slot in Z (its element's position in
      Ω) is remembered, so locating it takes one load. Elements never move, so the slot is
      always right. The binary searches, chains of ~log2 n dependent loads per element of Ω,
      were most of this scan's time, also when only the elements that a compaction of a
      bounded Z had moved were searched.
    """
    return _scan_latest(M, ts, ws, want_candidates, True)


@jit
def scan_window(M, ts, ws, want_candidates):
    """Two-pointer window over Ω: O(Rn) scan (mpsync's own variant). Ω comes from
    :func:`omega`: a k-way merge of the sorted rows, O(Rn log n), or, for large matrices, a
    vectorized sort of integer keys, O(Rn log Rn) but faster where numpy's sort is vectorized.

    The right end walks Ω; the left end is the earliest element that is still its worker's
    latest (:func:`_scan_latest` without pruning). Once all n workers are covered, the window
    holds every worker's latest element and its left end is min(Z) of Alg. 2 at the same step,
    so every Z of Alg. 2 is evaluated, in the same order, at O(1) amortised each instead of
    O(n) (Alg. 2).
    """
    return _scan_latest(M, ts, ws, want_candidates, False)


@jit
def _keys_in_omega_order(M, keys, ibits, ws):
    """Fill ``ws`` with the worker of each sorted 64-bit key (of ``omega_keys``); True if the
    keys are in Ω's order.

    Neighbours whose keys have different time parts are in time order by construction; those
    with the same time part (truncated timestamps) come by index, which is Ω's order only if
    their timestamps are in order too, so only they are read from M. On §6.1 data there are
    none; the first loop, without a branch, vectorizes.
    """
    n, R = M.shape
    N = n * R
    mask = (np.uint64(1) << np.uint64(ibits)) - np.uint64(1)
    uibits = np.uint64(ibits)
    # idx // R by a multiplication, exact for n·R < 2^48 (see omega_unpack).
    inv = 1.0 / R
    ws[0] = np.int32(((keys[0] & mask) + 0.5) * inv)
    ties = 0
    for pos in range(1, N):
        key = keys[pos]
        ws[pos] = np.int32(((key & mask) + 0.5) * inv)
        ties += ((key ^ keys[pos - 1]) >> uibits) == 0
    if ties:
        flat = M.reshape(N)
        for pos in range(1, N):
            a = keys[pos - 1]
            b = keys[pos]
            if ((a ^ b) >> uibits) == 0 and flat[a & mask] > flat[b & mask]:
                return False
    return True


@jit
def scan_keys(M, keys, ibits, ws):
    """ZipLineOptBS's and the window's search (:func:`_scan_latest`) from the sorted 64-bit
    keys of :func:`mpsync.sched.zipline_omega.omega_keys`, without unpacking Ω's timestamps:
    returns ``(ok, z, d, t_sync)``, the same as those variants, or ``ok`` False if the keys
    are not in Ω's order (the caller then unpacks them, which restores it). ``ws`` (int32, one
    per element) receives the workers in Ω's order.

    A key's low ``ibits`` bits name its element; its timestamp is read from M only where a
    candidate is evaluated: the first complete Z and each Z after min(Z) moved. Every other Z
    has d at least its predecessor's: for ZipLineOptBS that is Thm. 3, for the window its left
    end stayed and its right end moved later. Neither can be a strict improvement, so the
    result, tie rule included, is the same. On §6.1 data min(Z) moves at 5-8 % of the
    elements, so most of the gather of Ω's timestamps from M, which no longer fits the cache
    on large matrices, and the timestamps' array are saved.
    """
    if not _keys_in_omega_order(M, keys, ibits, ws):
        return False, np.zeros(0, dtype=np.int64), np.inf, np.inf
    n, R = M.shape
    N = n * R
    flat = M.reshape(N)
    mask = (np.uint64(1) << np.uint64(ibits)) - np.uint64(1)
    one = np.uint64(1)
    absent = np.uint64(N)
    slot = np.full(n, absent, dtype=np.uint64)  # Ω position of each worker's element in Z
    head = np.uint64(0)
    size = 0
    best_d = np.inf
    best_t = np.inf
    for pos in range(N):
        upos = np.uint64(pos)
        w = np.uint64(ws[upos])
        j = slot[w]
        slot[w] = upos
        if j == absent:
            size += 1
            moved = True
        elif j == head:
            moved = True
            head += one
            while slot[np.uint64(ws[head])] != head:  # stops at upos at the latest
                head += one
        else:
            moved = False
        if moved and size == n:
            t = flat[keys[upos] & mask]
            d = t - flat[keys[head] & mask]
            if d < best_d:
                best_d = d
                best_t = t
    return True, z_at(M, best_t), best_d, best_t


@jit
def _first_not_before(M, p, e):
    """Index of the first element of row p that is >= e, or R if none (linear, as in Alg. 1)."""
    R = M.shape[1]
    j = 0
    while j < R and M[p, j] < e:
        j += 1
    return j


@jit
def _grid_candidate(M, q, i):
    """d and t_sync of the candidate around designated element M[q, i] (Alg. 1 line 10), or
    (inf, inf) when some row has nothing at or after it."""
    n, R = M.shape
    e = M[q, i]
    hi = e
    for p in range(n):
        if p == q:
            continue
        j = _first_not_before(M, p, e)
        if j == R:
            return np.inf, np.inf
        if M[p, j] > hi:
            hi = M[p, j]
    return hi - e, hi


@jit
def scan_grid(M, want_candidates):
    """GridScan, Alg. 1 (§5.1), a heuristic: O(R^2 n).

    The designated row is the one with the earliest first timestamp (line 4; ties: lowest id).
    For each of its R elements e, every other row contributes the element "close to" e (line 10;
    Departure [zipline-gridscan-close-to]: the algorithm box is not in the text, "close to" is
    read as its earliest element not before e), so e is min(Z) and d_Z = max(Z) - e. Only R
    candidates are seen, so the optimum is missed whenever its earliest element lies in another
    row. Returns the Z it found (not the canonical z of the exact variants).
    """
    n, R = M.shape
    q = 0
    for p in range(1, n):
        if M[p, 0] < M[q, 0]:
            q = p
    cand = np.empty(R if want_candidates else 0, dtype=np.float64)
    best_d = np.inf
    best_t = np.inf
    best_i = 0
    for i in range(R):
        d, t = _grid_candidate(M, q, i)
        if want_candidates:
            cand[i] = d
        if d < best_d or (d == best_d and t < best_t):
            best_d = d
            best_t = t
            best_i = i
    z = np.empty(n, dtype=np.int64)
    e = M[q, best_i]
    for p in range(n):
        z[p] = best_i if p == q else _first_not_before(M, p, e)
    return z, best_d, best_t, cand


@jit
def scan_fullgrid(M, want_candidates):
    """FullGridScan (§5.1): GridScan with every row designated in turn (line 4 skipped),
    Rn candidates, O(R^2 n^2). Exact: the optimum's earliest element is designated once, and
    the earliest element not before it in every other row is no later than the optimum's."""
    n, R = M.shape
    cand = np.empty(n * R if want_candidates else 0, dtype=np.float64)
    best_d = np.inf
    best_t = np.inf
    for q in range(n):
        for i in range(R):
            d, t = _grid_candidate(M, q, i)
            if want_candidates:
                cand[q * R + i] = d
            if d < best_d or (d == best_d and t < best_t):
                best_d = d
                best_t = t
    return z_at(M, best_t), best_d, best_t, cand
