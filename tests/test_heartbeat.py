"""Heartbeats (mpsync.server.heartbeat): the suspicion rule, the beating thread, and a slow
but live job in which no one is suspected.  A stopped worker named by its missing beats is in
test_failures.py (the ring) and test_rank_errors.py (the parameter server)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpi_harness import run_mpi
from mpsync.server import wire as W
from mpsync.server.heartbeat import Heartbeat, suspect_bound, suspects

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "mpsync" / "apps" / "train.py")


def test_the_bound_is_four_periods_or_three_worst_gaps_with_a_floor():
    assert suspect_bound(0.5, 3.0) == 3.0
    assert suspect_bound(2.0, 3.0) == 8.0
    assert list(suspect_bound(np.array([0.1, 1.0]), 1.0)) == [1.0, 4.0]
    # A worker whose beats once came 2 s apart gets 6 s; one whose came 0.6 s apart, the floor.
    assert list(suspect_bound(np.array([0.5, 0.5]), 3.0, np.array([2.0, 0.6]))) == [6.0, 3.0]


def test_only_active_beating_workers_past_their_bound_are_suspected():
    now = 100.0
    last = np.array([99.0, 96.0, 96.0, 96.0, 50.0])
    period = np.array([0.5, 0.5, 0.0, 0.5, 2.0])   # worker 2 never beat
    active = np.array([True, True, True, False, True])
    # 0: 1 s late (bound 3); 1: 4 s late; 2: no beats; 3: taken out already; 4: 50 s (bound 8)
    assert list(suspects(now, last, period, 3.0, active)) == [1, 4]
    assert suspects(now, last, period, 60.0, active).size == 0
    # Worker 1 showed a 1.5 s gap once: 4 s of silence is within its 4.5 s bound.
    gaps = np.array([0.5, 1.5, 0.0, 0.0, 0.0])
    assert list(suspects(now, last, period, 3.0, active, gaps)) == [4]


def test_the_thread_beats_every_period_until_stopped():
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    try:
        beat = Heartbeat(comm, 0, 0.05, W.BEAT, shard=3)
        got, buf, end = [], np.zeros(2), time.monotonic() + 0.5
        while time.monotonic() < end:
            if comm.Iprobe(source=0, tag=W.BEAT):
                comm.Recv([buf, MPI.DOUBLE], source=0, tag=W.BEAT)
                got.append((float(buf[0]), int(buf[1])))
            else:
                time.sleep(0.002)
        beat.stop()
        assert not beat.running and beat.error is None
        assert 5 <= len(got) <= 12, len(got)
        assert set(got) == {(0.05, 3)}
        while comm.Iprobe(source=0, tag=W.BEAT):   # the beats sent before the stop
            comm.Recv([buf, MPI.DOUBLE], source=0, tag=W.BEAT)
        time.sleep(0.2)
        assert not comm.Iprobe(source=0, tag=W.BEAT), "a beat after stop()"
        assert beat.sent >= len(got)
    finally:
        comm.Free()


@pytest.mark.mpi
def test_a_stopped_worker_that_hosts_a_ps_shard_ends_the_job_named_by_its_beats():
    # SSP on the PS, one host: the shards live on workers 0 and 1.  Worker 1 (world rank 2)
    # stops: the others' pushes and pulls cannot complete without shard 1, so its missing beats
    # end the job (before, they waited for the 20 s deadline, or a --deadline of 60 s).
    start = time.time()
    run = run_mpi(str(REPO / "tests" / "torch_programs.py"), np=4, timeout=90, check=False,
                  args=["fail_worker_sigstop", "victim=1", "deadline=20", "policy=ssp",
                        "topology=ps"])
    text = run.stderr + run.stdout + "".join(
        o.get("stderr", "") + o.get("stdout", "") for o in run.ranks.values())
    assert run.returncode not in (0, None) and not run.timed_out, run.report()
    assert re.search(r"worker rank\(s\) \[2\] silent for more than [\d.]+s \(no heartbeat.*they "
                     r"host PS shard\(s\) \[1\]", text), run.report()
    assert "DeadlineExceeded" not in text, run.report()
    print(f"\njob ended {start + run.elapsed - _fault_time(text):.1f} s after the stop")


def _fault_time(text: str) -> float:
    return float(re.search(r"^FAULT (\S+)$", text, flags=re.M).group(1))


@pytest.mark.mpi
@pytest.mark.slow
def test_a_straggler_job_with_evaluations_and_checkpoints_suspects_no_one(tmp_path):
    # Slow is not dead: workers at 1x, 1x, 2x and 4x the iteration time, worker 0 evaluating
    # every second and a checkpoint every 5 rounds; the beats keep every worker in, on the ring
    # (where a suspicion ends the job) as on the PS (where it takes the worker out).
    for policy, topology in (("bsp", "ring"), ("ssp", "ps")):
        out = tmp_path / policy
        run = run_mpi(TRAIN, np=5, timeout=240, check=False, args=[
            "--policy", policy, "--topology", topology, "--time-budget", "10",
            "--slowdown", "1,1,2,4", "--iter-time", "0.05", "--eval-every", "1",
            "--checkpoint-every", "5", "--out", str(out), "--no-progress", "--no-plots"])
        assert run.ok, run.report()
        text = run.stderr + "".join(r.get("stderr", "") for r in run.ranks.values())
        assert "silent for more than" not in text, run.report()
        m = json.loads((out / "metrics.json").read_text())
        server = m["server"]
        assert server["beats"] > 0, server
        for w in server["workers"].values():
            assert w["beat_period_s"] == 0.5 and not w["removed"], server["workers"]
        assert not [e for e in server["events"] if "removed" in json.dumps(e)], server["events"]
        assert len(m["evals"]) >= 3, m["evals"]
        assert (out / "checkpoints").is_dir(), sorted(p.name for p in out.iterdir())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
