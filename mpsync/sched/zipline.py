"""ElasticBSP barrier search: the ZipLine family (ZipLine paper §4-§5).

Given the predicted push timestamps 𝓜 (n workers x R future iterations, see
:func:`mpsync.sched.predict`), find Z*, one element per worker, minimising the waiting time
d_Z = max(Z) - min(Z) (Problem 1, §4.1); the barrier is imposed at t_sync = max(Z*). Among
several optima the earliest t_sync wins (§4.2, Thm. 1, Corollary 1).

Variants (``ZIPLINE_VARIANTS``):

``"basic"``         ZipLine, Alg. 2 (§5.2), O(Rn^2).
``"opt"``           ZipLineOpt (§5.3.1), Thm. 3 pruning, α·O(Rn) + (1-α)·O(Rn^2).
``"optbs"``         ZipLineOptBS (§5.3.2), ZipLineOpt locating the old element in O(1).
``"gridscan"``      GridScan, Alg. 1 (§5.1): a heuristic, R candidates, O(R^2 n).
``"fullgridscan"``  FullGridScan (§5.1): Rn candidates, O(R^2 n^2), exact.
``"window"``        k-way merge of the sorted rows + two-pointer window, O(Rn log n); not in the
                    paper, the fastest exact variant (``FASTEST_EXACT_VARIANT``).

All variants but ``"gridscan"`` are exact and return the same result (same z, d and t_sync).
The kernels live in :mod:`mpsync.sched.zipline_omega` (Ω) and
:mod:`mpsync.sched.zipline_scans` (the variants); plain-Python references, including
the brute-force search over all R^n solutions (§5.1 "naive search"), in
:mod:`mpsync.sched.zipline_reference`.

Where the implementation departs from the paper (each stated where it is made, under the key
the fidelity table of docs/fidelity.md uses):

* [zipline-omega-sort] Ω (§5.2 Step 1) is built by merging the n rows, which are sorted by
  construction, for small matrices (O(Rn log n)); from 256 elements up, by numpy's sort of one
  integer key per element (a uint32 of quantised time and worker id where the quanta are
  sparse, else a unique uint64 of timestamp bits and worker-major index), which is faster on
  CPUs where numpy's sort is vectorized although it is O(Rn log Rn). Same order every way
  (``omega``).
* [zipline-optbs-finger] ZipLineOptBS remembers each worker's slot in Z instead of binary
  searching Z for the old element (``scan_optbs``).
* [zipline-canonical-z] ``z`` is canonical (each worker's last push not after t_sync), see
  ``zipline_omega``.
* [zipline-optbs-dead-marks] ZipLineOptBS keeps Z in Ω itself, where a removed element is
  left in place, dead, instead of shifting the array (``scan_optbs``).
* [zipline-gridscan-close-to] GridScan's "close to" (Alg. 1 line 10; the algorithm box is not
  in the text) is read as "earliest element not before the designated one", which makes
  FullGridScan exact as Table 3 reports.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpsync.sched import zipline_omega as _k
from mpsync.sched import zipline_scans as _s
from mpsync.zipline_variants import EXACT_VARIANTS, FASTEST_EXACT_VARIANT, ZIPLINE_VARIANTS

__all__ = [
    "ZIPLINE_VARIANTS",
    "EXACT_VARIANTS",
    "FASTEST_EXACT_VARIANT",
    "ZipLineResult",
    "zipline",
    "check_matrix",
]


# Variants that scan Ω (§5.2 Step 1) take it as arguments; the grid baselines read 𝓜 only.
_OMEGA_KERNELS = {
    "basic": _s.scan_basic,
    "opt": _s.scan_opt,
    "optbs": _s.scan_optbs,
    "window": _s.scan_window,
}
# Variants whose search scan_keys runs from sorted 64-bit keys, without unpacking Ω, when no
# candidate sequence is asked for.
_FROM_KEYS = (_s.scan_optbs, _s.scan_window)
_GRID_KERNELS = {
    "gridscan": _s.scan_grid,
    "fullgridscan": _s.scan_fullgrid,
}


class ZipLineResult(NamedTuple):
    """The barrier chosen by :func:`zipline`.

    z : int64[n]
        For each worker p, the column of 𝓜 (the future iteration, 0-based) of its element of Z*:
        worker p runs ``z[p] + 1`` more iterations before the barrier.
    d : float
        d_{Z*} = max(Z*) - min(Z*), the waiting time of the first worker to arrive.
    t_sync : float
        max(Z*), when to impose the barrier.
    candidates : float64[k] or None
        With ``return_candidates=True``: d_Z of every candidate in evaluation order. For
        ``"basic"``, ``"opt"``, ``"optbs"`` and ``"window"`` this is the sequence of Alg. 2 (the
        data of Figs. 6-7): the first complete Z, then one Z per remaining element of Ω, so
        k = Rn - k0 + 1 where k0 is the number of elements taken to fill the first Z (for
        ``"opt"``/``"optbs"`` the d_Z that Thm. 3 lets them skip are filled in). For
        ``"gridscan"`` the R candidates of the designated row, for ``"fullgridscan"`` the Rn
        candidates with designated element M[q, i] at index q*R + i; ``inf`` marks a designated
        element after which some worker has no push left.
    """

    z: np.ndarray
    d: float
    t_sync: float
    candidates: np.ndarray | None = None


def check_matrix(M) -> np.ndarray:
    """Validate 𝓜 and return it as a C-contiguous float64 array, or raise ValueError."""
    if isinstance(M, np.ndarray) and M.dtype == np.float64 and M.flags.c_contiguous:
        a = M
    else:
        try:
            a = np.ascontiguousarray(M, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"M must be a 2-D array of timestamps: {exc}") from None
    if a.ndim != 2:
        raise ValueError(f"M must be 2-D (n workers x R iterations), got {a.ndim}-D shape {a.shape}")
    n, R = a.shape
    if n < 1:
        raise ValueError("M is empty: no workers (n = 0)")
    if R < 1:
        raise ValueError(f"M has R = {R}: need at least one predicted iteration per worker")
    status, row = _k.check_prediction(a)
    if status == _k.NOT_FINITE:
        raise ValueError(f"M contains NaN or inf (row {row})")
    if status == _k.NOT_SORTED:
        raise ValueError(f"row {row} of M is not non-decreasing: predicted pushes must be in time order")
    return a


def zipline(M, variant: str = FASTEST_EXACT_VARIANT,
            return_candidates: bool = False) -> ZipLineResult:
    """Find the ElasticBSP barrier over predicted pushes ``M`` (ZipLine paper §4.1, Problem 1).

    Parameters
    ----------
    M : float64[n, R]
        Row p holds worker p's R predicted push timestamps, non-decreasing (n = 1, R = 1 valid).
    variant : str
        One of ``ZIPLINE_VARIANTS``; default ``FASTEST_EXACT_VARIANT``, the same default as
        the server's (``SyncConfig.zipline_variant``).  The paper recommends ``"optbs"`` for
        n > 100; every exact variant returns the same result.
    return_candidates : bool
        Also return the d_Z of every candidate evaluated (see :class:`ZipLineResult`).

    Raises
    ------
    ValueError
        Unknown variant; M empty, not 2-D, R < 1, containing NaN/inf, or with a decreasing row.
    """
    kernel = _OMEGA_KERNELS.get(variant)
    grid = _GRID_KERNELS.get(variant)
    if kernel is None and grid is None:
        raise ValueError(f"unknown ZipLine variant {variant!r}; expected one of {ZIPLINE_VARIANTS}")
    a = check_matrix(M)
    if grid is not None:
        z, d, t_sync, cand = grid(a, bool(return_candidates))
    else:
        keys = _k.sorted_keys(a) if a.size >= _k.OMEGA_SORT_MIN else None
        if keys is not None and kernel in _FROM_KEYS and not return_candidates:
            found = _search_from_keys(a, keys)
            if found is not None:
                return found
        ts, ws = _k.omega(a, keys=keys)
        z, d, t_sync, cand = kernel(a, ts, ws, bool(return_candidates))
    return ZipLineResult(z, float(d), float(t_sync), cand if return_candidates else None)


def _search_from_keys(a, keys) -> ZipLineResult | None:
    """The search of ``optbs`` and ``window`` from 𝓜 ``a``'s :func:`sorted_keys
    <mpsync.sched.zipline_omega.sorted_keys>` (:func:`scan_keys
    <mpsync.sched.zipline_scans.scan_keys>`), or None where that cannot be done: 32-bit keys
    (out of time order within a quantum), or 64-bit keys out of Ω's order."""
    sorted_keys, kbits, wide = keys
    if not wide:
        return None
    ok, z, d, t_sync = _s.scan_keys(a, sorted_keys, kbits, _k.workspace(a.size)[2])
    return ZipLineResult(z, float(d), float(t_sync), None) if ok else None
