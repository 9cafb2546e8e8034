"""Grouped calls: reduce-scatters fused into one allreduce below their limit (the cutting as
pure functions), then 3 workers mixing the grouped allreduce's two paths."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_harness import run_mpi
from mpsync.torch import _metadata as meta
from mpsync.torch import _negotiation as neg


def _records(shape, kind=meta.REDUCESCATTER, dtype=1, op=1, n=3):
    rec = meta.record(n, kind, dtype=dtype, shape=shape, op=op,
                      nbytes=int(np.prod(shape)) * 4)
    return np.stack([rec] * n)


def test_small_reducescatters_fuse_up_to_their_limit_and_apart_from_allreduces():
    limit = neg.REDUCESCATTER_FUSION_BYTES
    small = _records((16, 4))
    half = _records((limit // 8,))  # float32: half the limit each
    parts = [small, small, _records((16, 4), dtype=0), half, half, half,
             _records((4,), kind=meta.ALLREDUCE), _records((limit // 2,))]
    # float32 together, float64 apart, two halves to the limit, the third apart, an
    # allreduce apart (never fused with a reduce-scatter), one beyond the limit alone
    assert neg.group_steps(parts, neg.FUSION_BYTES) == [[0, 1], [2], [3, 4], [5], [6], [7]]
    assert neg.group_steps(parts, 0) == [[i] for i in range(len(parts))]  # fusion off
    # Named reduce-scatters answered together fuse by the same rule.
    ready = [("a", small, None), ("b", small, None), ("c", _records((limit // 2,)), None)]
    assert [[item[0] for item in g] for g in neg.fusion_groups(ready)] == [["a", "b"], ["c"]]


def test_a_reducescatter_one_worker_got_wrong_is_never_fused():
    bad = _records((16, 4))
    bad[1, meta.Field.INVALID] = 1
    assert neg.group_steps([_records((16, 4)), bad], neg.FUSION_BYTES) == [[0], [1]]


@pytest.mark.mpi
def test_grouped_calls_on_both_paths_give_horovods_results():
    run = run_mpi("grouped_programs:main", np=3, timeout=240)
    for r in range(3):
        for part in ("plain_and_general_agree", "reducescatters_fused", "allgathers"):
            assert f"PART-OK {part} rank={r}" in run.rank_out(r), run.report()
