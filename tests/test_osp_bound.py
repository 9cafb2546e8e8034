"""OSP's U_max (OSP paper §4.1.2, Eq. 5: U_max = b(1 + lr)·T_c / N) measured on real ranks with
the measured bound (not ``osp_ics_size="fixed"``): b is the link's rate, not the time a fast
worker spends waiting for a straggler inside the Routine Sync."""

from __future__ import annotations

import functools
import itertools
import json

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

SPEEDS = "1,1,2,4"
# Emulated link (bytes/s): a Routine Sync of the 4.2 MB model takes 1.5 x 4.2 MB / 40 MB/s =
# 158 ms, less than the 240 ms the fastest worker would wait for the slowest (base 80 ms x 4),
# so a rate timed around the waiting would differ between workers by about 2x.
BANDWIDTH = 40e6


@functools.lru_cache(maxsize=None)
def _run(bandwidth: float) -> dict[int, dict]:
    run = run_mpi("osp_programs:measured_bound", np=5, timeout=240,
                  args=[f"bandwidth={bandwidth}", f"speeds={SPEEDS}"])
    out = {}
    for rank in run.ranks:
        for line in run.rank_out(rank).splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
                out[r["rank"]] = r
    assert sorted(out) == [0, 1, 2, 3], run.report()
    return out


def test_osp_u_max_differs_between_workers_by_their_compute_times_only():
    res = _run(BANDWIDTH)
    rates = [r["link_rate"] for r in res.values()]
    assert min(rates) > 0, res
    # One link rate for everyone, waiting or not (the fastest waits ~240 ms per round).
    assert max(rates) / min(rates) <= 1.5, res
    for a, b in itertools.combinations(res.values(), 2):
        u = a["u_max"] / b["u_max"]
        t = a["compute_time"] / b["compute_time"]
        assert 1 / 1.5 <= u / t <= 1.5, (a, b)
    slow = max(res.values(), key=lambda r: r["speed"])
    fast = min(res.values(), key=lambda r: r["speed"])
    assert slow["u_max"] / fast["u_max"] >= 2.0, (slow, fast)   # compute times 4:1
    # The measured bound sized In-Computation Sync on the server (Alg. 1, epochs 2-3).
    assert all(r["ics_layers"] > 0 for r in res.values()), res


def test_halving_the_link_rate_shrinks_every_workers_u_max():
    full, half = _run(BANDWIDTH), _run(BANDWIDTH / 2)
    for rank in full:
        assert half[rank]["link_rate"] < 0.75 * full[rank]["link_rate"], (full[rank], half[rank])
        assert half[rank]["u_max"] < 0.75 * full[rank]["u_max"], (full[rank], half[rank])


def test_osp_with_sgd_momentum_corrects_the_momentum_buffer_too():
    """Eq. 7 under momentum SGD: the model after the last correction is momentum SGD on the
    mean gradients (a local gradient left in a momentum buffer would be applied again at every
    later step)."""
    run = run_mpi("osp_programs:momentum_conservation", np=4, timeout=180)
    res = {}
    for rank in run.ranks:
        for line in run.rank_out(rank).splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT "):])
                res[r["rank"]] = r
    assert sorted(res) == [0, 1, 2], run.report()
    for r in res.values():
        assert r["ics_layers"] > 0, r
        assert r["err"] <= 1e-9, r
