"""SSP, DSSP, ESync and OSP kernels: references, hand-worked examples from the papers, edges."""

from __future__ import annotations

import numpy as np
import pytest

from mpsync.sched import (
    dssp_controller,
    dssp_controller_reference,
    dssp_fastest,
    dssp_is_fastest,
    dssp_on_push,
    dssp_slowest,
    esync_delta,
    esync_query_state,
    esync_ready,
    esync_ready_delayed_ack,
    esync_ready_reference,
    esync_reset,
    esync_slowest,
    osp_bitmap,
    osp_bitmap_reference,
    osp_ics_budget,
    osp_ics_size,
    osp_layer_importance,
    osp_rank,
    ssp_may_continue,
)

# --- SSP --------------------------------------------------------------------------------------


def test_ssp_bound_is_inclusive():
    iters = np.array([13, 10, 12], dtype=np.int64)
    assert ssp_may_continue(iters, 0, 3)  # 3 ahead of the slowest, s = 3: allowed
    assert not ssp_may_continue(iters, 0, 2)
    assert ssp_may_continue(iters, 1, 0)  # the slowest itself always may go on
    assert not ssp_may_continue(iters, 2, 1)


def test_ssp_zero_is_bsp():
    assert ssp_may_continue(np.array([4, 4]), 0, 0)
    assert not ssp_may_continue(np.array([5, 4]), 0, 0)


@pytest.mark.parametrize("p,s", [(-1, 1), (3, 1), (0, -1)])
def test_ssp_bad_input(p, s):
    with pytest.raises(ValueError):
        ssp_may_continue(np.array([1, 2, 3]), p, s)


# --- DSSP -------------------------------------------------------------------------------------


def test_dssp_helpers():
    iters = np.array([7, 3, 9, 3, 9], dtype=np.int64)
    assert dssp_slowest(iters) == 1 and dssp_fastest(iters) == 2
    assert dssp_is_fastest(iters, 4) and not dssp_is_fastest(iters, 0)


def fig2_table():
    """A Fig. 2-like case: worker 0 fast (interval 1, latest push at 10), worker 1 slowest
    (interval 4, latest push at 9, so its next pushes are 13, 17, ...), worker 2 in between."""
    return np.array([[9.0, 10.0], [5.0, 9.0], [8.0, 9.5]])


def test_dssp_controller_fig2_example():
    # Sim_p = 10, 11, 12, 13, 14; Sim_slowest = 13, 17, 21, 25, 29. |13 - 13| = 0 at r = 3:
    # like Fig. 2, worker 0 runs 3 more iterations and stops when the slowest pushes.
    assert dssp_controller(fig2_table(), 0, 4) == 3
    # With r_max = 2 the stop at 13 is out of reach; the closest is r = 2 (12 vs 13).
    assert dssp_controller(fig2_table(), 0, 2) == 2


def test_dssp_controller_returns_zero_when_waiting_now_is_best():
    # Slowest pushes at 10.125, 11.25, ...; Sim_p = 10, 11, ...: r = 0 is closest (0.125).
    table = np.array([[9.0, 10.0], [7.875, 9.0]])
    assert dssp_controller(table, 0, 4) == 0


def test_dssp_controller_single_worker_and_explicit_slowest():
    assert dssp_controller(np.array([[0.0, 1.0]]), 0, 5) == 0
    # Worker 2 (interval 1.5, next pushes 11, 12.5, 14) chosen explicitly: Sim_p hits 11 at r=1.
    assert dssp_controller(fig2_table(), 0, 4, 2) == 1


@pytest.mark.parametrize("seed", range(30))
def test_dssp_controller_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    older = rng.integers(0, 20, n).astype(np.float64)
    table = np.stack([older, older + rng.integers(0, 6, n)], axis=1)
    p, r_max = int(rng.integers(0, n)), int(rng.integers(0, 7))
    assert dssp_controller(table, p, r_max) == dssp_controller_reference(table, p, r_max)
    s = int(rng.integers(0, n))
    assert dssp_controller(table, p, r_max, s) == dssp_controller_reference(table, p, r_max, s)


@pytest.mark.parametrize("p,r_max,shape", [(2, 3, (2, 2)), (0, -1, (2, 2)), (0, 3, (2, 3))])
def test_dssp_controller_bad_input(p, r_max, shape):
    with pytest.raises(ValueError):
        dssp_controller(np.zeros(shape), p, r_max)


def test_dssp_on_push_follows_alg1():
    table = fig2_table()
    iters = np.array([8, 4, 6], dtype=np.int64)  # worker 0 is 4 ahead of the slowest
    assert dssp_on_push(iters, 2, table, 0, 3, 4) == (True, 1)  # lines 3-5: r_p > 0
    assert dssp_on_push(iters, 0, table, 2, 3, 4) == (True, 0)  # lines 7-9: within s_L
    # Lines 11-14: fastest and over s_L: the controller grants r* = 3; OK now is the first.
    ok, r = dssp_on_push(iters, 0, table, 0, 3, 4)
    assert (ok, r) == (True, 2)
    # r* = 3 extra iterations in total: this OK plus the next r = 2 pushes.
    extra = 1
    while r > 0:
        ok, r = dssp_on_push(iters, r, table, 0, 3, 4)
        extra += ok
    assert extra == 3
    # Not the fastest and over s_L: line 17, wait.
    iters2 = np.array([8, 4, 9], dtype=np.int64)
    assert dssp_on_push(iters2, 0, table, 0, 3, 4) == (False, 0)


# --- ESync ------------------------------------------------------------------------------------


def esync_table(n=3):
    k = np.array([2, 1, 0][:n], dtype=np.int64)
    c = np.array([0.03, 3.5, 0.2][:n])
    te = np.array([12.0, 10.0, 11.9][:n])
    return k, c, te, np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)


def test_esync_hand_worked_example():
    # §4.1: slowest c = 3.5 s, fast device c = 0.03 s, ε = 0.5 s (the reference code's value).
    k, c, te, ready, rnd = esync_table()
    assert esync_slowest(c) == 1
    # now = 12: the slowest finishes at 13.5, rest 1.5 s > 0.03 + 0.5: keep training.
    assert not esync_ready(k, c, te, ready, rnd, 0, 12.0, 0.5)
    # now = 13.2: rest 0.3 s < 0.53: another iteration would hold the slowest up: READY.
    assert esync_ready(k, c, te, ready, rnd, 0, 13.2, 0.5)
    # Device 2 has not finished a local iteration this round (k = 0): NOT-READY regardless.
    assert not esync_ready(k, c, te, ready, rnd, 2, 13.4, 0.5)
    # The slowest device is READY as soon as it has one local iteration.
    assert esync_ready(k, c, te, ready, rnd, 1, 13.5, 0.5)


def test_esync_slowest_ready_or_not_pulled():
    k, c, te, ready, rnd = esync_table()
    ready[1] = True
    assert esync_ready(k, c, te, ready, rnd, 0, 10.0, 0.5)  # slowest is ready: aggregate
    rnd[0] = 1  # device 0 is in round 1, the slowest still in round 0 (not pulled yet)
    assert not esync_ready(k, c, te, ready, rnd, 0, 13.4, 0.5)


def test_esync_query_state_and_reset_update_table():
    k, c, te, ready, rnd = esync_table()
    assert esync_query_state(k, c, te, ready, rnd, 0, 5, 0.04, 13.1, 13.2, 0.5)
    assert (k[0], c[0], te[0], ready[0]) == (5, 0.04, 13.1, True)
    assert not esync_query_state(k, c, te, ready, rnd, 2, 1, 0.2, 11.0, 11.0, 0.5)
    assert not ready[2]
    esync_reset(k, te, ready, rnd, 0, 1, 14.0)
    assert (k[0], te[0], ready[0], rnd[0]) == (0, 14.0, False, 1)


@pytest.mark.parametrize("seed", range(30))
def test_esync_ready_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    k = rng.integers(0, 3, n).astype(np.int64)
    c = rng.choice([0.1, 0.5, 1.0, 2.0], n)
    te = rng.uniform(0, 5, n)
    ready = rng.random(n) < 0.3
    rnd = rng.integers(0, 2, n).astype(np.int64)
    p, now, eps = int(rng.integers(0, n)), float(rng.uniform(0, 8)), 0.5
    records = [(i, k[i], c[i], te[i], ready[i], rnd[i]) for i in range(n)]
    assert esync_ready(k, c, te, ready, rnd, p, now, eps) == esync_ready_reference(records, p, now, eps)


def test_esync_delayed_ack():
    # §4.2: capability includes the query RTT, so a device behind a slow link counts as slow.
    k, c, te, ready, rnd = esync_table(2)
    compute = np.array([0.03, 3.5])
    rtt = np.array([4.0, 0.01])  # device 0 is now the slowest (4.03 s per iteration)
    assert esync_ready_delayed_ack(k, compute, rtt, te, ready, rnd, 0, 12.0, 0.5)
    assert esync_delta(0.1, 0.25) == 3  # two iterations fit in one RTT: delta - 1 = 2
    assert esync_delta(0.1, 0.0) == 1
    with pytest.raises(ValueError):
        esync_delta(0.0, 1.0)


def test_esync_bad_input():
    k, c, te, ready, rnd = esync_table()
    with pytest.raises(ValueError, match="out of range"):
        esync_ready(k, c, te, ready, rnd, 3, 0.0, 0.5)
    with pytest.raises(ValueError, match="differ in length"):
        esync_ready(k[:2], c, te, ready, rnd, 0, 0.0, 0.5)


# --- OSP --------------------------------------------------------------------------------------


def test_osp_importance_and_rank():
    g = np.array([1.0, -2.0, 3.0, 0.5])
    w = np.array([1.0, 1.0, -1.0, 4.0])
    sizes = np.array([2, 1, 1], dtype=np.int64)
    imp = osp_layer_importance(g, w, sizes)
    np.testing.assert_array_equal(imp, [3.0, 3.0, 2.0])  # Eq. 4: sum |g * p| per layer
    np.testing.assert_array_equal(osp_rank(imp), [0, 1, 2])  # ties: lower index first
    with pytest.raises(ValueError):
        osp_layer_importance(g, w, np.array([2, 1], dtype=np.int64))


def test_osp_ics_budget():
    # 10 Gbit/s = 1.25e9 B/s, no loss, T_c = 0.1 s, 8 workers: 15.6 MB, under 80 % of 100 MB.
    assert osp_ics_budget(1.25e9, 0.0, 0.1, 8, 1e8) == pytest.approx(1.5625e7)
    assert osp_ics_budget(1.25e9, 0.0, 10.0, 8, 1e8) == pytest.approx(8e7)  # the 0.8 cap
    assert osp_ics_budget(1.0, 0.5, 2.0, 1, 100.0) == pytest.approx(3.0)  # b(1 + lr)Tc/N
    with pytest.raises(ValueError):
        osp_ics_budget(1.0, 0.0, 1.0, 0, 1.0)


def test_osp_ics_size_schedule():
    assert osp_ics_size(1, 2.3, 2.3, 100.0) == 0.0  # Alg. 1 line 9
    assert osp_ics_size(2, 1.15, 2.3, 100.0) == pytest.approx(50.0)  # line 11
    assert osp_ics_size(9, 0.0, 2.3, 100.0) == 100.0  # loss -> 0: the upper bound
    assert osp_ics_size(3, 3.0, 2.3, 100.0) == 0.0  # loss above L: clipped at 0
    with pytest.raises(ValueError):
        osp_ics_size(0, 1.0, 1.0, 1.0)


def test_osp_bitmap():
    imp = np.array([5.0, 1.0, 3.0, 1.0, 9.0])
    sizes = np.array([10, 10, 10, 10, 10], dtype=np.int64)
    # Least important first: layer 3, layer 1 (equal importance: higher index first), 2, ...
    np.testing.assert_array_equal(osp_bitmap(imp, sizes, 25.0), [False, True, False, True, False])
    assert not osp_bitmap(imp, sizes, 0.0).any()  # all Routine Sync: BSP (§4.3)
    assert osp_bitmap(imp, sizes, 50.0).all()  # all ICS: ASP (§4.3)
    # A layer that does not fit ends the list: never skip to a more important one.
    big = np.array([10, 30, 10, 10, 10], dtype=np.int64)
    np.testing.assert_array_equal(osp_bitmap(imp, big, 25.0), [False, False, False, True, False])


@pytest.mark.parametrize("seed", range(20))
def test_osp_bitmap_matches_reference(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 12))
    imp = rng.integers(0, 4, L).astype(np.float64)
    sizes = rng.integers(0, 20, L).astype(np.int64)
    budget = float(rng.integers(0, 100))
    np.testing.assert_array_equal(osp_bitmap(imp, sizes, budget), osp_bitmap_reference(imp, sizes, budget))


def test_osp_bitmap_bad_input():
    with pytest.raises(ValueError):
        osp_bitmap(np.array([1.0, np.nan]), np.array([1, 1], dtype=np.int64), 1.0)
    with pytest.raises(ValueError):
        osp_bitmap(np.array([1.0]), np.array([1], dtype=np.int64), -1.0)
