"""The jitted kernels of predict, SSP/DSSP, ESync and OSP against their plain-Python references
on seeded random inputs.

The inputs are drawn from small integer pools on purpose: equal push counts, equal
capabilities and equal importances are where the tie rules of the papers decide, and where an
off-by-one in a kernel shows. The same tests run un-jitted (NUMBA_DISABLE_JIT=1) from
tests/test_sched_isolation.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpsync.sched import (
    dssp_fastest,
    dssp_is_fastest,
    dssp_on_push,
    dssp_on_push_given,
    dssp_slowest,
    esync_delta,
    esync_query_state,
    esync_ready_delayed_ack,
    esync_reset,
    esync_slowest,
    osp_ics_budget,
    osp_ics_size,
    osp_layer_importance,
    osp_rank,
    predict,
    predict_reference,
    push_intervals,
    ssp_may_continue,
)
from mpsync.sched.dssp import (
    dssp_fastest_reference,
    dssp_is_fastest_reference,
    dssp_on_push_reference,
    dssp_slowest_reference,
    ssp_may_continue_reference,
)
from mpsync.sched.esync import (
    esync_delta_reference,
    esync_query_state_reference,
    esync_ready_delayed_ack_reference,
    esync_reset_reference,
    esync_slowest_reference,
)
from mpsync.sched.osp import (
    osp_ics_budget_reference,
    osp_ics_size_reference,
    osp_layer_importance_reference,
    osp_rank_reference,
)
from mpsync.sched.predict import push_intervals_reference

SEEDS = range(40)


# --- predict and push intervals ----------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_predict_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n, R = int(rng.integers(1, 30)), int(rng.integers(1, 20))
    t = rng.uniform(-1e3, 1e6, n)
    g = rng.choice([0.0, 1.0, 1e-3, 1234.5, 3e5], n) * rng.uniform(0.5, 1.5, n)
    g[rng.random(n) < 0.2] = 0.0  # a stalled worker: all its predictions coincide
    np.testing.assert_array_equal(predict(t, g, R), predict_reference(t, g, R))


@pytest.mark.parametrize("seed", range(10))
def test_push_intervals_matches_reference(seed):
    rng = np.random.default_rng(seed)
    older = rng.uniform(0, 100, int(rng.integers(1, 12)))
    table = np.stack([older, older + rng.integers(0, 4, older.shape[0])], axis=1)
    np.testing.assert_array_equal(push_intervals(table), push_intervals_reference(table))


# --- SSP and DSSP ------------------------------------------------------------------------------


def push_counts(rng) -> np.ndarray:
    n = int(rng.integers(1, 7))
    return rng.integers(0, 5, n).astype(np.int64) + int(rng.integers(0, 3))


@pytest.mark.parametrize("seed", SEEDS)
def test_ssp_and_dssp_helpers_match_references(seed):
    rng = np.random.default_rng(seed)
    iters = push_counts(rng)
    assert dssp_slowest(iters) == dssp_slowest_reference(iters)
    assert dssp_fastest(iters) == dssp_fastest_reference(iters)
    for p in range(iters.shape[0]):
        assert dssp_is_fastest(iters, p) == dssp_is_fastest_reference(iters, p)
        for s in range(5):
            assert ssp_may_continue(iters, p, s) == ssp_may_continue_reference(iters, p, s)


def random_push_table(rng, n: int) -> np.ndarray:
    older = rng.integers(0, 20, n).astype(np.float64)
    return np.stack([older, older + rng.integers(0, 6, n)], axis=1)


def test_dssp_on_push_matches_reference():
    outcomes = set()
    for seed in range(200):
        rng = np.random.default_rng(seed)
        iters = push_counts(rng)
        n = iters.shape[0]
        table = random_push_table(rng, n)
        p, s_lower, r_max = int(rng.integers(0, n)), int(rng.integers(0, 3)), int(rng.integers(0, 5))
        r_extra = int(rng.integers(0, 3)) if rng.random() < 0.3 else 0
        got = dssp_on_push(iters, r_extra, table, p, s_lower, r_max)
        assert tuple(got) == dssp_on_push_reference(iters, r_extra, table, p, s_lower, r_max)
        outcomes.add((bool(got[0]), got[1] > 0))
    # The draws reach every branch of Alg. 1: OK without/with extra iterations left, and wait.
    assert outcomes == {(True, False), (True, True), (False, False)}


def test_dssp_on_push_given_the_scans_matches_reference():
    # the decision given line 7's slowest, the minimum and the maximum (what the simulator
    # keeps incrementally) is Alg. 1 as the reference decides it over the whole table
    outcomes = set()
    for seed in range(200):
        rng = np.random.default_rng(seed)
        iters = push_counts(rng)
        n = iters.shape[0]
        table = random_push_table(rng, n)
        p, s_lower, r_max = int(rng.integers(0, n)), int(rng.integers(0, 3)), int(rng.integers(0, 5))
        if rng.random() < 0.3:      # p a fastest worker: the controller decides
            iters[p] = iters.max()
        r_extra = int(rng.integers(0, 3)) if rng.random() < 0.3 else 0
        slowest = dssp_slowest_reference(iters)
        got = dssp_on_push_given(int(iters[p]), int(iters[slowest]), int(iters.max()), r_extra,
                                 table, p, slowest, s_lower, r_max)
        assert tuple(got) == dssp_on_push_reference(iters, r_extra, table, p, s_lower, r_max)
        outcomes.add((bool(got[0]), got[1] > 0))
    assert outcomes == {(True, False), (True, True), (False, False)}


@pytest.mark.parametrize("seed", range(10))
def test_dssp_push_sequence_matches_reference(seed):
    # A run of pushes: the server state (push counts, r_p, push table) evolves identically.
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    speed = rng.integers(1, 5, n).astype(np.float64)
    iters = np.zeros(n, dtype=np.int64)
    r_k, r_ref = np.zeros(n, dtype=np.int64), [0] * n
    table = np.zeros((n, 2))
    clock = np.zeros(n)
    for _ in range(60):
        p = int(np.argmin(clock + speed))  # the next worker to finish an iteration
        clock[p] += speed[p]
        iters[p] += 1  # Alg. 1 line 1
        table[p] = (table[p, 1], clock[p])
        ok, r_k[p] = dssp_on_push(iters, r_k[p], table, p, 1, 3)
        ok_ref, r_ref[p] = dssp_on_push_reference(iters, r_ref[p], table, p, 1, 3)
        assert (bool(ok), int(r_k[p])) == (ok_ref, r_ref[p])
        if not ok:
            clock[p] = clock.max()  # held at line 17 until the others have pushed


# --- ESync -------------------------------------------------------------------------------------


def esync_arrays(rng, n: int):
    k = rng.integers(0, 3, n).astype(np.int64)
    c = rng.choice([0.1, 0.5, 1.0, 2.0], n)  # repeated capabilities: ties for the slowest
    te = rng.integers(0, 10, n) * 0.5
    ready = rng.random(n) < 0.3
    rnd = rng.integers(0, 2, n).astype(np.int64)
    return k, c, te, ready, rnd


def as_records(k, c, te, ready, rnd):
    return [(i, int(k[i]), float(c[i]), float(te[i]), bool(ready[i]), int(rnd[i])) for i in range(k.shape[0])]


@pytest.mark.parametrize("seed", SEEDS)
def test_esync_slowest_matches_reference(seed):
    rng = np.random.default_rng(seed)
    c = rng.choice([0.1, 0.5, 2.0], int(rng.integers(1, 8)))
    assert esync_slowest(c) == esync_slowest_reference(c)


def test_esync_query_state_and_reset_match_reference():
    decisions = set()
    for seed in range(120):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 6))
        k, c, te, ready, rnd = esync_arrays(rng, n)
        records = as_records(k, c, te, ready, rnd)
        p = int(rng.integers(0, n))
        qk, qc = int(rng.integers(0, 3)), float(rng.choice([0.1, 0.5, 2.0]))
        qte = float(rng.integers(0, 10) * 0.5)
        now, eps = float(rng.integers(0, 12) * 0.5), 0.5
        ok = esync_query_state(k, c, te, ready, rnd, p, qk, qc, qte, now, eps)
        records, ok_ref = esync_query_state_reference(records, p, qk, qc, qte, now, eps)
        assert ok == ok_ref
        assert as_records(k, c, te, ready, rnd) == records  # line 3 and line 10 written back
        decisions.add(bool(ok))
        q, t_round, t_e = int(rng.integers(0, n)), int(rng.integers(1, 4)), float(rng.uniform(0, 20))
        esync_reset(k, te, ready, rnd, q, t_round, t_e)
        assert as_records(k, c, te, ready, rnd) == esync_reset_reference(records, q, t_round, t_e)
    assert decisions == {True, False}


@pytest.mark.parametrize("seed", SEEDS)
def test_esync_delayed_ack_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    k, _, te, ready, rnd = esync_arrays(rng, n)
    compute = rng.choice([0.03, 0.5, 2.0], n)
    rtt = rng.choice([0.0, 0.01, 1.0, 4.0], n)
    records = as_records(k, compute, te, ready, rnd)
    p, now = int(rng.integers(0, n)), float(rng.integers(0, 12) * 0.5)
    got = esync_ready_delayed_ack(k, compute, rtt, te, ready, rnd, p, now, 0.5)
    assert got == esync_ready_delayed_ack_reference(records, compute, rtt, p, now, 0.5)


def test_esync_delta_matches_reference():
    rng = np.random.default_rng(0)
    # Multiples of 1/8 make rtt an exact multiple of compute_time often: the boundary where
    # an iteration just fits in one RTT.
    grid = [(a / 8, b / 8) for a in range(1, 9) for b in range(0, 40)]
    uniform = [(float(rng.uniform(1e-3, 1.0)), float(rng.uniform(0.0, 20.0))) for _ in range(200)]
    for compute_time, rtt in grid + uniform:
        assert esync_delta(compute_time, rtt) == esync_delta_reference(compute_time, rtt)


# --- OSP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_osp_importance_and_rank_match_references(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 6, int(rng.integers(1, 10))).astype(np.int64)  # empty layers too
    P = int(sizes.sum())
    g = rng.integers(-3, 4, P) * rng.choice([1.0, 0.25], P)
    w = rng.integers(-3, 4, P) * rng.choice([1.0, 0.5], P)
    imp = osp_layer_importance(g, w, sizes)
    # Dyadic values: every product and partial sum is exact, so equality is bit for bit and
    # equal importances are really equal (the tie rule of osp_rank is exercised).
    np.testing.assert_array_equal(imp, osp_layer_importance_reference(g, w, sizes))
    np.testing.assert_array_equal(osp_rank(imp), osp_rank_reference(imp))
    real = rng.normal(size=P), rng.normal(size=P)
    np.testing.assert_allclose(
        osp_layer_importance(*real, sizes), osp_layer_importance_reference(*real, sizes), rtol=1e-12
    )


def test_osp_ics_budget_matches_reference():
    rng = np.random.default_rng(0)
    capped = 0
    for _ in range(300):
        args = (
            float(rng.choice([0.0, 1e6, 1.25e9])) * rng.uniform(0.5, 2.0),
            float(rng.choice([0.0, 0.01, 0.5, 1.0])),
            float(rng.uniform(0.0, 2.0)),
            int(rng.integers(1, 64)),
            float(rng.choice([0.0, 1e5, 1e8])),
        )
        got = osp_ics_budget(*args)
        assert got == pytest.approx(osp_ics_budget_reference(*args), rel=1e-12, abs=0.0)
        capped += got == 0.8 * args[4]
    assert 0 < capped < 300  # both sides of Alg. 1 line 2's min are exercised


def test_osp_ics_size_matches_reference():
    rng = np.random.default_rng(1)
    for _ in range(300):
        epoch = int(rng.integers(1, 5))
        first = float(rng.choice([0.5, 2.3, 10.0]))
        loss = first * float(rng.choice([0.0, 0.25, 0.5, 1.0, 1.5, -0.5]))  # above L, below 0
        u_max = float(rng.choice([0.0, 1.0, 1e7]))
        assert osp_ics_size(epoch, loss, first, u_max) == pytest.approx(
            osp_ics_size_reference(epoch, loss, first, u_max), rel=1e-12, abs=0.0
        )
