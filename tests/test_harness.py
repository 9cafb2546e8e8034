"""The multi-rank harness: real mpirun runs, and proof that no run can hang the suite."""

from __future__ import annotations

import time

import pytest

from mpi_harness import MPIFailure, run_mpi

pytestmark = pytest.mark.mpi


def test_ring_of_point_to_point_messages_over_4_ranks():
    run = run_mpi("mpi_programs:ring", np=4, timeout=60)
    assert "ring ok size=4 token=12" in run.rank_out(0)
    assert sorted(run.ranks) == [0, 1, 2, 3]


def test_mpi4py_allreduce():
    run = run_mpi("mpi_programs:allreduce", np=3, timeout=60)
    for r in range(3):
        assert f"allreduce ok rank={r}" in run.rank_out(r)


def test_horovod_allreduce_on_a_communicator_that_excludes_rank0():
    run = run_mpi("mpi_programs:horovod_without_rank0", np=4, timeout=120)
    assert "server rank served 3 workers" in run.rank_out(0)
    for r in (1, 2, 3):
        assert f"horovod ok rank={r} hvd_rank={r - 1} size=3" in run.rank_out(r), run.report()


def test_arguments_reach_the_ranks():
    run = run_mpi("mpi_programs:print_args", np=2, args=["--x", 3], timeout=60)
    assert run.rank_out(1).strip() == "args: --x 3"


def test_a_hanging_child_is_killed_and_reported_as_a_timeout_within_the_limit():
    limit = 15.0
    start = time.monotonic()
    with pytest.raises(MPIFailure) as info:
        run_mpi("mpi_programs:hang_on_rank1", np=2, timeout=limit)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "timed out after" in message
    # The deadline kills the process group (TERM, then KILL); allow a few seconds for that.
    assert elapsed < limit + 10, f"harness took {elapsed:.1f}s for a {limit}s limit"
    assert "pid=" in message  # the ranks' output is in the failure report


def test_a_rank_that_raises_fails_the_run_with_its_rank_and_traceback():
    run = run_mpi("mpi_programs:raise_on_rank2", np=3, timeout=60, check=False)
    assert not run.ok and not run.timed_out
    assert run.failed_ranks() == [2]
    report = run.report()
    assert "failing rank(s): [2]" in report
    assert "deliberate failure on rank 2" in report
