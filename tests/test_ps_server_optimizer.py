"""The parameter server running the optimizer (``ps_optimizer='server'``) on real ranks.

BSP's way (one step per round on the merged pushes) is refused by a job for now: with Adam,
float64, 3 workers and 3 shards, one run in two to four ended 0.23 (relative) away from
single-process Adam on the concatenated batch, where it must be within 1e-9 -- a pull racing
the round's step on a shard.  ``psopt_programs.bsp_adam`` reproduces it once the refusal in
``mpsync.config.refuse_unsettled`` is lifted.  The shards' optimizer itself is checked against
torch.optim in tests/test_shard_optimizer.py."""

from __future__ import annotations

from mpi_harness import run_mpi


def test_bsp_with_the_servers_optimizer_is_refused_by_the_job_in_one_line():
    run = run_mpi("psopt_programs:bsp_adam", np=4, timeout=180, check=False,
                  args=["ps_optimizer=server", "ps_shards=3"])
    assert run.returncode not in (0, None) and not run.timed_out, run.report()
    said = "".join(run.rank_err(r) for r in run.ranks)
    assert "ps_optimizer='server' with policy='bsp'" in said and "race" in said, run.report()
