"""The progress engine: every wait on a collective in flight goes through
:mod:`mpsync.torch.dataplane.progress`, which keeps the transfer moving and never sleeps
while it is in flight (Open MPI moves a non-blocking collective's bytes only while the rank
is inside MPI; a large one runs blocking on a lane thread while the waiter blocks on its
event)."""

from __future__ import annotations


import pytest

from mpi_harness import run_mpi
from mpsync.torch.dataplane.progress import Flight, ProgressEngine
from mpsync.torch.dataplane.waiting import CollectiveTimeout


def test_waiters_never_sleep_while_their_collective_is_in_flight():
    run = run_mpi("progress_programs:main", np=2, timeout=180)
    out = run.stdout + "".join(r.get("stdout", "") for r in run.ranks.values())
    for part in ("script_16MB", "script_64KB", "optimizer_step", "optimizer_joined"):
        for r in (0, 1):
            assert f"PART-OK {part} rank={r}" in out, (part, r, out[-3000:])


def test_a_workers_waits_on_its_parameter_server_shards_never_sleep():
    # 1 state server + 2 workers, each hosting a shard of a 16.8 MB model.
    run = run_mpi("progress_programs:ps_main", np=3, timeout=180)
    out = run.stdout + "".join(r.get("stdout", "") for r in run.ranks.values())
    for r in (0, 1):
        assert f"PART-OK ps_push_pull rank={r}" in out, (r, out[-3000:])


def test_a_lane_runs_calls_in_order_and_hands_back_their_errors():
    eng = ProgressEngine(thread_min_bytes=1)

    class Comm:  # only its handle keys the lane; the calls below never touch MPI
        def py2f(self):
            return 12345

    seen = []
    first = eng.run_on_lane(Comm(), lambda: seen.append(1))
    second = eng.run_on_lane(Comm(), lambda: (seen.append(2), 1 / 0))
    eng.wait(second.event.is_set, deadline=5, what="lane", event=second.event)
    assert seen == [1, 2] and first.test()
    with pytest.raises(ZeroDivisionError):
        second.test()
    assert eng.counts["sleeps"] == 0 and eng.counts["lane_calls"] == 2


def test_a_wait_past_its_deadline_raises_collective_timeout_and_blocks_meanwhile():
    eng = ProgressEngine()
    flight = Flight()  # a lane call that never returns
    with pytest.raises(CollectiveTimeout, match="stuck .* 0.2s deadline"):
        eng.wait(flight.test, deadline=0.2, what="stuck", event=flight.event)
    # The waiter blocked on the event: a handful of wake-ups, not a spin.
    assert eng.counts["event_waits"] <= 3 and eng.counts["spins"] == 0


def test_a_long_wait_beats_the_heartbeat_on_the_thread_that_set_it_only():
    import threading
    import time

    eng = ProgressEngine()
    eng.beat_every = 0.05
    beats: list[str] = []
    eng.set_heartbeat(lambda: beats.append(threading.current_thread().name))
    done = threading.Event()
    threading.Timer(0.3, done.set).start()
    eng.wait(done.is_set, deadline=5, what="event wait", event=done)
    assert 3 <= len(beats) <= 7, beats
    # A busy-polled wait beats too; a wait shorter than beat_every does not.
    end = time.monotonic() + 0.2
    eng.wait(lambda: time.monotonic() > end, deadline=5, what="spin wait")
    assert len(beats) >= 5
    n = len(beats)
    eng.wait(lambda: True, deadline=5, what="instant")
    # Another thread's waits never call it (the callee is the worker's own client).
    other = threading.Thread(target=lambda: eng.wait(
        lambda: time.monotonic() > end + 0.3, deadline=5, what="other thread"))
    other.start()
    other.join()
    assert len(beats) == n and set(beats) == {threading.current_thread().name}
    eng.set_heartbeat(None)
    end = time.monotonic() + 0.2
    eng.wait(lambda: time.monotonic() > end, deadline=5, what="no heartbeat")
    assert len(beats) == n
