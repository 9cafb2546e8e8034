"""Numba kernels behind :func:`mpsync.sched.zipline` (ZipLine paper §5; references in
:mod:`mpsync.sched.zipline_reference`).

Conventions shared by every kernel:

* ``M`` is float64[n, R], C-contiguous, finite, every row non-decreasing (checked by
  :func:`_check` before any kernel runs).
* Ω, the merged timeline of §5.2 Step 1, is ordered by (timestamp, worker id, iteration index):
  §5.2 sorts equal timestamps by worker id, and within a row equal timestamps keep their index
  order. :func:`omega` builds it, by merging the rows (:func:`_merge`, small matrices) or by
  sorting one unique integer key per element (:func:`_omega_keys`, :func:`_omega_unpack`);
  both give the same arrays bit for bit. The variants that scan Ω take it as ``ts, ws``.
* Every kernel returns ``(z, d, t_sync, candidates)``. ``d`` is always computed as
  ``max(Z) - min(Z)`` of actual timestamps, so two variants that find the same pair of end
  points agree bit for bit and the tie rule below is decided on identical floats.
* Tie rule (§4.2, Thm. 1 and Corollary 1): minimum d, then the earliest t_sync. Scanning Ω from
  the left and keeping a candidate only when it is strictly better implements it.
* ``z`` of an exact variant is canonical: for each worker the last predicted push not after
  t_sync, ``z[p] = max{i : M[p, i] <= t_sync}`` (:func:`_z_at`). Among solutions with the same
  d and t_sync this is the one in which every worker waits least. Alg. 2 taken literally may
  return an earlier element for a worker whose push at exactly t_sync comes later in the
  equal-timestamp order; finishing that tie group is what makes z independent of the scan.
"""

from __future__ import annotations

import threading

import numpy as np

from mpsync.sched._numba import jit

# Status codes of _check; zipline() turns them into ValueError messages.
OK = 0
NOT_FINITE = 1
NOT_SORTED = 2


@jit
def _check(M):
    """(status, row): the first row that is non-finite or decreasing, else (OK, -1)."""
    n, R = M.shape
    # Valid input is the common case: one pass without early exits, which compiles to vector
    # code, decides it (about 4x faster than the walk below at n = 1000, R = 150); only a bad
    # matrix is walked again to name its first bad row.
    bad = False
    for p in range(n):
        bad |= not abs(M[p, 0]) < np.inf  # NaN compares False
        for i in range(1, R):
            x = M[p, i]
            bad |= (not abs(x) < np.inf) | (x < M[p, i - 1])
    if not bad:
        return OK, -1
    for p in range(n):
        prev = M[p, 0]
        if not np.isfinite(prev):
            return NOT_FINITE, p
        for i in range(1, R):
            x = M[p, i]
            if not np.isfinite(x):
                return NOT_FINITE, p
            if x < prev:
                return NOT_SORTED, p
            prev = x
    return OK, -1


@jit
def _merge(M):
    """Ω as two arrays (timestamps, worker ids): a k-way merge of the n sorted rows.

    The k = n runs are merged pairwise, bottom-up, in ceil(log2 n) passes of Rn element moves
    each: O(Rn log n). Each 2-way merge is stable and its left run always holds the lower worker
    ids, so equal timestamps come out by worker id and, within a row, by index: exactly the Ω
    order of §5.2. Speed (this is most of the cost of "window" and "optbs"): every 2-way merge
    runs from both ends at once (two independent dependency chains per step), branch-free
    selects, unsigned indices (no negative-index wraparound code), and no bounds checks for
    the first min(la, lb) steps at each end, which is all of an equal-length pair (about 20 %
    faster than checking all five cursors on every step, at n = 1000, R = 150).
    """
    n, R = M.shape
    N = n * R
    src_t = M.copy().reshape(N)
    src_w = np.empty(N, dtype=np.int32)
    for p in range(n):
        for i in range(R):
            src_w[p * R + i] = p
    dst_t = np.empty(N, dtype=np.float64)
    dst_w = np.empty(N, dtype=np.int32)
    zero = np.uint64(0)
    one = np.uint64(1)
    un = np.uint64(N)
    width = np.uint64(R)
    while width < un:
        lo = np.uint64(0)
        while lo < un:
            mid = min(lo + width, un)
            hi = min(lo + width + width, un)
            if mid >= hi or src_t[mid - one] <= src_t[mid]:
                # Nothing to interleave (a lone run, or runs that do not overlap): copy.
                j = lo
                while j < hi:
                    dst_t[j] = src_t[j]
                    dst_w[j] = src_w[j]
                    j += one
                lo = hi
                continue
            a = lo  # front cursors: next element of each run
            b = mid
            k = lo
            ae = mid  # back cursors: one past the last unused element of each run
            be = hi
            kb = hi
            # min(la, lb) steps from each end need no bounds checks: after s of them from the
            # front, a - lo <= s and b - mid <= s, so both front cursors are still inside their
            # runs (likewise at the back), and the front has written the s first elements of
            # the merge, the back the s last. Equal runs (all pairs of a pass but the last)
            # are then complete.
            steps = min(mid - lo, hi - mid)
            while steps > zero:
                ta = src_t[a]
                tb = src_t[b]
                c = np.uint64(tb < ta)  # ties take the left run: stable
                dst_t[k] = tb if c else ta
                dst_w[k] = src_w[b] if c else src_w[a]
                b += c
                a += one - c
                k += one
                xa = src_t[ae - one]
                xb = src_t[be - one]
                c = np.uint64(xa > xb)  # ties take the right run last: stable
                kb -= one
                dst_t[kb] = xa if c else xb
                dst_w[kb] = src_w[ae - one] if c else src_w[be - one]
                ae -= c
                be -= one - c
                steps -= one
            # Unequal runs: the middle la - lb elements, from the front with bounds checks.
            while k < kb:
                if a < mid and (b >= hi or not src_t[b] < src_t[a]):
                    dst_t[k] = src_t[a]
                    dst_w[k] = src_w[a]
                    a += one
                else:
                    dst_t[k] = src_t[b]
                    dst_w[k] = src_w[b]
                    b += one
                k += one
            lo = hi
        src_t, dst_t = dst_t, src_t
        src_w, dst_w = dst_w, src_w
        width = width + width
    return src_t, src_w


# Below this many elements Ω is built by _merge: for small matrices the fixed costs of the sort
# path (three calls, numpy's sort dispatch, the workspace lookup) exceed the whole merge.
# Measured on §6.1 data: 60 elements 1.9 µs merged, 2.9 µs sorted; 300 elements 4.5 vs 4.1 µs.
OMEGA_SORT_MIN = 256

_workspace = threading.local()


@jit
def _float_key(b):
    """The uint64 that orders like the float64 whose bits are ``b``: sign bit set on
    non-negatives, all bits flipped on negatives. -0.0 gets the key of +0.0, because Ω treats
    them as equal timestamps and orders them by worker id."""
    top = np.uint64(63)
    sign = np.uint64(1) << top
    if b == sign:
        b = np.uint64(0)
    return ~b if b >> top else b | sign


@jit
def _omega_keys(M, keys):
    """Fill ``keys`` with one unique uint64 sort key per element of M (§5.2 Step 1); return
    ``(ibits, exact)``.

    Each timestamp becomes an unsigned integer that orders like the float (:func:`_float_key`).
    The minimum key is subtracted and the element's worker-major index p·R + i fills the low
    ``ibits`` bits, so equal timestamps sort by worker, then column: Ω's order. When the
    timestamp span and the index together need more than 64 bits, the lowest bits of the
    timestamp are dropped and ``exact`` is False; timestamps that then share a key prefix sort
    by index and :func:`_omega_unpack` puts them back in time order. (§6.1 data at n = 1000,
    R = 150: the timestamps span 55 key bits, the index 18, so 9 bits are dropped.)
    """
    n, R = M.shape
    N = n * R
    bits = M.reshape(N).view(np.uint64)
    # Rows are non-decreasing: the extreme keys are in the first and last columns.
    kmin = _float_key(bits[0])
    kmax = _float_key(bits[R - 1])
    for p in range(1, n):
        a = _float_key(bits[p * R])
        b = _float_key(bits[p * R + R - 1])
        if a < kmin:
            kmin = a
        if b > kmax:
            kmax = b
    span = kmax - kmin
    nbits = 0
    while nbits < 64 and (span >> np.uint64(nbits)) != np.uint64(0):
        nbits += 1
    ibits = 0
    while ((N - 1) >> ibits) != 0:
        ibits += 1
    shift = max(0, nbits + ibits - 64)
    ushift = np.uint64(shift)
    uibits = np.uint64(ibits)
    for j in range(N):
        keys[j] = (((_float_key(bits[j]) - kmin) >> ushift) << uibits) | np.uint64(j)
    return ibits, shift == 0


@jit
def _omega_unpack(M, keys, ibits, ts, ws):
    """Ω from the sorted keys of :func:`_omega_keys`: ``ts[k]``, ``ws[k]`` are the timestamp
    (bit for bit, -0.0 included) and worker of the k-th element. Returns False, leaving the
    arrays unspecified, if restoring time order among truncated keys would take more than
    4·Rn element moves (the caller then merges instead).

    With truncated keys, elements whose keys share a prefix come out by index. A stable
    insertion sort on the timestamp restores Ω's order: equal timestamps always share the
    prefix, so they are already by index (worker, then column) and keep that order. On
    measured data prefixes are shared only by timestamps a few hundred ulps apart, so the
    pass moves almost nothing; the budget bounds adversarial inputs.
    """
    n, R = M.shape
    N = n * R
    flat = M.reshape(N)
    mask = (np.uint64(1) << np.uint64(ibits)) - np.uint64(1)
    # Worker of index idx = idx // R, by a multiplication: (idx + 0.5) / R is at least 0.5 / R
    # from an integer and the product's relative error is below 2^-51, so the floor is exact
    # for any n·R below 2^48. With an integer division this loop took about 1.4x as long.
    inv = 1.0 / R
    # Out-of-order neighbours exist only with truncated keys, and rarely then: the gather only
    # notes them, without a branch; the insertion sort below runs when there are some.
    unsorted = False
    last = -np.inf
    for j in range(N):
        idx = keys[j] & mask
        x = flat[idx]
        unsorted |= x < last
        last = x
        ts[j] = x
        ws[j] = np.int32((idx + 0.5) * inv)
    if not unsorted:
        return True
    budget = 4 * N
    for j in range(1, N):
        x = ts[j]
        if x < ts[j - 1]:
            w = ws[j]
            k = j
            while k > 0 and x < ts[k - 1]:
                ts[k] = ts[k - 1]
                ws[k] = ws[k - 1]
                k -= 1
            ts[k] = x
            ws[k] = w
            budget -= j - k
            if budget < 0:
                return False
    return True


def _buffers(N):
    """This thread's sort keys and Ω arrays, at least N long, reused from call to call: fresh
    arrays of this size (3 MB at n = 1000, R = 150) are returned to the OS on free and cost a
    page fault per 4 KiB on first touch, about 1 ms per search on the measured VM. They are
    kept until the thread ends: 20 bytes per element of the largest Ω built in it."""
    buf = getattr(_workspace, "buf", None)
    if buf is None or buf[0].shape[0] < N:
        buf = (np.empty(N, np.uint64), np.empty(N, np.float64), np.empty(N, np.int32))
        _workspace.buf = buf
    return buf[0][:N], buf[1][:N], buf[2][:N]


def omega(M, sort_min=None):
    """Ω of §5.2 Step 1 as ``(ts, ws)``: timestamps and worker ids by (timestamp, worker,
    column). Plain Python around the kernels, because the sort is numpy's.

    Small matrices (fewer than ``sort_min`` elements, default :data:`OMEGA_SORT_MIN`) are
    merged (:func:`_merge`). Larger ones are sorted as unique integer keys
    (:func:`_omega_keys`) with ``ndarray.sort``, which uses the CPU's vector sort where numpy
    has one (AVX-512 here), then unpacked (:func:`_omega_unpack`). Both give the same arrays bit
    for bit. The sort path returns views of this thread's workspace, valid until its next call.
    """
    n, R = M.shape
    N = n * R
    if N < (OMEGA_SORT_MIN if sort_min is None else sort_min):
        return _merge(M)
    keys, ts, ws = _buffers(N)
    ibits, _ = _omega_keys(M, keys)
    keys.sort()
    if _omega_unpack(M, keys, ibits, ts, ws):
        return ts, ws
    return _merge(M)


@jit
def _z_at(M, t_sync):
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
def _basic(M, ts, ws, want_candidates):
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
    return _z_at(M, best_t), best_d, best_t, cand[:nc]


@jit
def _opt(M, ts, ws, want_candidates):
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
    return _z_at(M, best_t), best_d, best_t, cand[:nc]


@jit
def _locate(zt, zk, head, tail, t, key):
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


@jit
def _optbs(M, ts, ws, want_candidates):
    """ZipLineOptBS (§5.3.2): ZipLineOpt that locates the old element by binary search.

    The incoming element e_i^p tells, through the auxiliary matrix 𝓜, the timestamp of the
    element it replaces, e_{i-1}^p = M[p, i-1]; Z is sorted, so a binary search on (timestamp,
    worker, index) finds it in O(log n) even among equal timestamps (the "rare case" of §5.3.2).

    Departures from §5.3.2, none of which changes candidates, pruning or result:

    * The located element is marked dead instead of being removed by shifting its successors.
      Shifting costs O(n) per case (ii), which the paper's (1-α)·O(Rn log n) bound leaves out;
      with the §6.1 data α is small (the incoming worker is rarely the oldest in Z), so
      shifting would make the variant O(Rn^2) in practice. Dead entries keep their keys, so the
      array stays sorted for the binary search, and the front pointer skips them (amortised
      O(1)).
    * The search starts from a finger. Entries never move except at compaction (below), so
      the slot where e_{i-1}^p was written is still its slot unless a compaction has run
      since; that slot is checked first (one compare) and the binary search runs only when
      the check fails. In §5.3.2 the search is needed on every case (ii) because ZipLineOpt's
      removals shift the array. At n = 1000, R = 150 (§6.1 data) 8,700 of the 150,000
      elements still need the binary search, and the scan (Ω given) takes about 1.7 ms
      instead of 5.8 ms; the 137,000 searches of ~11 dependent loads each were two thirds of
      it.
    * Z lives in a buffer of 16n + 1 slots. When the buffer is full, the live entries (at most
      n - 1 at that point) are moved, in order, to its start: O(n) every 15n or more elements,
      amortised O(1) each. This bounds the searched slice by 16n + 1 and Z's memory by O(n)
      instead of O(Rn). Without it the slice grows with every dead entry between the front
      and the end; once the fastest workers have used up their R predictions their last
      elements stay the oldest in Z, the front stops moving, and the slice reached 29,000
      entries at n = 1000, R = 150 (§6.1 data). Each compaction makes the fingers of the
      entries it moves stale, so the buffer size sets how often the binary search runs:
      46,000 searches at 4n + 1, 8,700 at 16n + 1, 3,900 at 32n + 1 (scan 3.0, 1.7 and
      1.6 ms, measured with signed indices; the unsigned ones below took 1.7 to 1.4 ms);
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
                j = np.uint32(_locate(zt, zk, head, tail, prev_t[w], old))
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
    return _z_at(M, best_t), best_d, best_t, cand[:nc]


@jit
def _window(M, ts, ws, want_candidates):
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
    # Unsigned indices: no negative-index wraparound code on the accesses (see _optbs).
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
    return _z_at(M, best_t), best_d, best_t, cand[:nc]


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
def _gridscan(M, want_candidates):
    """GridScan, Alg. 1 (§5.1), a heuristic: O(R^2 n).

    The designated row is the one with the earliest first timestamp (line 4; ties: lowest id).
    For each of its R elements e, every other row contributes the element "close to" e (line 10)
    read as its earliest element not before e, so e is min(Z) and d_Z = max(Z) - e. Only R
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
def _fullgridscan(M, want_candidates):
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
    return _z_at(M, best_t), best_d, best_t, cand
