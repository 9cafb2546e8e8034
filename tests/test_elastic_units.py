"""The pieces of restarts that need no MPI: reading Open MPI's last words, choosing the hosts
and worker count of the next start, the supervisor's loop over real processes, sealed files,
the background writer, and re-sharding a checkpoint over another number of workers."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from mpsync.apps.train_checkpoints import remap_position, reshard
from mpsync.commits import BackgroundWriter, SealedFileError, newest_complete, read_sealed, \
    write_sealed
from mpsync.launch.hosts import Placement
from mpsync.launch.runner import Job
from mpsync.launch.supervisor import Attempt, Failure, Host, SupervisorError, parse_hosts, \
    remaining_hosts, run_watched, supervise, worker_count

KILLED = """--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun noticed that process rank 2 with PID 4711 on node node3 exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""
EXITED = """--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[51603,1],1]
  Exit code:    3
--------------------------------------------------------------------------
"""
SILENT = ("mpsync: fault: collective 'allreduce' not complete after 20s deadline: no word "
          "from worker 1 (world rank 2)\nMPI_ABORT was invoked on rank 1 in communicator "
          "MPI_COMM_WORLD\n")


def _job(code: int, message: str = "") -> Job:
    """A real process that says what an Open MPI job's last words would and exits ``code``."""
    argv = [sys.executable, "-c", f"import sys; sys.stderr.write({message!r}); sys.exit({code})"]
    return Job(argv, Placement(4, (("node2", 2), ("node3", 2)), False, "on two nodes"))


def run_streaming(job: Job):
    return run_watched(job, stderr=open("/dev/null", "w"))


def test_how_a_job_ended_names_the_rank_host_and_cause():
    assert run_streaming(_job(137, KILLED)).failure == \
        Failure(2, "node3", "was killed by signal 9 (Killed)")
    assert run_streaming(_job(3, EXITED)).failure.rank == 1
    # A stopped worker: the rank that aborted only noticed; the silent one failed.
    box = "-" * 70 + "\n" + SILENT.split("\n", 1)[1] + "with errorcode 1.\n" + "-" * 70 + "\n"
    end = run_streaming(_job(1, SILENT.split("\n", 1)[0] + "\n" + box))
    assert (end.failure.rank, end.failure.host) == (2, "node3")
    assert "went silent" in end.failure.cause
    # A node cut off: mpirun loses its daemon there and names no rank.
    lost = ("mpsync cluster el: node3 (10.213.0.13) has not answered for 13 s (its link is cut "
            "or down): ending the session there\n")
    assert run_streaming(_job(3, lost)).failure == \
        Failure(None, "node3", "node lost (stopped answering)")
    assert remaining_hosts([Host("node2", 1), Host("node3", 1)],
                           Failure(None, "node3", "x")) == [Host("node2", 1)]
    assert run_streaming(_job(0)).failure is None


def test_remaining_hosts_drop_the_failed_host_or_slot():
    one = [Host("localhost", 4)]
    assert remaining_hosts(one, Failure(2, "localhost", "x")) == [Host("localhost", 3)]
    assert remaining_hosts([Host("localhost", 1)], Failure(0, None, "x")) == []
    many = [Host("a", 2), Host("b", 2), Host("c", 2)]
    assert remaining_hosts(many, Failure(3, "b", "x")) == [Host("a", 2), Host("c", 2)]
    # A rank without its host: the failed job's placement says where it ran.
    assert remaining_hosts(many, Failure(4, None, "x"), ["a", "a", "b", "b", "c", "c"]) == \
        [Host("a", 2), Host("b", 2)]
    assert remaining_hosts(many, Failure(None, None, "x")) == many


def test_worker_count_within_min_and_max():
    hosts = [Host("a", 3), Host("b", 2)]
    assert worker_count(hosts, min_np=1, max_np=8, extra_ranks=1) == 4
    assert worker_count(hosts, min_np=1, max_np=2, extra_ranks=1) == 2
    with pytest.raises(SupervisorError, match="only 4 worker slots remain.*--min-np is 5"):
        worker_count(hosts, min_np=5, max_np=8, extra_ranks=1)


def test_parse_hosts():
    assert parse_hosts("a:2,b\nc:4", default_slots=3) == [Host("a", 2), Host("b", 3),
                                                         Host("c", 4)]
    with pytest.raises(SupervisorError, match="slots must be an integer"):
        parse_hosts("a:x")
    with pytest.raises(SupervisorError, match=">= 1"):
        parse_hosts("a:0")


def test_supervise_restarts_on_the_slots_that_remain():
    codes = iter([137, 0])
    seen: list[Attempt] = []

    def run(attempt):
        seen.append(attempt)
        return run_streaming(_job(next(codes), KILLED.replace("node3", "localhost")))
    rc, attempts = supervise(run, [Host("localhost", 4)], min_np=1, max_np=3,
                             max_restarts=2, extra_ranks=1, log=lambda m: None)
    assert rc == 0
    assert [a.np for a in attempts] == [3, 2]
    assert attempts[0].failure == {"rank": 2, "host": "localhost",
                                   "cause": "was killed by signal 9 (Killed)"}
    assert attempts[1].failure is None and attempts[1].returncode == 0


def test_supervise_gives_up_when_restarts_or_workers_run_out():
    def failing(attempt):
        return run_streaming(_job(137, KILLED))
    rc, attempts = supervise(failing, [Host("localhost", 3)], min_np=1, max_np=3,
                             max_restarts=1, log=lambda m: None)
    assert rc == 137 and len(attempts) == 2
    rc, attempts = supervise(failing, [Host("localhost", 2)], min_np=2, max_np=2,
                             max_restarts=5, log=lambda m: None)
    assert rc == 137 and len(attempts) == 1   # one slot left, two needed
    # Bad input (exit 2) is never retried; the default of no restarts ends at the first fault.
    rc, attempts = supervise(lambda a: run_streaming(_job(2)), [Host("localhost", 3)],
                             min_np=1, max_np=3, max_restarts=5, log=lambda m: None)
    assert rc == 2 and len(attempts) == 1


def test_sealed_file_refuses_truncation_and_corruption(tmp_path):
    path = tmp_path / "x.pt"
    write_sealed(path, {"w": torch.arange(5)}, seq=3)
    assert torch.equal(read_sealed(path)["w"], torch.arange(5))
    data = path.read_bytes()
    path.write_bytes(data[:-2])
    with pytest.raises(SealedFileError, match="truncated"):
        read_sealed(path)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(SealedFileError, match="sha256 mismatch"):
        read_sealed(path)
    assert newest_complete(tmp_path) is None


def test_background_writer_supersedes_waiting_jobs_and_reports_errors():
    gate, started, done = threading.Event(), threading.Event(), []
    w = BackgroundWriter()
    w.submit(lambda: (started.set(), gate.wait(5), done.append(1)))
    assert started.wait(5)               # the first job is running, held at the gate
    w.submit(lambda: done.append(2))
    w.submit(lambda: done.append(3))     # replaces 2, which never started
    gate.set()
    assert w.wait(5)
    assert done == [1, 3] and w.superseded == 1
    w.submit(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="background commit write failed"):
        w.wait(5)
    w.close(1)


def test_reshard_keeps_the_samples_and_is_deterministic():
    per = [{"epoch": 1, "index": 6, "samples": 100 + i, "counters": {"rounds": 9}, "i": i}
           for i in range(3)]
    ckpt = {"per_worker": per, "workers": 3, "round": 9}
    two = reshard(ckpt, 2)
    assert two["workers"] == 2 and [w["i"] for w in two["per_worker"]] == [0, 1]
    assert sum(w["samples"] for w in two["per_worker"]) == sum(w["samples"] for w in per)
    assert two["per_worker"][1]["resharded_from"] == (3, 1)
    assert reshard(ckpt, 2) == two
    four = reshard(ckpt, 4)
    assert four["per_worker"][3]["i"] == 0 and four["per_worker"][3]["counters"] == {}
    assert reshard(ckpt, 3) is ckpt
    # Same fraction of the epoch on a longer shard; never past its end.
    assert remap_position(6, 12, 18) == 9
    assert remap_position(11, 12, 6) == 5
    assert remap_position(0, 0, 5) == 0


def test_allocation_hosts_of_pbs_and_outside(tmp_path):
    from mpsync.launch.supervisor import allocation_hosts

    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn1\nn2\nn2\nn2\n")
    assert allocation_hosts({"PBS_NODEFILE": str(nodefile)}) == [Host("n1", 2), Host("n2", 3)]
    assert allocation_hosts({}) is None


def test_a_job_asking_for_new_hosts_restarts_without_using_up_restarts():
    from mpsync.commits import RESTART_EXIT_CODE

    codes = iter([RESTART_EXIT_CODE, RESTART_EXIT_CODE, 0])
    listed = iter([[Host("a", 1)], [Host("a", 1), Host("b", 1)], [Host("a", 1), Host("b", 1)]])
    rc, attempts = supervise(lambda a: run_streaming(_job(next(codes))), [Host("a", 1)],
                             min_np=1, max_np=4, max_restarts=0, discover=lambda: next(listed),
                             log=lambda m: None)
    assert rc == 0 and [a.np for a in attempts] == [1, 1, 2]


def test_hosts_watcher_writes_a_new_version_when_a_host_appears(tmp_path):
    import json

    from mpsync.launch.elastic_run import HostsWatcher

    answers = iter([[Host("a", 2)], [Host("a", 2), Host("b", 2)]] + [[Host("a", 2)]] * 100)
    watcher = HostsWatcher(lambda: next(answers), tmp_path / "hosts.json", interval=0.05)
    assert watcher.started([{"name": "a", "slots": 2}]) == 0
    watcher.start()
    end = time.monotonic() + 10
    while json.loads((tmp_path / "hosts.json").read_text())["version"] < 1:
        assert time.monotonic() < end
        time.sleep(0.02)
    watcher.stop()
    assert json.loads((tmp_path / "hosts.json").read_text()) == {"version": 1,
                                                                "hosts": ["a:2", "b:2"]}


def test_a_rank_pruning_its_old_files_is_not_failed_by_rank_0_removing_whole_commits(tmp_path):
    # On a shared commit directory rank 0 removes old commits (rmtree) while another rank's
    # writer removes its own old files: the two meet, and the second must not fail (pathlib's
    # glob raised FileNotFoundError for a commit removed under it, failing that rank's commit
    # and ending an hvd.elastic job).
    import shutil  # noqa: PLC0415
    from mpsync.commits import prune_rank_files  # noqa: PLC0415
    stop, errors = threading.Event(), []

    def churn():   # rank 0: commits appear and are removed
        seq = 0
        while not stop.is_set():
            d = tmp_path / f"commit-{seq:09d}"
            d.mkdir()
            (d / "rank-00001.pt").write_bytes(b"x")
            shutil.rmtree(tmp_path / f"commit-{seq - 3:09d}", ignore_errors=True)
            seq += 1
    thread = threading.Thread(target=churn)
    thread.start()
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            try:
                prune_rank_files(tmp_path, 1, horizon=10**9)
            except OSError as e:
                errors.append(e)
                break
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    prune_rank_files(tmp_path, 1, horizon=10**9)
    assert not list(tmp_path.glob("commit-*/rank-00001.pt"))
    prune_rank_files(tmp_path / "absent", 1, horizon=5)   # no directory at all: nothing to do
