"""mpsync starting its own mpirun: where the ranks go (pure), the argv, and the outcome of a
job read from Open MPI's own notices."""

from __future__ import annotations

import io
import signal

import pytest

from mpsync.launch.hosts import launched_rank, parse_hosts, placement_of, read_hostfile
from mpsync.launch.runner import JobOutcome, OutputFilter, build_job, mpsync_roles
from mpsync.launch.target import LaunchError

NO_SCHEDULER: dict = {}


def test_one_host_with_fewer_cores_than_ranks_is_oversubscribed():
    p = placement_of(4, 1, cores=2, environ=NO_SCHEDULER)
    assert (p.ranks, p.oversubscribe, p.host_argv()) == (5, True, [])
    assert not placement_of(3, 1, cores=8, environ=NO_SCHEDULER).oversubscribe


def test_hosts_as_horovodrun_takes_them_and_the_server_gets_a_slot_of_its_own():
    p = placement_of(4, 1, hosts="n1:2,n2:2", environ=NO_SCHEDULER)
    assert p.host_argv() == ["--host", "n1:3,n2:2"] and not p.oversubscribe
    assert [p.host_of(r) for r in range(5)] == ["n1", "n1", "n1", "n2", "n2"]
    assert parse_hosts("a,b:3") == (("a", 1), ("b", 3))


def test_hostfile_formats(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# two nodes\nnode1 slots=4\n\nnode2:2  # comment\nnode3\n")
    assert read_hostfile(str(f)) == (("node1", 4), ("node2", 2), ("node3", 1))


@pytest.mark.parametrize("kw, msg", [
    ({"hosts": "n1:2,n2:2", "workers": 5}, "more workers than the 4 slots"),
    ({"hosts": "n1:0"}, "SLOTS >= 1"),
    ({"hosts": "n1:x"}, "HOST:SLOTS"),
    ({"hosts": "a", "hostfile": "f"}, "not both"),
    ({"hostfile": "/no/such/hostfile"}, "cannot read it"),
    ({"workers": 0}, "--np must be >= 1"),
])
def test_impossible_placements_are_named(kw, msg):
    workers = kw.pop("workers", 2)
    with pytest.raises(LaunchError, match=msg):
        placement_of(workers, 1, environ=NO_SCHEDULER, **kw)


def test_slurm_allocation_is_left_to_mpirun_oversubscribed_only_beyond_its_tasks():
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}
    p = placement_of(4, 1, environ=env)
    assert p.host_argv() == [] and p.oversubscribe and "slurm" in p.where
    assert not placement_of(3, 1, environ=env).oversubscribe


@pytest.mark.parametrize("env, expected", [
    ({}, False), ({"OMPI_COMM_WORLD_SIZE": "4"}, True), ({"PMIX_RANK": "0"}, True),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, False),          # an sbatch script
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "5"}, True),   # srun -n 5
    # the environment a child inherits from a process that ran MPI_Init alone (a singleton)
    ({"OMPI_MCA_ess": "singleton", "PMIX_RANK": "0"}, False),
])
def test_a_process_knows_whether_it_is_already_a_rank(env, expected):
    assert launched_rank(env) is expected


def test_the_job_argv_as_root_on_a_small_host():
    job = build_job(["python", "t.py"], 4, cores=2, environ={"PATH": "/bin",
                                                            "MPSYNC_POLICY": "ssp"},
                    allow_run_as_root=True, mpirun_args=["--mca", "btl", "self,vader"])
    assert job.argv == ["mpirun", "-np", "5", "--bind-to", "none", "--mca",
                        "mpi_yield_when_idle", "1", "--allow-run-as-root", "--oversubscribe",
                        "-x", "PATH", "-x", "MPSYNC_POLICY", "--mca", "btl", "self,vader",
                        "python", "t.py"]
    assert [job.role(r) for r in range(3)] == ["state server", "worker 0", "worker 1"]
    assert mpsync_roles(False)(0) == "worker 0 and state server"


# Open MPI 4.1's notices, as mpirun prints them.
SIGKILL_NOTICE = """\
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun noticed that process rank 3 with PID 0 on node node2 exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""
EXIT_NOTICE = """\
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[29044,1],1]
  Exit code:    2
--------------------------------------------------------------------------
"""


def _filtered(text: str, keep_all=False, chunk=7):
    sink = io.StringIO()
    f = OutputFilter(sink, keep_all=keep_all)
    for i in range(0, len(text), chunk):   # as a pipe delivers it: in arbitrary pieces
        f.feed(text[i:i + chunk])
    f.close()
    return sink.getvalue(), f


def test_open_mpi_notices_are_read_and_held_back_but_user_output_passes():
    user = "epoch 1 loss 0.3\n 40%|####      | 4/10\r 50%|#####     | 5/10\r"
    out, f = _filtered(user + SIGKILL_NOTICE + "[host:123] 3 more processes have sent help "
                       "message help-mpi-api.txt / mpi-abort\n")
    assert out == user and len(f.notices) == 2 and not f.reported
    job = build_job(["x"], 4, hosts="node1:2,node2:2", environ={})
    outcome = JobOutcome(137, 3.0)
    from mpsync.launch.runner import _read_notices  # noqa: PLC0415 - the parser alone
    _read_notices(outcome, f.notices, job)
    assert (outcome.rank, outcome.host, outcome.signal) == (3, "node2", signal.SIGKILL)
    block = outcome.block("mpsync train")
    assert block.startswith("mpsync train: the job failed: rank 3 (worker 2) on node2 was "
                            "killed by signal 9 (Killed)")
    assert "exit status 137" in block and block.count("\n") == 3


def test_debug_keeps_every_line_and_a_ranks_own_report_is_noted():
    out, _ = _filtered(SIGKILL_NOTICE, keep_all=True)
    assert out == SIGKILL_NOTICE
    _, f = _filtered("MPSYNC-RANK-FAILED rank 2 (worker 1) on h: unhandled X\n" + EXIT_NOTICE)
    assert f.reported


def test_a_job_whose_ranks_refused_their_settings_adds_nothing_to_their_line():
    _, f = _filtered(EXIT_NOTICE)
    outcome = JobOutcome(2, 1.0)
    from mpsync.launch.runner import _read_notices  # noqa: PLC0415
    _read_notices(outcome, f.notices, build_job(["x"], 2, cores=4, environ={}))
    assert outcome.rank == 1 and outcome.block() == "" and outcome.exit_code == 2


def _outcome_of(text: str, job):
    from mpsync.launch.runner import _read_faults  # noqa: PLC0415 - the parser alone
    _, f = _filtered(text)
    outcome = JobOutcome(1, 9.0)
    from mpsync.launch.runner import _read_notices  # noqa: PLC0415
    _read_notices(outcome, f.notices, job)
    _read_faults(outcome, f.faults, job)
    return outcome


ABORT_NOTICE = """\
--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 1 in communicator MPI COMMUNICATOR 3 DUP FROM 0
with errorcode 1.

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
--------------------------------------------------------------------------
"""


@pytest.mark.parametrize("text, rank, reason", [
    # a collective's deadline on the worker that waited names the one it waited for
    ("mpsync: fault: rank 1 (worker 0) on n1: CollectiveTimeout: allreduce.stop not complete after 20s deadline: "
     "no word from worker 1 (world rank 2)\n",
     2, "went silent: the other workers waited for it in allreduce.stop past the 20 s deadline"),
    # the stall warning names it before the state server aborts the ring
    ("mpsync: one or more collectives were submitted by a subset of the workers and have "
     "waited for the others for more than 10s (they fail at the 20s deadline). Missing "
     "workers:\n  worker 1: ['stop check']\nmpsync server: worker rank(s) [1, 2] silent for "
     "more than 10s; the ring cannot continue without them: aborting the job\n",
     2, "went silent: the other workers waited for it in stop check"),
    # on the PS a worker's push names the shard that stopped answering: a rank of its own
    ("mpsync server: worker rank(s) [1, 2] silent for more than 5s; taken out of the ssp "
     "decisions (ZipLine paper §4), the others continue\nmpsync: fault: rank 1 (worker 0) on "
     "n1: DeadlineExceeded: no answer from PS shard 1 (world rank 2 on n2) to push within the "
     "45s deadline\n", 2, "went silent: worker 0 had no answer from it (PS shard 1) to push"),
    ("mpsync server: worker rank(s) [2] silent for more than 10s; the ring cannot continue "
     "without them: aborting the job\n", 2, "went silent: the state server heard nothing"),
    ("mpsync: fault: rank 1 (worker 0) on n1: DeadlineExceeded: no reply from the state server (rank 0) to step "
     "within the 20s deadline\n", 0, "went silent: worker 0 had no reply from it to step"),
])
def test_a_silent_rank_is_named_not_the_one_that_gave_up_waiting(text, rank, reason):
    job = build_job(["x"], 2, hosts="n1:1,n2:1", environ={})
    outcome = _outcome_of(text + ABORT_NOTICE, job)
    assert (outcome.rank, outcome.silent) == (rank, True) and outcome.reason.startswith(reason)
    assert outcome.host == ("n1" if rank < 2 else "n2")
    block = outcome.block("mpsync train")
    assert block.startswith(f"mpsync train: the job failed: rank {rank} ({job.role(rank)}) on "
                            f"{outcome.host} went silent")


def test_without_a_silent_worker_the_rank_that_aborted_is_named():
    outcome = _outcome_of("MPSYNC-RANK-FAILED rank 1 (worker 0) on n1: unhandled KeyError\n"
                          + ABORT_NOTICE, build_job(["x"], 2, cores=8, environ={}))
    assert (outcome.rank, outcome.reason, outcome.silent) == (
        1, "aborted the job (MPI_Abort, error code 1)", False)


def _job_printing(text: str, then_sleep: float, status: int = 0, hosts="n1:1,n2:1"):
    import dataclasses  # noqa: PLC0415
    import sys  # noqa: PLC0415
    script = (f"import sys, time; sys.stderr.write({text!r}); sys.stderr.flush(); "
              f"time.sleep({then_sleep}); sys.exit({status})")
    job = build_job(["x"], 2, hosts=hosts, cores=8, environ={})
    return dataclasses.replace(job, argv=[sys.executable, "-c", script])


def test_a_job_mpsync_is_ending_is_stopped_when_mpirun_waits_for_a_lost_node():
    """After the state server named a lost worker and aborted, mpirun may wait for the lost
    node's daemon; the launcher stops it within its grace (a job that stands for such an
    mpirun: it says the line, then sleeps 60 s)."""
    import time  # noqa: PLC0415
    from mpsync.launch.runner import ABORT_GRACE_S, run_job  # noqa: PLC0415
    line = ("mpsync server: worker rank(s) [2] silent for more than 3s (no heartbeat: its "
            "process stopped, its node down or its link cut); the ring cannot continue "
            "without them: aborting the job\n")
    sink = io.StringIO()
    t0 = time.monotonic()
    outcome = run_job(_job_printing(line, 60), stderr=sink, timeout=30)
    took = time.monotonic() - t0
    assert not outcome.timed_out and took < ABORT_GRACE_S + 10, (took, sink.getvalue())
    assert (outcome.exit_code, outcome.rank, outcome.host, outcome.silent) == (1, 2, "n2", True)
    assert "rank 2 (worker 1) on n2 went silent" in sink.getvalue()
    # On this host alone there is no daemon to wait for: mpirun is left to end the job itself.
    t0 = time.monotonic()
    outcome = run_job(_job_printing(line, ABORT_GRACE_S + 1.5, status=3, hosts=None),
                      stderr=io.StringIO(), timeout=30)
    assert outcome.exit_code == 3 and time.monotonic() - t0 >= ABORT_GRACE_S + 1.5


def test_a_worker_taken_out_is_not_the_job_ending():
    """The PS goes on without a silent worker: that line stops nothing."""
    from mpsync.launch.runner import ABORT_GRACE_S, run_job  # noqa: PLC0415
    line = ("mpsync server: worker rank(s) [2] silent for more than 5s; taken out of the ssp "
            "decisions (ZipLine paper §4), the others continue\n")
    outcome = run_job(_job_printing(line, ABORT_GRACE_S + 1.5), stderr=io.StringIO(),
                      timeout=30)
    assert outcome.ok and outcome.returncode == 0


def test_a_job_ended_for_new_hosts_is_not_reported_as_failed():
    from mpsync.commits import HOSTS_CHANGED, RESTART_EXIT_CODE  # noqa: PLC0415
    _, f = _filtered(f"{HOSTS_CHANGED}: ending this job to start again on them\n" + EXIT_NOTICE)
    outcome = JobOutcome(RESTART_EXIT_CODE, 5.0, restart_asked=f.restart_asked)
    assert f.restart_asked and outcome.block() == "" and outcome.exit_code == RESTART_EXIT_CODE
    # the same status without worker 0's line is a script's own exit: reported
    assert "the job failed" in JobOutcome(RESTART_EXIT_CODE, 5.0).block()


def test_sigterm_to_the_launcher_stops_the_job_as_an_interrupt():
    """A scheduler ending our step (SIGTERM to the launcher) stops the job's ranks: the
    outcome is an interrupt, exit status 130, well before the job's own end."""
    import os  # noqa: PLC0415
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415
    from mpsync.launch.runner import run_job  # noqa: PLC0415
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    t0 = time.monotonic()
    timer.start()
    try:
        outcome = run_job(_job_printing("training\n", 60), stderr=io.StringIO(), timeout=30)
    finally:
        timer.cancel()
    assert outcome.interrupted and outcome.exit_code == 130, outcome
    assert time.monotonic() - t0 < 20
