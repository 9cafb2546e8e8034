"""Every worker on the parameter server starts from the same weights, with the workers
running the optimizer (``ps_optimizer='worker'``, the default), on real ranks: a worker that
takes its first step late (its first pull after a faster worker's first step) still reads the
starting weights, because no worker pushes before every worker has pulled them.  Without
that, the late worker started from weights holding the fast worker's first push: BSP ended
1.2e-5 away from single-process SGD, and ElasticBSP's first superstep did not start from
one model (ZipLine §6.2.5)."""

from __future__ import annotations

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


def _run(policy: str, start_late: bool) -> dict:
    run = run_mpi("psopt_programs:ps_rounds", np=4, timeout=180,
                  args=[f"policy={policy}", "ps_optimizer=worker", "optimizer=sgd",
                        "ps_shards=3", f"start_late={int(start_late)}"])
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    for r in res.values():
        assert r["first_pull"] == r["start"], (policy, start_late, res)  # the starting model
        assert not r["pushed_before_start"], (policy, start_late, res)
    return res


@pytest.mark.parametrize("start_late", [False, True])
def test_bsp_on_the_ps_with_workers_optimizing_is_sgd_on_the_concatenated_batch(start_late):
    # start_late: workers 1 and 2 take their first step only after worker 0's first push,
    # or after 2 s when that push cannot come before their pulls (as it must not).
    res = _run("bsp", start_late)
    for r in res.values():
        assert r["vs_reference"] <= 1e-9, r
        assert r["rounds"] == 20 == r["iterations"], r
        assert r["worker_state"] > 0, r      # the workers ran SGD with momentum themselves
    assert len({r["digest"] for r in res.values()}) == 1, res


@pytest.mark.parametrize("policy", ["ebsp", "esync"])
def test_local_step_policies_on_the_ps_start_every_worker_from_the_same_weights(policy):
    res = _run(policy, start_late=True)
    assert len({r["digest"] for r in res.values()}) == 1, res   # synchronize()d
