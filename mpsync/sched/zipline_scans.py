"""Numba kernels of the ZipLine variants that scan Ω or the grid (ZipLine paper §5.1-5.3);
Ω itself, the input checks and the conventions every kernel follows (ordering, tie rule,
canonical ``z``) are in :mod:`mpsync.sched.zipline_omega`.  References in
:mod:`mpsync.sched.zipline_reference`.
"""

from __future__ import annotations

import numpy as np

from mpsync.sched._numba import jit

__all__ = ["z_at", "locate", "scan_basic", "scan_opt", "scan_optbs", "scan_window",
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
def locate(zt, zk, head, tail, t, key):
    """Position of (t, key) in the sorted slice [head, tail) of (zt, zk), which holds it.

    Branch-free lower bound: the trip count depends only on the length, and the comparison
    feeds a select, so a search costs ~log2(tail - head) loads and no mispredicted branches.
    """
    base = np.uint64(head)
    length = np.uint64(tail - head)
    one = np.uint64(1)
    while length > one:
        half = length >> one
        m = base + half
        x = zt[m - one]
        lt = (x < t) | ((x == t) & (zk[m - one] < key))
        base = m if lt else base
        length -= half
    x = zt[base]
    lt = (x < t) | ((x == t) & (zk[base] < key))
    return np.int64(base) + np.int64(lt)


# One kernel of this length on purpose: every step of the scan reads and updates the same
# state (Z, its front, the finger, the best candidate); split up, that state would pass through
# every call.  The docstring walks through the steps.
@jit
def scan_optbs(M, ts, ws, want_candidates):
    """ZipLineOptBS (§5.3.2): ZipLineOpt that locates the old element by binary search.

    The incoming element e_i^p tells, through the auxiliary matrix 𝓜, the timestamp of the
    element it replaces, e_{i-1}^p = M[p, i-1]; Z is sorted, so a binary search on (timestamp,
    worker, index) finds it in O(log n) even among equal timestamps (the "rare case" of §5.3.2).

    Three departures from §5.3.2, none of which changes candidates, pruning or result:

    * Departure [zipline-optbs-dead-marks]: the located element is marked dead instead of being
      removed by shifting its successors. Shifting costs O(n) per case (ii), which the paper's
      (1-α)·O(Rn log n) bound leaves out; with the §6.1 data α is small (the incoming worker is
      rarely the oldest in Z), so shifting would make the variant O(Rn^2) in practice. Dead
      entries keep their keys, so the array stays sorted for the binary search, and the front
      pointer skips them (amortised O(1)).
    * Departure [zipline-optbs-finger]: the search starts from a finger. Entries never move
      except at compaction (below), so the slot where e_{i-1}^p was written is still its slot
      unless a compaction has run since; that slot is checked first (one compare) and the binary
      search runs only when the check fails. In §5.3.2 the search is needed on every case (ii)
      because ZipLineOpt's removals shift the array. At n = 1000, R = 150 (§6.1 data) 8,700 of
      the 150,000 elements still need the binary search, and the scan (Ω given) takes about
      1.7 ms instead of 5.8 ms; the 137,000 searches of ~11 dependent loads each were two thirds of
      it.
    * Departure [zipline-optbs-compaction]: Z lives in a buffer of 16n + 1 slots. When the
      buffer is full, the live entries (at most n - 1 at that point) are moved, in order, to its
      start: O(n) every 15n or more elements, amortised O(1) each. This bounds the searched
      slice by 16n + 1 and Z's memory by O(n) instead of O(Rn). Without it the slice grows with
      every dead entry between the front and the end; once the fastest workers have used up
      their R predictions their last elements stay the oldest in Z, the front stops moving, and
      the slice reached 29,000 entries at n = 1000, R = 150 (§6.1 data). Each compaction makes
      the fingers of the entries it moves stale, so the buffer size sets how often the binary
      search runs: 46,000 searches at 4n + 1, 8,700 at 16n + 1, 3,900 at 32n + 1 (scan 3.0, 1.7
      and 1.6 ms, measured with signed indices; the unsigned ones below took 1.7 to 1.4 ms);
      16n + 1 keeps Z's arrays within 17 bytes x 16n (272 KB at n = 1000).
    """
    n, R = M.shape
    N = n * R
    cand = np.empty(N if want_candidates else 0, dtype=np.float64)
    nc = 0
    # Worker ids and slots are uint32: numba adds negative-index wraparound code to every array
    # access through a signed index, and this loop makes about ten per element (unsigned: the
    # scan about 25 % faster at n = 1000, R = 150). uint32 rather than uint64 because uint32
    # with int64 gives int64 in numba, where uint64 with int64 gives float64.
    one = np.uint32(1)
    cap = 16 * n + 1
    zt = np.empty(cap, dtype=np.float64)
    zk = np.empty(cap, dtype=np.int64)  # p * R + i: orders equal timestamps as Ω does
    alive = np.zeros(cap, dtype=np.bool_)
    seen = np.zeros(n, dtype=np.int64)  # elements of each row already scanned
    # M[p, i-1] for each worker's element in Z: the value §5.3.2 reads from 𝓜, kept in an
    # n-element array that stays in L1 cache (the n x R matrix does not).
    prev_t = np.empty(n, dtype=np.float64)
    finger = np.zeros(n, dtype=np.uint32)  # slot each worker's element in Z was written to
    head = np.uint32(0)
    tail = np.uint32(0)
    size = 0
    best_d = np.inf
    best_t = np.inf
    for pos in range(N):
        t = ts[pos]
        w = np.uint32(ws[pos])
        i = seen[w]
        seen[w] = i + 1
        key = np.int64(w) * R + i
        evaluate = False
        if i == 0:
            size += 1
            evaluate = size == n
        else:
            old = key - 1
            j = finger[w]
            # Slots below tail hold distinct entries, so a matching key is the element itself.
            if not (j < tail and zk[j] == old):
                j = np.uint32(locate(zt, zk, head, tail, prev_t[w], old))
            evaluate = size == n and j == head  # case (i): the oldest element is replaced
            alive[j] = False
            if j == head:
                head += one
                while head < tail and not alive[head]:
                    head += one
        if tail == cap:
            # Buffer full: keep the live entries, in order, at its start. The element just
            # replaced is already dead, so at most n - 1 entries survive.
            live = np.uint32(0)
            src = head
            while src < tail:
                if alive[src]:
                    zt[live] = zt[src]
                    zk[live] = zk[src]
                    alive[live] = True
                    live += one
                src += one
            src = live
            while src < tail:
                alive[src] = False
                src += one
            head = np.uint32(0)
            tail = live
        prev_t[w] = t
        finger[w] = tail
        zt[tail] = t
        zk[tail] = key
        alive[tail] = True
        tail += one
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
def scan_window(M, ts, ws, want_candidates):
    """Two-pointer window over Ω: O(Rn) scan (mpsync's own variant). Ω comes from
    :func:`omega`: a k-way merge of the sorted rows, O(Rn log n), or, for large matrices, a
    vectorized sort of integer keys, O(Rn log Rn) but faster where numpy's sort is vectorized.

    The right pointer walks Ω; ``count[p]`` is how many elements of worker p lie in the window.
    Once all n workers are covered, the left pointer moves past every element whose worker is
    covered again further right. The window then holds, for every worker, its latest element,
    and its left end is min(Z) of Alg. 2 at the same step, so the candidates are those of Alg. 2
    in the same order, at O(1) amortised each instead of O(n) (Alg. 2) or O(log n) (OptBS).
    """
    n, R = M.shape
    N = n * R
    cand = np.empty(N if want_candidates else 0, dtype=np.float64)
    nc = 0
    count = np.zeros(n, dtype=np.int32)
    covered = 0
    # Unsigned indices: no negative-index wraparound code on the accesses (see scan_optbs).
    one = np.uint32(1)
    left = np.uint32(0)
    best_d = np.inf
    best_t = np.inf
    for right in range(N):
        w = np.uint32(ws[right])
        if count[w] == 0:
            covered += 1
        count[w] += 1
        if covered == n:
            lw = np.uint32(ws[left])
            while count[lw] > 1:
                count[lw] -= 1
                left += one
                lw = np.uint32(ws[left])
            t = ts[right]
            d = t - ts[left]
            if want_candidates:
                cand[nc] = d
                nc += 1
            if d < best_d:
                best_d = d
                best_t = t
    return z_at(M, best_t), best_d, best_t, cand[:nc]


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
