"""Lookahead: the R future push timestamps of every worker (ZipLine paper §4, DSSP Alg. 2).

A worker p whose latest push arrived at t and whose latest iteration interval was γ is
predicted to push again at t + γ, t + 2γ, ..., t + Rγ (ZipLine paper §4, "if a worker p
arrives at time t and presents an iteration interval γ, then the future R iterations can be
estimated to occur at ..."). The interval comes from the worker's two latest push timestamps,
the table 𝒜 of DSSP Alg. 2 (lines 4-5).
"""

from __future__ import annotations

import numpy as np

from mpsync.sched._numba import jit

__all__ = ["predict", "predict_reference", "push_intervals", "push_intervals_reference"]


@jit
def _predict(last_push, interval, R):
    n = last_push.shape[0]
    M = np.empty((n, R), dtype=np.float64)
    for p in range(n):
        t = last_push[p]
        g = interval[p]
        for i in range(R):
            M[p, i] = t + (i + 1) * g
    return M


def _as_vector(x, name: str) -> np.ndarray:
    a = np.ascontiguousarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or inf")
    return a


def predict(last_push, interval, R: int) -> np.ndarray:
    """Predicted push timestamps ``M[p, i] = last_push[p] + (i + 1) * interval[p]``.

    Parameters
    ----------
    last_push : float64[n]
        Timestamp of each worker's latest push (server clock).
    interval : float64[n]
        Each worker's latest iteration interval, ``>= 0`` (see :func:`push_intervals`).
    R : int
        Lookahead, the number of future iterations per worker, ``>= 1``.

    Returns
    -------
    float64[n, R]
        Row p is worker p's predicted pushes, non-decreasing: the matrix 𝓜 of ZipLine §5.1,
        ready for :func:`mpsync.sched.zipline`.
    """
    t = _as_vector(last_push, "last_push")
    g = _as_vector(interval, "interval")
    if t.shape != g.shape:
        raise ValueError(f"last_push and interval differ in length: {t.shape[0]} != {g.shape[0]}")
    if isinstance(R, bool) or not isinstance(R, (int, np.integer)):
        raise ValueError(f"R must be an integer, got {R!r}")
    if R < 1:
        raise ValueError(f"R must be >= 1, got {R}")
    if (g < 0).any():
        raise ValueError("interval must be >= 0 (push timestamps out of order?)")
    return _predict(t, g, int(R))


def predict_reference(last_push, interval, R: int) -> np.ndarray:
    """Plain-Python reference of :func:`predict` (no validation)."""
    rows = [[float(t) + (i + 1) * float(g) for i in range(R)] for t, g in zip(last_push, interval)]
    return np.array(rows, dtype=np.float64).reshape(len(rows), R)


def push_intervals(push_table) -> np.ndarray:
    """Latest iteration interval of each worker from its two latest push timestamps.

    ``push_table`` is float64[n, 2] with column 0 the older and column 1 the latest push (the
    mpsync layout; DSSP Alg. 2 stores them the other way round, 𝒜[i][0] = latest). Returns
    ``push_table[:, 1] - push_table[:, 0]`` (DSSP Alg. 2 lines 4-5).
    """
    a = np.asarray(push_table, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] != 2:
        raise ValueError(f"push_table must have shape (n, 2), got {a.shape}")
    return a[:, 1] - a[:, 0]


def push_intervals_reference(push_table) -> np.ndarray:
    """Reference of :func:`push_intervals`, written on DSSP Alg. 2's own table 𝒜 (𝒜[i][0] the
    latest, 𝒜[i][1] the second latest push): I_i = 𝒜[i][0] - 𝒜[i][1] (lines 4-5)."""
    A = [[float(row[1]), float(row[0])] for row in push_table]
    return np.array([a[0] - a[1] for a in A], dtype=np.float64)
