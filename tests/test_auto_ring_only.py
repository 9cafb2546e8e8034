"""``--policy auto`` with ``auto_ps`` (the default) in a job that cannot host the parameter
server's shards: it falls back to the ring's candidates, says so once, and trains on, on real
ranks.  Where MPI lacks MPI_THREAD_MULTIPLE (mpi4py asked for MPI_THREAD_SERIALIZED, a real
MPI at that level) the job used to fail at ``init`` ("needs MPI_THREAD_MULTIPLE"); the
decision itself is a pure function, tested here too."""

from __future__ import annotations

import json
import os

import pytest

from mpi_harness import run_mpi
from mpsync.auto.explain import comparison_table
from mpsync.server.shard_plan import shards_unavailable

_LINE = "mpsync: policy auto switches on the ring only"


def test_the_shards_need_thread_multiple_and_one_dtype():
    assert shards_unavailable(3, ["torch.float32", "torch.float32"]) is None
    assert "MPI_THREAD_SERIALIZED" in shards_unavailable(2, ["torch.float32"])
    assert "MPI_THREAD_SINGLE" in shards_unavailable(0)
    mixed = shards_unavailable(3, ["torch.float64", "torch.float32"])
    assert "torch.float32, torch.float64" in mixed, mixed


def test_a_plan_onto_the_ps_in_a_job_that_cannot_host_it_is_refused_for_that_reason():
    from mpi4py import MPI

    from mpsync.config import ConfigError, SyncConfig
    from mpsync.torch._runtime import ring_only_without_threads

    planned = SyncConfig(policy="auto", auto_plan="2:asp,5:bsp").validate()
    with pytest.raises(ConfigError, match=r"auto_plan '2:asp,5:bsp' switches to the parameter "
                                          r"server, which this job cannot host: MPI provides "
                                          r"MPI_THREAD_SERIALIZED"):
        ring_only_without_threads(planned, MPI.THREAD_SERIALIZED)
    ring = SyncConfig(policy="auto", auto_plan="2:ebsp").validate()
    assert ring_only_without_threads(ring, MPI.THREAD_SERIALIZED).auto_ps is False
    assert ring_only_without_threads(planned, MPI.THREAD_MULTIPLE) is planned


def test_explain_says_an_auto_run_was_on_the_ring_only(tmp_path):
    reason = "MPI provides MPI_THREAD_SERIALIZED, and the parameter server's shard threads ..."
    (tmp_path / "compare.json").write_text(json.dumps({"rows": [
        {"policy": "bsp", "reached": 1, "repeats": 1, "time_to_target_s": 10.0},
        {"policy": "auto", "reached": 1, "repeats": 1, "time_to_target_s": 9.0}]}))
    for policy, extra in (("bsp", {}), ("auto", {"auto_ring_only": reason})):
        (tmp_path / policy).mkdir()
        (tmp_path / policy / "metrics.json").write_text(json.dumps({"decisions": [], **extra}))
    row = comparison_table(tmp_path).splitlines()[-1]
    assert f"ring only ({reason})" in row, row


def _ring_only_run(env=None, args=(), mpirun_extra=()) -> tuple[dict, str]:
    run = run_mpi("auto_programs:ring_only", np=3, timeout=180, args=list(args),
                  env=env, mpirun_extra=mpirun_extra)
    res = run.results()
    assert sorted(res) == [1, 2], run.report()
    output = "".join("".join(r.values()) for r in run.ranks.values())   # every rank's
    for r in res.values():
        assert r["topologies"] == ["ring"], res
        assert [p["policy"] for p in r["timeline"]] == ["bsp", "ebsp", "bsp"], res
        assert r["switches"] == [["bsp", "ebsp"], ["ebsp", "bsp"]], res
    assert len({r["digest"] for r in res.values()}) == 1, res
    assert output.count(_LINE) == 1, output
    return res, output


@pytest.mark.mpi
def test_auto_without_thread_multiple_switches_on_the_ring_only():
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="serialized")
    res, _ = _ring_only_run(env=env, mpirun_extra=("-x", "MPI4PY_RC_THREAD_LEVEL"))
    for r in res.values():
        assert r["thread_level"] == 2, r          # MPI_THREAD_SERIALIZED, really
        assert "MPI_THREAD_SERIALIZED" in r["ring_only"], r


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_auto_with_a_model_of_two_dtypes_switches_on_the_ring_only(backend):
    # A float64 model whose last bias is float32: two fusion buffers, no one flat model for
    # the shards (the job used to fail when the optimizer was made: "needs all parameters
    # in one dtype").
    res, output = _ring_only_run(args=["mixed=1", f"backend={backend}"])
    for r in res.values():
        assert r["thread_level"] == 3, r
        assert "mixes parameter dtypes" in r["ring_only"], r
    assert "torch.float32, torch.float64" in output, output   # worker 0's line names them
