"""The parameter server running the optimizer (``ps_optimizer='server'``) on real ranks: BSP
with Adam is single-process Adam on the concatenated batch, to 1e-9 in float64 over 20 steps
(learning rate changed half-way), and the workers never run their own Adam.  (That the
workers' own Adam steps, averaged, are not that model -- the departure [ps-worker-optimizer]
-- is shown in one process by tests/test_shard_optimizer.py.)"""

from __future__ import annotations

from mpi_harness import run_mpi


def test_bsp_with_adam_on_the_server_is_adam_on_the_concatenated_batch():
    run = run_mpi("psopt_programs:bsp_adam", np=4, timeout=180,
                  args=["ps_optimizer=server", "ps_shards=3"])
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    for r in res.values():
        assert r["iterations"] == 20 == r["rounds"], r
        assert r["vs_adam"] <= 1e-9, r
        assert r["worker_state"] == 0, r     # the workers never ran their Adam
    assert len({r["digest"] for r in res.values()}) == 1, res   # one model on every worker
