"""ZipLine family and lookahead: kernels vs references vs brute force (ZipLine paper §4-§5)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsync.sched import (
    EXACT_VARIANTS,
    FASTEST_EXACT_VARIANT,
    ZIPLINE_VARIANTS,
    ZipLineResult,
    predict,
    predict_reference,
    push_intervals,
    zipline,
)
from mpsync.sched import zipline_omega as _k
from mpsync.sched import zipline_scans as _s
from mpsync.sched import zipline_reference as ref


def paper_matrix(n: int, R: int, seed: int) -> np.ndarray:
    """§6.1 generator: interval U[1000, 1500] ms, start offset U[10, 50] ms."""
    rng = np.random.default_rng(seed)
    interval = rng.uniform(1000.0, 1500.0, n)
    start = rng.uniform(10.0, 50.0, n)
    return predict(start, interval, R)


def tie_matrix(n: int, R: int, seed: int, values: int = 5) -> np.ndarray:
    """Small integer timestamps: many ties across and within rows."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, values, (n, R)).astype(np.float64), axis=1)


@st.composite
def small_matrices(draw):
    n = draw(st.integers(1, 4))
    R = draw(st.integers(1, 4))
    pool = draw(st.sampled_from([[0.0, 1.0, 2.0], [0.0, 0.5, 1.0, 1.5, 2.5, 4.0], [0.1, 0.2, 0.3, 0.7]]))
    cells = draw(st.lists(st.sampled_from(pool), min_size=n * R, max_size=n * R))
    return np.sort(np.array(cells, dtype=np.float64).reshape(n, R), axis=1)


def assert_same(result, expected):
    z, d, t, _ = expected
    assert result.d == d
    assert result.t_sync == t
    np.testing.assert_array_equal(result.z, z)


def assert_valid(M, result):
    """z picks one element per worker, and d, t_sync are its spread and maximum."""
    picked = M[np.arange(M.shape[0]), result.z]
    assert picked.max() == result.t_sync
    assert picked.max() - picked.min() == result.d


# --- exact variants against the brute force over all R^n solutions -------------------------


@settings(max_examples=300, deadline=None)
@given(small_matrices())
def test_exact_variants_match_brute_force(M):
    expected = ref.brute_force(M)
    for variant in EXACT_VARIANTS:
        result = zipline(M, variant)
        assert_same(result, expected)
        assert_valid(M, result)


@settings(max_examples=150, deadline=None)
@given(small_matrices())
def test_gridscan_is_valid_and_never_better_than_optimum(M):
    _, d_star, _, _ = ref.brute_force(M)
    result = zipline(M, "gridscan")
    assert_valid(M, result)
    assert result.d >= d_star


@pytest.mark.parametrize("seed", range(40))
def test_exact_variants_on_seeded_ties(seed):
    n, R = 1 + seed % 5, 1 + (seed // 5) % 4
    M = tie_matrix(n, R, seed, values=3 + seed % 4)
    expected = ref.brute_force(M)
    for variant in EXACT_VARIANTS:
        assert_same(zipline(M, variant), expected)


# --- jitted kernels against their plain-Python references ------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_kernels_match_references(seed):
    rng = np.random.default_rng(seed)
    n, R = int(rng.integers(1, 30)), int(rng.integers(1, 12))
    M = tie_matrix(n, R, seed, values=int(rng.integers(2, 40))) if seed % 2 else paper_matrix(n, R, seed)
    pairs = {
        "basic": ref.zipline_alg2(M),
        "window": ref.window_reference(M),
        "gridscan": ref.gridscan_reference(M),
        "fullgridscan": ref.gridscan_reference(M, full=True),
    }
    for variant, expected in pairs.items():
        result = zipline(M, variant, return_candidates=True)
        assert_same(result, expected)
        np.testing.assert_array_equal(result.candidates, expected[3])


def test_predict_matches_reference_and_formula():
    rng = np.random.default_rng(7)
    t, g = rng.uniform(0, 100, 9), rng.uniform(0, 5, 9)
    M = predict(t, g, 6)
    assert M.shape == (9, 6) and M.dtype == np.float64
    np.testing.assert_array_equal(M, predict_reference(t, g, 6))
    np.testing.assert_array_equal(M[:, 2], t + 3 * g)
    table = np.stack([t - g, t], axis=1)
    np.testing.assert_allclose(push_intervals(table), g)


# --- variants agree with each other on large inputs ------------------------------------------


@pytest.mark.parametrize("n,R,seed", [(1000, 15, 0), (400, 150, 1), (300, 40, 2)])
def test_exact_variants_agree_on_paper_data(n, R, seed):
    M = paper_matrix(n, R, seed)
    results = {v: zipline(M, v) for v in ("basic", "opt", "optbs", "window")}
    if n * n * R * R <= 2e9:
        results["fullgridscan"] = zipline(M, "fullgridscan")
    first = results["window"]
    assert_valid(M, first)
    for variant, result in results.items():
        assert (result.d, result.t_sync) == (first.d, first.t_sync), variant
        np.testing.assert_array_equal(result.z, first.z)
    assert zipline(M, "gridscan").d >= first.d


@pytest.mark.parametrize(
    "M", [paper_matrix(1000, 150, 5), tie_matrix(500, 30, 4, values=200)], ids=["paper", "ties"]
)
def test_omega_sort_and_merge_agree_on_large_input(M):
    # Every variant that scans Ω gets it from the same builder; the two builders must agree.
    ts_sort, ws_sort = (a.copy() for a in _k.omega(M, sort_min=0))
    ts_merge, ws_merge = _k.merge_pushes(M)
    np.testing.assert_array_equal(ts_sort.view(np.uint64), ts_merge.view(np.uint64))
    np.testing.assert_array_equal(ws_sort, ws_merge)

@pytest.mark.parametrize(
    "M", [paper_matrix(1200, 150, 2), tie_matrix(4100, 8, 3, values=3000)], ids=["paper", "ties"]
)
def test_search_from_keys_and_from_unpacked_omega_agree_on_large_input(M):
    # Enough elements for 64-bit keys: without candidates, optbs and the window search from
    # the sorted keys (scan_keys); with candidates, from the unpacked Ω. Same result.
    keys, ibits, wide = _k.sorted_keys(M)
    assert wide
    ok, z, d, t_sync = _s.scan_keys(M, keys, ibits, np.empty(M.size, dtype=np.int32))
    assert ok
    for variant in ("optbs", "window"):
        result = zipline(M, variant)
        unpacked = zipline(M, variant, return_candidates=True)
        assert (result.d, result.t_sync) == (d, t_sync) == (unpacked.d, unpacked.t_sync)
        np.testing.assert_array_equal(result.z, z)
        np.testing.assert_array_equal(unpacked.z, z)


def test_exact_variants_agree_on_large_tie_heavy_input():
    M = tie_matrix(500, 30, 3, values=200)
    results = [zipline(M, v) for v in ("basic", "opt", "optbs", "window")]
    for r in results[1:]:
        assert (r.d, r.t_sync) == (results[0].d, results[0].t_sync)
        np.testing.assert_array_equal(r.z, results[0].z)


# --- the candidate sequence of Alg. 2 --------------------------------------------------------


def test_basic_candidates_length_and_values():
    M = paper_matrix(10, 15, 4)  # the shape of the paper's Figs. 4 and 6
    result = zipline(M, "basic", return_candidates=True)
    elements = ref.omega(M)
    seen, k0 = set(), 0
    while len(seen) < 10:
        seen.add(elements[k0][1])
        k0 += 1
    assert len(result.candidates) == 10 * 15 - k0 + 1
    assert result.candidates.min() == result.d
    # Fig. 6: the optimum is the first candidate reaching the minimum (earliest barrier).
    first = int(np.flatnonzero(result.candidates == result.d)[0])
    assert elements[k0 - 1 + first][0] == result.t_sync
    for variant in ("opt", "optbs", "window"):
        np.testing.assert_array_equal(zipline(M, variant, return_candidates=True).candidates, result.candidates)


def test_candidates_none_unless_asked():
    assert zipline(paper_matrix(5, 4, 0), "basic").candidates is None


def test_candidate_counts_of_grid_baselines():
    M = paper_matrix(6, 5, 9)
    assert len(zipline(M, "gridscan", return_candidates=True).candidates) == 5
    assert len(zipline(M, "fullgridscan", return_candidates=True).candidates) == 30


# --- tie rule and hand-checked cases ---------------------------------------------------------


def test_tie_prefers_earliest_barrier():
    # Two optima with d = 1: {1, 2} and {5, 6}; §4.2 (Thm. 1) picks the earlier one.
    M = np.array([[1.0, 5.0], [2.0, 6.0]])
    for variant in EXACT_VARIANTS:
        r = zipline(M, variant)
        assert (r.d, r.t_sync) == (1.0, 2.0)
        np.testing.assert_array_equal(r.z, [0, 0])


def test_z_is_each_workers_last_push_not_after_barrier():
    # Worker 1 pushes at 8 and again at 10 = t_sync: it waits least if its barrier element is 10.
    M = np.array([[10.0, 30.0], [8.0, 10.0], [8.0, 30.0]])
    for variant in EXACT_VARIANTS:
        r = zipline(M, variant)
        assert (r.d, r.t_sync) == (2.0, 10.0)
        np.testing.assert_array_equal(r.z, [0, 1, 0])


def test_gridscan_misses_optimum_outside_designated_row():
    # Designated row 0 (earliest first push); the optimum {20, 20.5} starts in row 1.
    M = np.array([[0.0, 20.5], [10.0, 20.0]])
    assert zipline(M, "gridscan").d == 10.0
    assert zipline(M, FASTEST_EXACT_VARIANT).d == 0.5


# --- edge cases and bad input ----------------------------------------------------------------


@pytest.mark.parametrize("variant", ZIPLINE_VARIANTS)
def test_single_worker_and_single_iteration(variant):
    r = zipline(np.array([[3.0, 4.0, 4.0]]), variant)
    assert r.d == 0.0 and r.t_sync == 3.0 and list(r.z) == [0]
    r = zipline(np.array([[3.0], [1.0], [2.0]]), variant)
    assert (r.d, r.t_sync) == (2.0, 3.0) and list(r.z) == [0, 0, 0]


@pytest.mark.parametrize("variant", ZIPLINE_VARIANTS)
def test_all_timestamps_equal(variant):
    r = zipline(np.full((4, 3), 7.0), variant)
    assert (r.d, r.t_sync) == (0.0, 7.0)


def test_result_type_and_accepts_lists_and_ints():
    r = zipline([[1, 3], [2, 4]], FASTEST_EXACT_VARIANT)
    assert isinstance(r, ZipLineResult) and r.z.dtype == np.int64
    assert isinstance(r.d, float) and isinstance(r.t_sync, float)
    assert (r.d, r.t_sync) == (1.0, 2.0)


@pytest.mark.parametrize(
    "M,match",
    [
        (np.empty((0, 3)), "empty"),
        (np.empty((3, 0)), "R = 0"),
        (np.arange(4.0), "2-D"),
        (np.ones((2, 2, 2)), "2-D"),
        (np.array([[1.0, np.nan]]), "NaN or inf"),
        (np.array([[1.0, 2.0], [np.inf, np.inf]]), "NaN or inf"),
        (np.array([[1.0, 2.0], [3.0, 2.5]]), "row 1"),
        ([["a", "b"]], "2-D array"),
    ],
)
def test_bad_input_raises(M, match):
    with pytest.raises(ValueError, match=match):
        zipline(M)


def test_unknown_variant_raises():
    with pytest.raises(ValueError, match="unknown ZipLine variant"):
        zipline(np.ones((2, 2)), "zipzap")


@pytest.mark.parametrize(
    "args,match",
    [
        (([0.0], [1.0], 0), "R must be >= 1"),
        (([0.0], [1.0], 2.5), "integer"),
        (([0.0, 1.0], [1.0], 2), "differ in length"),
        (([0.0], [-1.0], 2), "interval must be >= 0"),
        (([np.nan], [1.0], 2), "NaN"),
    ],
)
def test_predict_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        predict(*args)


def test_variant_constants():
    assert ZIPLINE_VARIANTS == ("basic", "opt", "optbs", "gridscan", "fullgridscan", "window")
    assert FASTEST_EXACT_VARIANT == "window" and "gridscan" not in EXACT_VARIANTS
