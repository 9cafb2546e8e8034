"""No rank hangs the job: each fault ends the job non-zero within 30 s and
the output names the failed rank.

Each program runs as a plain script (not through the harness's runner), so what ends the job
is mpsync's own machinery: the abort hook installed by ``mps.init``, the collective deadline, or
Open MPI noticing a dead process.  The time from the fault (printed by the rank just before it)
to the end of ``mpirun`` is printed for the report (``pytest -s``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

PROGRAMS = str(Path(__file__).resolve().parent / "torch_programs.py")
LIMIT = 30.0  # seconds from the fault to the end of the job


def run_fault(name: str, *args: str, np: int = 4):
    start_wall = time.time()
    run = run_mpi(PROGRAMS, np=np, args=[name, *args], timeout=90, check=False)
    end_wall = start_wall + run.elapsed
    faults = [float(m) for r in run.ranks
              for m in re.findall(r"^FAULT (\S+)$", run.rank_out(r), flags=re.M)]
    assert not run.timed_out, run.report()
    assert run.returncode not in (0, None), run.report()
    assert len(faults) == 1, run.report()
    to_abort = end_wall - faults[0]
    print(f"\n{name}: job ended {to_abort:.2f}s after the fault (exit {run.returncode})")
    assert to_abort < LIMIT, run.report()
    return run, to_abort


def all_output(run) -> str:
    return run.stderr + run.stdout + "".join(
        o.get("stderr", "") + o.get("stdout", "") for o in run.ranks.values())


def test_a_worker_that_raises_aborts_the_job_with_its_traceback():
    run, _ = run_fault("fail_worker_raises", "victim=1")
    # world rank 2 = worker 1 (rank 0 is the dedicated server)
    assert run.failed_ranks() == [2], run.report()
    err = run.rank_err(2)
    assert "MPSYNC-RANK-FAILED rank 2 (worker 1)" in err
    assert "Traceback" in err and "deliberate failure on worker 1" in err


def test_a_worker_killed_with_sigkill_ends_the_job():
    run, _ = run_fault("fail_worker_sigkill", "victim=2")
    text = all_output(run)
    # Open MPI names the dead process (world rank 3 = worker 2).
    assert re.search(r"rank 3 .*exited on signal 9", text, flags=re.S), run.report()


def test_the_server_rank_killed_ends_the_job():
    run, _ = run_fault("fail_server_killed")
    text = all_output(run)
    assert re.search(r"rank 0 .*exited on signal 9", text, flags=re.S), run.report()


@pytest.mark.parametrize("backend,model", [("mpi", "small"), ("mpi", "big"),
                                           ("horovod", "small")])
def test_a_stopped_worker_is_named_when_the_collective_deadline_passes(backend, model):
    # small: Iallreduce polled on the caller's thread; big: Allreduce on the communication
    # thread, the caller waiting on an event.
    extra = ["big=1"] if model == "big" else []
    # Without heartbeats, which would have the state server name it first (next test).
    run, _ = run_fault("fail_worker_sigstop", "victim=1", "deadline=5", f"backend={backend}",
                       "heartbeat=0", *extra)
    text = all_output(run)
    # The live workers time out and name the silent one: worker 1 = world rank 2.
    assert "CollectiveTimeout" in text, run.report()
    assert "no word from worker 1 (world rank 2)" in text, run.report()


def test_a_stopped_worker_is_suspected_by_its_missing_heartbeats_before_any_deadline():
    # Beats every 0.5 s, suspected after max(3 s, 4 periods, 3 x its worst gap); the
    # collectives' deadline is 20 s: only the beats name it with "no heartbeat".
    run, _ = run_fault("fail_worker_sigstop", "victim=1", "deadline=20", "heartbeat=0.5")
    text = all_output(run)
    assert re.search(r"worker rank\(s\) \[2\] silent for more than [\d.]+s \(no heartbeat", text), \
        run.report()
    assert "CollectiveTimeout" not in text, run.report()


def test_a_worker_stopped_before_a_gather_is_named_at_the_deadline():
    # The metrics/checkpoint gather of mpsync train: a blocking comm.gather would wait forever.
    run, _ = run_fault("gather_with_a_stopped_worker", "victim=1", "deadline=5", "heartbeat=0")
    text = all_output(run)
    assert "CollectiveTimeout" in text, run.report()
    assert re.search(r"final metrics.*no word from worker 1 \(world rank 2\)", text), run.report()


def test_a_stopped_worker_ends_a_run_with_default_settings_within_30s():
    # No deadline or silent_timeout given: the defaults alone must end the job within 30 s.
    run, to_abort = run_fault("fail_worker_sigstop", "victim=1", "deadline=default")
    text = all_output(run)
    # Whichever fires first names world rank 2 (worker 1): the state server's silent-worker
    # check or the live workers' collective deadline.
    assert re.search(r"rank\(s\) \[2\] silent|no word from worker 1 \(world rank 2\)", text), \
        run.report()


@pytest.mark.parametrize("case", ["mismatch", "past", "silent"])
def test_a_collective_timeout_tells_a_mismatched_collective_from_a_silent_worker(case):
    """Every peer announced a wait: one past this collective, one in another of the same
    number, each is named with where it waits (workers that called different collectives
    hang as a lost message does).  Only one past it: named, and the two causes it may have.
    A silent peer is named alone."""
    run = run_mpi("torch_programs:peer_notices", np=3, args=[f"case={case}"], timeout=60)
    res = run.results()[0]
    if case == "silent":
        assert res["silent"] == [2], res
        assert res["message"].endswith("no word from worker 2 (world rank 2)"), res
        return
    if case == "past":
        assert res["silent"] == [], res
        assert res["message"].endswith(
            "worker 1 (world rank 1) is past it, waiting in mpi the PS shards' shutdown "
            "(collective #8); worker 2 (world rank 2) is past it, waiting in mpi the PS "
            "shards' shutdown (collective #8): a collective this worker called and the "
            "others did not, or its last message to this worker was lost"), res
        return
    assert res["silent"] == [], res
    assert res["message"] == (
        "mpi final push (collective #7) not complete after 30s deadline: worker 1 (world "
        "rank 1) is past it, waiting in mpi the PS shards' shutdown (collective #8); worker 2 "
        "(world rank 2) waits in mpi final model (collective #7) instead: the workers called "
        "different collectives"), res

