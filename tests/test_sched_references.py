"""ZipLine's jitted kernels (Ω, binary search, validation, ZipLineOpt/OptBS) against their
plain-Python references on seeded random inputs.

The inputs are drawn from small integer pools on purpose: equal timestamps are where the tie
rules of the paper decide, and where an off-by-one in a kernel shows. The same tests run
un-jitted (NUMBA_DISABLE_JIT=1) from tests/test_sched_isolation.py; the other policies' kernels
are in tests/test_sched_policy_references.py.
"""

from __future__ import annotations

import os

import numba
import numpy as np
import pytest

from mpsync.sched import zipline_omega as _k
from mpsync.sched import zipline_scans as _s
from mpsync.sched import predict, zipline
from mpsync.sched import zipline_reference as ref

SEEDS = range(40)


def tie_heavy_matrix(rng, n: int, R: int) -> np.ndarray:
    """Sorted rows over a pool of 2-6 values, sometimes with copied rows: ties everywhere."""
    values = int(rng.integers(2, 7))
    M = np.sort(rng.integers(0, values, (n, R)).astype(np.float64), axis=1)
    if n > 1 and rng.random() < 0.3:
        M[rng.integers(0, n)] = M[rng.integers(0, n)]  # two workers with identical predictions
    return M * float(rng.choice([1.0, 0.5, 1000.0]))


def random_matrix(seed: int) -> np.ndarray:
    """Mostly tie-heavy, every fourth seed the §6.1 generator (distinct timestamps)."""
    rng = np.random.default_rng(seed)
    n, R = int(rng.integers(1, 24)), int(rng.integers(1, 10))
    if seed % 4 == 3:
        return predict(rng.uniform(10.0, 50.0, n), rng.uniform(1000.0, 1500.0, n), R)
    return tie_heavy_matrix(rng, n, R)


def test_jit_state_matches_environment():
    """Guards the un-jitted run: with NUMBA_DISABLE_JIT=1 the kernels must be plain functions,
    otherwise that run would silently test the compiled code a second time."""
    disabled = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")
    is_dispatcher = isinstance(_k.merge_pushes, numba.core.dispatcher.Dispatcher)
    assert is_dispatcher != disabled


# --- ZipLine internals: Ω, binary search, validation, canonical z ------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_merge_builds_omega_in_paper_order(seed):
    # Ω of §5.2 Step 1: by timestamp, equal timestamps by worker id (then by index in a row).
    M = random_matrix(seed)
    ts, ws = _k.merge_pushes(M)
    expected = ref.omega(M)
    np.testing.assert_array_equal(ts, [e[0] for e in expected])
    np.testing.assert_array_equal(ws, [e[1] for e in expected])


@pytest.mark.parametrize(
    "M",
    [
        np.arange(15.0).reshape(5, 3),  # rows that do not overlap: the copy path of every pass
        np.arange(15.0).reshape(5, 3)[::-1].copy(),  # the same, rows in reverse time order
        np.full((7, 3), 2.0),  # one timestamp for everybody: worker id alone orders Ω
        np.tile(np.arange(4.0), (9, 1)),  # identical rows: n-way ties at every timestamp
    ],
    ids=["disjoint", "disjoint-reversed", "all-equal", "identical-rows"],
)
def test_merge_structured_inputs(M):
    ts, ws = _k.merge_pushes(M)
    expected = ref.omega(M)
    np.testing.assert_array_equal(ts, [e[0] for e in expected])
    np.testing.assert_array_equal(ws, [e[1] for e in expected])


def signed_matrix(seed: int) -> np.ndarray:
    """random_matrix with negative timestamps and both zeros: the float-to-key map's cases."""
    rng = np.random.default_rng(seed)
    M = random_matrix(seed) - float(rng.choice([0.0, 1.0, 2.0]))
    zeros = M == 0.0
    M[zeros] = rng.choice([0.0, -0.0], size=int(zeros.sum()))  # -0.0 == 0.0: order by worker
    return M


def same_bits(a, b) -> bool:
    bits = [np.asarray(x, dtype=np.float64).view(np.uint64) for x in (a, b)]
    return np.array_equal(*bits)


@pytest.mark.parametrize("seed", SEEDS)
def test_omega_sort_path_matches_merge_and_reference(seed):
    # The two ways of building Ω (§5.2 Step 1) give the same arrays bit for bit, -0.0 included.
    M = signed_matrix(seed)
    ts_m, ws_m = _k.merge_pushes(M)
    expected = ref.omega(M)
    for quanta in (0, 2**40):  # the 32-bit keys always, never
        ts, ws = _k.omega(M, sort_min=0, quanta=quanta)
        assert same_bits(ts, ts_m)
        np.testing.assert_array_equal(ws, ws_m)
        assert same_bits(ts, [e[0] for e in expected])
        np.testing.assert_array_equal(ws, [e[1] for e in expected])


@pytest.mark.parametrize("seed", SEEDS)
def test_omega_keys32_order_time_then_worker_and_unpack_to_reference(seed):
    # 32-bit keys order by time quantum, then worker id; a worker's keys follow its row. The
    # unpack must restore Ω's order within a quantum, here with many elements per quantum.
    rng = np.random.default_rng(seed)
    M = signed_matrix(seed) if seed % 2 else tie_heavy_matrix(rng, int(rng.integers(1, 9)), 6)
    M[-1, -1] = M.max() + float(rng.choice([1.0, 1e9, 1e300]))  # coarse quanta: more ties
    n, R = M.shape
    keys = np.empty(M.size, dtype=np.uint32)
    wbits = _k.omega_keys32(M, keys)
    assert wbits == (n - 1).bit_length()
    worker = keys & np.uint32((1 << wbits) - 1)
    np.testing.assert_array_equal(worker, np.repeat(np.arange(n), R))
    t = M.ravel() + 0.0
    quantum = (keys >> np.uint32(wbits)).astype(np.int64)
    earlier = t[:, None] < t[None, :]
    assert (quantum[:, None] <= quantum[None, :])[earlier].all()  # time order, up to a quantum
    assert (quantum[:, None] == quantum[None, :])[t[:, None] == t[None, :]].all()
    # The unpack moves one element per pair out of time order, and gives up past 4·Rn moves.
    moves = int(((keys[:, None] < keys[None, :]) & (t[:, None] > t[None, :])).sum())
    keys.sort()
    ts, ws = np.empty(M.size), np.empty(M.size, dtype=np.int32)
    assert _k.omega_unpack32(M, keys, wbits, ts, ws) == (moves <= 4 * M.size)
    if moves <= 4 * M.size:
        expected = ref.omega(M)
        assert same_bits(ts, [e[0] for e in expected])
        np.testing.assert_array_equal(ws, [e[1] for e in expected])


@pytest.mark.parametrize("seed", SEEDS)
def test_omega_keys_sort_like_lexsort(seed):
    # Sorting exact keys is a stable sort of the worker-major layout by timestamp (-0.0 as
    # 0.0): the permutation of np.lexsort on (index, timestamp). Truncated keys (a span that
    # crosses zero or many binades) give it after a stable sort on the timestamp alone.
    M = signed_matrix(seed) if seed % 2 else random_matrix(seed) + 1000.0
    N = M.size
    t = M.ravel() + 0.0
    keys = np.empty(N, dtype=np.uint64)
    ibits, exact = _k.omega_keys(M, keys)
    assert exact or seed % 2
    index = keys & np.uint64((1 << ibits) - 1)
    np.testing.assert_array_equal(index, np.arange(N))
    order = np.argsort(keys)
    if not exact:
        order = order[np.argsort(t[order], kind="stable")]
    np.testing.assert_array_equal(order, np.lexsort((np.arange(N), t)))


@pytest.mark.parametrize("seed", SEEDS)
def test_scan_keys_matches_alg2_or_refuses_keys_out_of_omega_order(seed):
    # Straight from sorted 64-bit keys, optbs's and the window's search: the result of Alg. 2
    # when the keys are in Ω's order, else ok False (truncated keys of near ties).
    rng = np.random.default_rng(seed)
    kind = seed % 4
    if kind == 0:
        M = random_matrix(seed)
    elif kind == 1:
        M = signed_matrix(seed)
    elif kind == 2:
        M = tie_heavy_matrix(rng, int(rng.integers(1, 9)), int(rng.integers(1, 9)))
    else:
        M = near_tie_matrix(seed, 3 + seed % 5, 4 + seed % 3)
    n, R = M.shape
    keys, ibits, wide = _k.sorted_keys(M, quanta=2**40)
    assert wide
    ws = np.empty(M.size, dtype=np.int32)
    ok, z, d, t_sync = _s.scan_keys(M, keys, ibits, ws)
    index = (keys & np.uint64((1 << ibits) - 1)).astype(np.int64)
    expected_order = [p * R + i for _, p, i in ref.omega(M)]
    assert ok == (index.tolist() == expected_order)
    if ok:
        np.testing.assert_array_equal(ws, [p for _, p, _ in ref.omega(M)])
        expected = ref.zipline_alg2(M)
        assert (d, t_sync) == (expected[1], expected[2])
        np.testing.assert_array_equal(z, expected[0])


def near_tie_matrix(seed: int, n: int, R: int) -> np.ndarray:
    """Timestamps a few ulps apart next to ±1e300: the span leaves too few key bits for all
    timestamps, so neighbours share a key prefix and come out of the sort by index."""
    rng = np.random.default_rng(seed)
    M = np.sort(1.0 + rng.integers(0, 6, (n, R)) * np.finfo(np.float64).eps, axis=1)
    M[0, -1] = 1e300
    M[-1, 0] = -1e300
    return np.sort(M, axis=1)


@pytest.mark.parametrize("seed", range(10))
def test_omega_with_truncated_keys(seed):
    M = near_tie_matrix(seed, 3 + seed, 4 + seed % 3)
    keys = np.empty(M.size, dtype=np.uint64)
    _, exact = _k.omega_keys(M, keys)
    assert not exact
    ts, ws = _k.omega(M, sort_min=0)
    expected = ref.omega(M)
    assert same_bits(ts, [e[0] for e in expected])
    np.testing.assert_array_equal(ws, [e[1] for e in expected])


def test_omega_falls_back_to_merge_past_the_move_budget():
    # One element per worker, later workers a few ulps earlier: with truncated keys they come
    # out of the sort in reverse time order, and undoing that exceeds 4·Rn moves.
    n = 64
    M = (1.0 + np.arange(n, 0, -1) * np.finfo(np.float64).eps).reshape(n, 1)
    M[0, 0], M[-1, 0] = 1e300, -1e300
    keys = np.empty(n, dtype=np.uint64)
    ibits, exact = _k.omega_keys(M, keys)
    keys.sort()
    assert not exact
    assert not _k.omega_unpack(M, keys, ibits, np.empty(n), np.empty(n, dtype=np.int32))
    ts, ws = _k.omega(M, sort_min=0)
    expected = ref.omega(M)
    assert same_bits(ts, [e[0] for e in expected])
    np.testing.assert_array_equal(ws, [e[1] for e in expected])


@pytest.mark.parametrize("seed", SEEDS)
def test_check_matches_reference(seed):
    rng = np.random.default_rng(seed)
    M = tie_heavy_matrix(rng, int(rng.integers(1, 8)), int(rng.integers(1, 6)))
    for _ in range(int(rng.integers(0, 3))):  # plant up to two problems anywhere
        p, i = int(rng.integers(0, M.shape[0])), int(rng.integers(0, M.shape[1]))
        M[p, i] = rng.choice([np.nan, np.inf, -np.inf, -1.0, 99.0])
    assert tuple(_k.check_prediction(M)) == ref.check_reference(M)


@pytest.mark.parametrize("seed", SEEDS)
def test_z_at_matches_canonical_z(seed):
    M = random_matrix(seed)
    rng = np.random.default_rng(seed)
    # t_sync on an element (the case of every exact variant), between elements and outside.
    probes = [float(rng.choice(M.ravel())), float(M.min()) - 1.0, float(M.max()) + 1.0]
    probes.append(float(rng.uniform(M.min(), M.max() + 1e-9)))
    for t_sync in probes:
        np.testing.assert_array_equal(_s.z_at(M, t_sync), ref.canonical_z(M, t_sync))


# --- ZipLineOpt and ZipLineOptBS: references and the Alg. 2 candidate sequence -----------------


@pytest.mark.parametrize("seed", SEEDS)
def test_opt_and_optbs_match_references_and_alg2_candidates(seed):
    M = random_matrix(seed)
    alg2 = ref.zipline_alg2(M)
    for variant, reference in (("opt", ref.zipline_opt), ("optbs", ref.zipline_optbs)):
        expected = reference(M)
        # The references must themselves agree with Alg. 2: pruning by Thm. 3 loses nothing.
        assert (expected[1], expected[2]) == (alg2[1], alg2[2])
        np.testing.assert_array_equal(expected[3], alg2[3])
        result = zipline(M, variant, return_candidates=True)
        assert (result.d, result.t_sync) == (expected[1], expected[2]), variant
        np.testing.assert_array_equal(result.z, expected[0])
        np.testing.assert_array_equal(result.candidates, alg2[3])



@pytest.mark.parametrize("seed", range(12))
def test_optbs_long_rows(seed):
    # Long rows against few workers: Z's front stops at a worker whose predictions ran out and
    # then skips long stretches of dead elements; with ties, many equal timestamps in Z.
    rng = np.random.default_rng(seed)
    n, R = int(rng.integers(1, 7)), int(rng.integers(17, 60))
    if seed % 3 == 2:
        M = predict(rng.uniform(10.0, 50.0, n), rng.uniform(1000.0, 1500.0, n), R)
    else:
        M = tie_heavy_matrix(rng, n, R)
    expected = ref.zipline_optbs(M)
    result = zipline(M, "optbs", return_candidates=True)
    assert (result.d, result.t_sync) == (expected[1], expected[2])
    np.testing.assert_array_equal(result.z, expected[0])
    np.testing.assert_array_equal(result.candidates, expected[3])

@pytest.mark.parametrize("seed", range(10))
def test_all_exact_variants_have_alg2_length(seed):
    # §5.2: the first Z takes k0 elements of Ω, then each of the Rn - k0 others forms one Z.
    M = random_matrix(seed)
    elements, seen, k0 = ref.omega(M), set(), 0
    while len(seen) < M.shape[0]:
        seen.add(elements[k0][1])
        k0 += 1
    for variant in ("basic", "opt", "optbs", "window"):
        assert len(zipline(M, variant, return_candidates=True).candidates) == M.size - k0 + 1


def test_thm3_holds_on_skipped_candidates():
    # Thm. 3 (case ii): when the incoming worker is not the oldest in Z, d_Z' >= d_Z. The
    # references record skipped candidates, so the sequence must not drop at those steps.
    for seed in SEEDS:
        M = random_matrix(seed)
        elements = ref.omega(M)
        cands = ref.zipline_alg2(M)[3]
        n = M.shape[0]
        Z: list[tuple[float, int, int]] = []
        k = 0
        for e in elements:
            complete = len(Z) == n
            oldest_is_own = bool(Z) and Z[0][1] == e[1]
            Z = [x for x in Z if x[1] != e[1]] + [e]
            if len(Z) == n:
                if complete and not oldest_is_own:
                    assert cands[k] >= cands[k - 1]
                k += 1
