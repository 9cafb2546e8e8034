"""Numba kernels behind :func:`mpsync.sched.zipline` (ZipLine paper §5; references in
:mod:`mpsync.sched.zipline_reference`): the input check and Ω; the variants' scans over Ω and
the grid are in :mod:`mpsync.sched.zipline_scans`.

Conventions shared by every kernel:

* ``M`` is float64[n, R], C-contiguous, finite, every row non-decreasing (checked by
  :func:`_check` before any kernel runs).
* Ω, the merged timeline of §5.2 Step 1, is ordered by (timestamp, worker id, iteration index):
  §5.2 sorts equal timestamps by worker id, and within a row equal timestamps keep their index
  order. :func:`omega` builds it, by merging the rows (:func:`merge_pushes`, small matrices) or,
  Departure [zipline-omega-sort], from 256 elements up by sorting one integer key per element
  (:func:`omega_keys32` and :func:`omega_keys`, then their unpacks), O(Rn log Rn) where the
  paper merges; every path gives the same arrays bit for bit. The variants that scan Ω take
  it as ``ts, ws``.
* Every kernel returns ``(z, d, t_sync, candidates)``. ``d`` is always computed as
  ``max(Z) - min(Z)`` of actual timestamps, so two variants that find the same pair of end
  points agree bit for bit and the tie rule below is decided on identical floats.
* Tie rule (§4.2, Thm. 1 and Corollary 1): minimum d, then the earliest t_sync. Scanning Ω from
  the left and keeping a candidate only when it is strictly better implements it.
* Departure [zipline-canonical-z]: ``z`` of an exact variant is canonical: for each worker the
  last predicted push not after t_sync, ``z[p] = max{i : M[p, i] <= t_sync}`` (:func:`z_at`).
  Among solutions with the same d and t_sync this is the one in which every worker waits least.
  Alg. 2 taken literally may return an earlier element for a worker whose push at exactly t_sync
  comes later in the equal-timestamp order; finishing that tie group is what makes z independent
  of the scan.
"""

from __future__ import annotations

import threading

import numpy as np

from mpsync.sched._numba import jit

__all__ = ["OK", "NOT_FINITE", "NOT_SORTED", "OMEGA_SORT_MIN", "OMEGA_KEYS32_QUANTA",
           "check_prediction", "merge_pushes", "omega_keys", "omega_unpack", "omega_keys32",
           "omega_unpack32", "sorted_keys", "omega", "workspace"]

# Status codes of _check; zipline() turns them into ValueError messages.
OK = 0
NOT_FINITE = 1
NOT_SORTED = 2


@jit
def check_prediction(M):
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


# One kernel of this length on purpose: the passes share the run cursors and the two
# buffers they merge between; the docstring explains each part.
@jit
def merge_pushes(M):
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


# Below this many elements Ω is built by merge_pushes: for small matrices the fixed costs of the sort
# path (three calls, numpy's sort dispatch, the workspace lookup) exceed the whole merge.
# Measured on §6.1 data: 60 elements 1.9 µs merged, 2.9 µs sorted; 300 elements 4.5 vs 4.1 µs.
OMEGA_SORT_MIN = 256

# Ω is sorted as 32-bit keys (:func:`omega_keys32`), which numpy's vector sort handles in
# about half the time of 64-bit keys, when their time quanta outnumber the elements by this
# factor or more: then few quanta hold two elements, whose order the unpack has to restore.
# Measured on §6.1 data: n = 1000, R = 150 (28 quanta per element) sorted 32-bit keys in 260 µs
# instead of 525 and unpacked them in 180 µs instead of 115; n = 4096, R = 150 (1.7 quanta per
# element) saved 1.1 ms in the sort and spent it restoring 165,000 ties of a quantum.
OMEGA_KEYS32_QUANTA = 16

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
def omega_keys(M, keys):
    """Fill ``keys`` with one unique uint64 sort key per element of M (§5.2 Step 1); return
    ``(ibits, exact)``.

    Each timestamp becomes an unsigned integer that orders like the float (:func:`_float_key`).
    The minimum key is subtracted and the element's worker-major index p·R + i fills the low
    ``ibits`` bits, so equal timestamps sort by worker, then column: Ω's order. When the
    timestamp span and the index together need more than 64 bits, the lowest bits of the
    timestamp are dropped and ``exact`` is False; timestamps that then share a key prefix sort
    by index and :func:`omega_unpack` puts them back in time order. (§6.1 data at n = 1000,
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
def omega_unpack(M, keys, ibits, ts, ws):
    """Ω from the sorted keys of :func:`omega_keys`: ``ts[k]``, ``ws[k]`` are the timestamp
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
    return True if not unsorted else _restore_time_order(ts, ws)


@jit
def _restore_time_order(ts, ws):
    """Stable insertion sort of (ts, ws) on ts; False once it has moved more than 4·len(ts)
    elements (the arrays are then unspecified)."""
    N = ts.shape[0]
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


@jit
def omega_keys32(M, keys):
    """Fill ``keys`` (uint32) with a sort key per element of M, ordered like its timestamp up
    to ties; return ``wbits``.

    The worker id fills the low ``wbits`` bits; the timestamp's place in [min(M), max(M)],
    quantised to the ``32 - wbits`` bits above, the rest. The quantisation is non-decreasing in
    t (rounding is), so sorted keys are in time order except within a quantum, where they come
    by worker id: :func:`omega_unpack32` restores time order there. Keys of one worker are in
    its row's order, so its k-th key is column k. Needs ``wbits`` < 32.
    """
    n, R = M.shape
    wbits = 0
    while ((n - 1) >> wbits) != 0:
        wbits += 1
    top = float((1 << (32 - wbits)) - 1)
    tmin = M[0, 0]
    tmax = M[0, R - 1]
    for p in range(1, n):
        tmin = min(tmin, M[p, 0])
        tmax = max(tmax, M[p, R - 1])
    scale = top / (tmax - tmin) if tmax > tmin else 0.0
    if not scale < np.inf:
        # The range's width or its reciprocal overflows: one quantum, every key equal but for
        # the worker id (t * 0.0 is 0 for every finite t, where t - tmin might be inf).
        tmin = 0.0
        scale = 0.0
    for p in range(n):
        for i in range(R):
            q = np.uint32(min((M[p, i] - tmin) * scale, top))
            keys[p * R + i] = (q << np.uint32(wbits)) | np.uint32(p)
    return wbits


@jit
def omega_unpack32(M, keys, wbits, ts, ws):
    """Ω from the sorted keys of :func:`omega_keys32`, like :func:`omega_unpack` (same return
    value and budget). A worker's k-th key is its column k; within a quantum the keys come by
    worker id, and the stable insertion sort on the timestamp then gives Ω's order, since equal
    timestamps share a quantum. With §6.1 data at n = 1000 (22 bits of quantum, 0.05 ms wide)
    few quanta hold more than one element; at n = 4096 (20 bits) more, but in short groups."""
    n, R = M.shape
    N = n * R
    mask = np.uint32((1 << wbits) - 1)
    column = np.zeros(n, dtype=np.uint32)
    unsorted = False
    last = -np.inf
    for j in range(N):
        w = keys[j] & mask
        i = column[w]
        column[w] = i + np.uint32(1)
        x = M[w, i]
        unsorted |= x < last
        last = x
        ts[j] = x
        ws[j] = np.int32(w)
    return True if not unsorted else _restore_time_order(ts, ws)


def workspace(N):
    """This thread's sort keys and Ω arrays, at least N long, reused from call to call: fresh
    arrays of this size (3 MB at n = 1000, R = 150) are returned to the OS on free and cost a
    page fault per 4 KiB on first touch, about 1 ms per search on the measured VM. They are
    kept until the thread ends: 20 bytes per element of the largest Ω built in it."""
    buf = getattr(_workspace, "buf", None)
    if buf is None or buf[0].shape[0] < N:
        buf = (np.empty(N, np.uint64), np.empty(N, np.float64), np.empty(N, np.int32))
        _workspace.buf = buf
    return buf[0][:N], buf[1][:N], buf[2][:N]


def sorted_keys(M, quanta=None):
    """``(keys, kbits, wide)``: M's sort keys, sorted by numpy's ``ndarray.sort`` (the CPU's
    vector sort where numpy has one, AVX-512 here), and the number of low bits that name the
    element. 32-bit keys of :func:`omega_keys32` (``wide`` False, the low bits the worker)
    where their time quanta are at least ``quanta`` times (default
    :data:`OMEGA_KEYS32_QUANTA`) as many as the elements, else the unique 64-bit keys of
    :func:`omega_keys` (``wide`` True, the low bits the index p·R + i). ``keys`` is a view of
    this thread's workspace, valid until its next call."""
    n, R = M.shape
    N = n * R
    per_element = OMEGA_KEYS32_QUANTA if quanta is None else quanta
    if N * per_element <= 1 << (32 - (n - 1).bit_length()):
        keys = workspace(N)[0].view(np.uint32)[:N]
        kbits = omega_keys32(M, keys)
        keys.sort()
        return keys, kbits, False
    return _sorted_keys64(M)


def _sorted_keys64(M):
    keys = workspace(M.size)[0]
    ibits, _ = omega_keys(M, keys)
    keys.sort()
    return keys, ibits, True


def omega(M, sort_min=None, quanta=None, keys=None):
    """Ω of §5.2 Step 1 as ``(ts, ws)``: timestamps and worker ids by (timestamp, worker,
    column). Plain Python around the kernels, because the sort is numpy's.

    Small matrices (fewer than ``sort_min`` elements, default :data:`OMEGA_SORT_MIN`) are
    merged (:func:`merge_pushes`). Larger ones are sorted as integer keys
    (:func:`sorted_keys`) and unpacked (:func:`omega_unpack32`, :func:`omega_unpack`); if the
    unpack of 32-bit keys gives up, 64-bit keys are tried, and if theirs does, the merge.
    Every path gives the same arrays bit for bit. The sort paths return views of this
    thread's workspace, valid until its next call. ``keys``: what :func:`sorted_keys` returned
    for M, if the caller has it already.
    """
    n, R = M.shape
    N = n * R
    if keys is None and N < (OMEGA_SORT_MIN if sort_min is None else sort_min):
        return merge_pushes(M)
    keys, kbits, wide = sorted_keys(M, quanta) if keys is None else keys
    _, ts, ws = workspace(N)
    if not wide:
        if omega_unpack32(M, keys, kbits, ts, ws):
            return ts, ws
        keys, kbits, wide = _sorted_keys64(M)
    if omega_unpack(M, keys, kbits, ts, ws):
        return ts, ws
    return merge_pushes(M)
