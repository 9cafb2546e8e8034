"""SSP staleness bound and DSSP server decisions (DSSP paper §I.A, Alg. 1, Alg. 2).

Iteration counts ``iters[i]`` are Alg. 1's t_i, the number of push requests the server has
received from worker i (Alg. 1 line 1 increments t_p before any decision). Timestamps are the
server's own receive clock.

Layout of the push table: float64[n, 2], **column 0 the older, column 1 the latest** push of
each worker. DSSP Alg. 2 stores them the other way round (𝒜[i][0] latest, 𝒜[i][1] second
latest); mpsync's order matches time order and :func:`mpsync.sched.predict`.
"""

from __future__ import annotations

import numpy as np

from mpsync.sched._numba import jit

__all__ = [
    "ssp_may_continue",
    "within_staleness",
    "dssp_allowance",
    "dssp_slowest",
    "dssp_fastest",
    "dssp_is_fastest",
    "dssp_controller",
    "dssp_controller_reference",
    "dssp_on_push",
    "dssp_on_push_given",
    "ssp_may_continue_reference",
    "dssp_slowest_reference",
    "dssp_fastest_reference",
    "dssp_is_fastest_reference",
    "dssp_on_push_reference",
]


@jit
def _check_worker(n, p):
    if n < 1:
        raise ValueError("no workers: the table is empty")
    if p < 0 or p >= n:
        raise ValueError("worker p is out of range")


@jit
def ssp_may_continue(iters, p, s):
    """SSP: may worker p start its next iteration? ``iters[p] - min(iters) <= s``.

    DSSP §I.A: SSP restricts the iteration difference between the fastest and the slowest
    worker "to not exceed more than" s, so "the difference in the number of iterations among
    workers is no larger than s"; Alg. 1 line 8 sends OK iff t_p - t_slowest <= s_L. A
    difference of exactly s is allowed; s = 0 is BSP. (The ZipLine paper §2.2 states the same:
    the fastest waits once it is s + 1 iterations ahead.) Call it after counting p's push.
    """
    n = iters.shape[0]
    _check_worker(n, p)
    if s < 0:
        raise ValueError("staleness threshold s must be >= 0")
    lo = iters[0]
    for i in range(1, n):
        if iters[i] < lo:
            lo = iters[i]
    return within_staleness(iters[p], lo, s)


@jit
def within_staleness(pushes, slowest_pushes, s):
    """The bound itself, given the slowest worker's push count: ``pushes - slowest_pushes
    <= s``.  :func:`ssp_may_continue` finds the slowest by a scan; the simulator's PS engine
    keeps it incrementally and asks this same comparison."""
    return pushes - slowest_pushes <= s


@jit
def dssp_allowance(gap, s_lower, s_upper):
    """r_max for the controller (Alg. 1 line 12) when the fastest worker is ``gap`` pushes
    ahead of the slowest: the allowance that is left, ``s_U - gap + 1`` (the OK sent now
    counts as the first extra iteration), at most ``s_U - s_L`` and never negative, so repeated
    grants never carry it past s_U (``server.policies.DSSP.on_push``'s departure
    [dssp-allowance-left])."""
    return max(0, min(s_upper - s_lower, s_upper - gap + 1))


@jit
def dssp_slowest(iters):
    """Alg. 1 line 7: the worker with the fewest pushes (lowest id among ties)."""
    n = iters.shape[0]
    _check_worker(n, 0)
    q = 0
    for i in range(1, n):
        if iters[i] < iters[q]:
            q = i
    return q


@jit
def dssp_fastest(iters):
    """Alg. 1 line 7: the worker with the most pushes (lowest id among ties)."""
    n = iters.shape[0]
    _check_worker(n, 0)
    q = 0
    for i in range(1, n):
        if iters[i] > iters[q]:
            q = i
    return q


@jit
def dssp_is_fastest(iters, p):
    """Alg. 1 line 11: is p *a* fastest worker (ties count: any worker with the maximum)?"""
    n = iters.shape[0]
    _check_worker(n, p)
    for i in range(n):
        if iters[i] > iters[p]:
            return False
    return True


@jit
def dssp_controller(push_table, p, r_max, slowest=-1):
    """DSSP Alg. 2 ``synchronization_controller``: r*, the extra iterations p may run (0..r_max).

    Lines 1-2 (recording p's new push) are the caller's: ``push_table`` already holds it, in
    mpsync's layout (column 0 older, column 1 latest). Then, as in Alg. 2:

    * line 3: the slowest worker, from the table: the worker other than p with the longest
      latest iteration interval (lowest id among ties). Alg. 1 line 7 determines a slowest
      worker by push counts instead; pass it as ``slowest`` to use that one.
    * lines 4-5: I_p and I_slowest, each worker's latest interval.
    * line 6: Sim_p[r] = latest_p + r·I_p, r = 0..r_max (r = 0 is the push just received).
    * line 7: Sim_slowest[k] = latest_slowest + (k + 1)·I_slowest, k = 0..r_max (the slowest
      worker's next pushes, starting with the iteration it is running now).
    * line 8: r* = argmin over r of min over k of |Sim_slowest[k] - Sim_p[r]|; among equal
      distances the smallest r (the earliest stop, fewest stale iterations).

    With one worker, or when the slowest worker is p itself, there is nobody to wait for and
    r* = 0. O(r_max^2), as written in line 8; r_max = s_U - s_L is small.
    """
    n = push_table.shape[0]
    _check_worker(n, p)
    if push_table.shape[1] != 2:
        raise ValueError("push_table must have shape (n, 2)")
    if r_max < 0:
        raise ValueError("r_max must be >= 0")
    s = slowest
    if s < 0:
        best = -np.inf
        for q in range(n):
            if q == p:
                continue
            iq = push_table[q, 1] - push_table[q, 0]
            if iq > best:
                best = iq
                s = q
    elif s >= n:
        raise ValueError("slowest is out of range")
    if s < 0 or s == p:
        return 0
    ip = push_table[p, 1] - push_table[p, 0]
    isl = push_table[s, 1] - push_table[s, 0]
    tp = push_table[p, 1]
    ts = push_table[s, 1] + isl
    r_star = 0
    best_gap = np.inf
    for r in range(r_max + 1):
        sim_p = tp + r * ip
        for k in range(r_max + 1):
            gap = abs(ts + k * isl - sim_p)
            if gap < best_gap:
                best_gap = gap
                r_star = r
    return r_star


def dssp_controller_reference(push_table, p: int, r_max: int, slowest: int = -1) -> int:
    """Plain-Python reference of :func:`dssp_controller`, in the paper's own layout."""
    # Table 𝒜 as in Alg. 2: A[i][0] latest, A[i][1] second latest.
    A = [[float(row[1]), float(row[0])] for row in push_table]
    n = len(A)
    if slowest < 0:
        others = [q for q in range(n) if q != p]
        if not others:
            return 0
        slowest = max(others, key=lambda q: (A[q][0] - A[q][1], -q))
    if slowest == p:
        return 0
    I_p = A[p][0] - A[p][1]
    I_s = A[slowest][0] - A[slowest][1]
    sim_p = [A[p][0] + i * I_p for i in range(r_max + 1)]
    sim_s = [A[slowest][0] + I_s + i * I_s for i in range(r_max + 1)]
    gaps = [min(abs(a - b) for a in sim_s) for b in sim_p]
    return min(range(r_max + 1), key=lambda r: (gaps[r], r))


@jit
def dssp_on_push(iters, r_extra, push_table, p, s_lower, r_max):
    """DSSP Alg. 1, server part, lines 3-18, for the push just received from worker p.

    The caller has already done line 1 (``iters[p] += 1``), line 2 (applied the gradients) and
    recorded the push in ``push_table``; ``r_extra`` is r_p, the extra iterations p still has.
    Returns ``(send_ok, new_r_p)``. ``send_ok`` False is line 17: hold p's OK until
    ``ssp_may_continue(iters, p, s_lower)`` holds again after later pushes of others.

    Departure [dssp-slowest-by-pushes]: the controller is given Alg. 1's slowest worker (fewest
    pushes, line 7), the one line 17 waits for, where Alg. 2 line 3 finds "the slowest worker
    from table 𝒜" (the timestamps); the two can differ, and the wait the controller shortens
    is the one for Alg. 1's slowest.

    Departure [dssp-first-extra-ok]: when the controller grants r* > 0 (lines 12-14) the OK
    sent at once is the first of the r* extra iterations, so r_p becomes r* - 1. Taken literally
    (r_p = r*, then line 3-5 sends OK while r_p > 0), p would run r* + 1 iterations beyond s_L,
    one past Alg. 2's simulated stop point Sim_p[r*] and Fig. 2's "run 3 more iterations".
    """
    n = iters.shape[0]
    _check_worker(n, p)
    if r_extra > 0:  # lines 3-5, before any scan
        return True, r_extra - 1
    if s_lower < 0:
        raise ValueError("staleness threshold s must be >= 0")
    slowest = dssp_slowest(iters)  # line 7
    return dssp_on_push_given(iters[p], iters[slowest], iters[dssp_fastest(iters)], 0,
                              push_table, p, slowest, s_lower, r_max)


@jit
def dssp_on_push_given(pushes_p, slowest_pushes, most_pushes, r_extra, push_table, p, slowest,
                       s_lower, r_max):
    """Lines 3-18 of :func:`dssp_on_push` once line 7 has found the slowest worker
    (``slowest``, the lowest id among the fewest pushes, ``slowest_pushes`` of them) and the
    most pushes any worker has (``most_pushes``): the decision itself, in O(r_max^2) (the
    controller's own cost) instead of O(n).  ``pushes_p`` is t_p after line 1.  The simulator,
    which keeps the minimum, the maximum and the slowest incrementally instead of scanning,
    asks this same function; :func:`dssp_on_push` asks it after its scans."""
    if r_extra > 0:  # lines 3-5
        return True, r_extra - 1
    if within_staleness(pushes_p, slowest_pushes, s_lower):  # lines 7-9
        return True, 0
    if pushes_p >= most_pushes:  # lines 11-15: p is a fastest worker
        r = dssp_controller(push_table, p, r_max, slowest)
        if r > 0:
            return True, r - 1
    return False, 0  # line 17


# --- Plain-Python references (tests, NUMBA_DISABLE_JIT=1 debugging) ---------------------------


def ssp_may_continue_reference(iters, p: int, s: int) -> bool:
    """Reference of :func:`ssp_may_continue`: DSSP Alg. 1 line 8 with s_L = s, t_p - t_slowest <= s."""
    t = [int(x) for x in iters]
    return t[p] - min(t) <= s


def dssp_slowest_reference(iters) -> int:
    """Reference of :func:`dssp_slowest` (Alg. 1 line 7): fewest pushes, lowest id among ties."""
    t = [int(x) for x in iters]
    return t.index(min(t))


def dssp_fastest_reference(iters) -> int:
    """Reference of :func:`dssp_fastest` (Alg. 1 line 7): most pushes, lowest id among ties."""
    t = [int(x) for x in iters]
    return t.index(max(t))


def dssp_is_fastest_reference(iters, p: int) -> bool:
    """Reference of :func:`dssp_is_fastest` (Alg. 1 line 11): t_p is the maximum of t."""
    t = [int(x) for x in iters]
    return t[p] == max(t)


def dssp_on_push_reference(iters, r_extra: int, push_table, p: int, s_lower: int, r_max: int):
    """Reference of :func:`dssp_on_push`: DSSP Alg. 1, server part, lines 3-18, returning
    ``(send_ok, new_r_p)``, with the same departure (an OK granted by the controller is the
    first of its r* extra iterations, so r_p = r* - 1)."""
    if r_extra > 0:  # lines 3-5
        return True, r_extra - 1
    if ssp_may_continue_reference(iters, p, s_lower):  # line 8
        return True, 0
    if dssp_is_fastest_reference(iters, p):  # line 11
        slowest = dssp_slowest_reference(iters)
        r = dssp_controller_reference(push_table, p, r_max, slowest)  # line 12
        if r > 0:  # lines 13-14
            return True, r - 1
    return False, 0  # line 17
