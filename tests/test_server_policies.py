"""The server's policy objects driven in one process by an exact, noise-free clock, and the
serve loop's request check against its readable reference.

The multi-rank tests in test_server.py run the same policies on a real machine, where each
interval the server measures carries scheduling noise; here the timestamps are exact, so an
algorithmic property (ElasticBSP with equal speeds is BSP-like) is checked on its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpsync.config import SyncConfig
from mpsync.server._policies import make_policy
from mpsync.server._wire import SYNC


def _drive_ebsp(intervals, offsets, rounds, lookahead=15):
    """Feed ElasticBSP the events of workers with fixed iteration times, the way the serve loop
    does (record_report, then on_step; on_reset after each aggregation).  Returns, per round,
    how many local iterations each worker ran before it was told SYNC."""
    n = len(intervals)
    policy = make_policy(SyncConfig(policy="ebsp", topology="ring", lookahead=lookahead), n)
    t = policy.t
    t.registered[:] = True
    t.last_event[:] = offsets
    clock = np.array(offsets, dtype=float)    # when each worker's current iteration started
    k = np.zeros(n, dtype=np.int64)
    ran = np.zeros(n, dtype=np.int64)
    per_round = []
    for rnd in range(rounds):
        synced = np.zeros(n, dtype=bool)
        guard = 0
        while not synced.all():
            guard += 1
            assert guard < 10_000, "a worker was never told to synchronize"
            # The worker whose iteration ends first reports next, as on a real server.
            w = int(np.argmin(np.where(synced, np.inf, clock + intervals)))
            now = clock[w] + intervals[w]
            k[w] += 1
            ran[w] += 1
            t.record_report(w, int(k[w]), intervals[w], now)
            decision = policy.on_step(w, int(k[w]), intervals[w], now)
            clock[w] = now
            if decision is not None and decision[0] == SYNC:
                synced[w] = True
            elif decision is None:
                pytest.fail(f"round {rnd}: worker {w} held outside a barrier")
        per_round.append(ran.copy())
        ran[:] = 0
        # The aggregation ends together everywhere; every worker resets at the same time.
        end = clock.max() + 0.001
        for w in range(n):
            policy.on_reset(w, rnd + 1, end)
        clock[:] = end
    return per_round, policy


def test_ebsp_with_exactly_equal_speeds_runs_the_same_iterations_everywhere():
    per_round, policy = _drive_ebsp([0.05, 0.05, 0.05], [0.0, 0.0004, 0.0011], rounds=12)
    for rnd, ran in enumerate(per_round):
        assert len(set(ran.tolist())) == 1, f"round {rnd}: {ran.tolist()}"
    # After the monitoring phase every barrier is the earliest one (§4.2 Thm. 1): one local
    # iteration per round, i.e. BSP.
    assert all(ran.tolist() == [1, 1, 1] for ran in per_round[1:])
    # The first plan (after the monitoring phase) may pick a later common index: with exactly
    # equal intervals every common index has the same d up to rounding.
    assert all(len(set(p["z"])) == 1 for p in policy.plans)
    assert all(p["z"] == [0, 0, 0] for p in policy.plans[1:])


def test_ebsp_with_a_4x_straggler_gives_the_fast_workers_about_4x_the_iterations():
    per_round, _ = _drive_ebsp([0.01, 0.01, 0.02, 0.04], [0.0] * 4, rounds=8)
    ran = np.sum(per_round[1:], axis=0)
    assert ran[0] == ran[1]
    assert 3.5 <= ran[0] / ran[3] <= 4.5 and 1.75 <= ran[2] / ran[3] <= 2.25, ran.tolist()


def test_the_fast_and_the_compiled_request_checks_accept_exactly_what_the_reference_accepts():
    from hypothesis import given, settings, strategies as st

    from mpsync.server._loop import _request_ok, _what_is_wrong

    special = st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, -1e-300, 2.0 ** 53 - 1, 2.0 ** 53,
                               2.0 ** 60, 1e300, float("nan"), float("inf"), float("-inf")])
    slot = st.one_of(special, st.floats(), st.integers(0, 100).map(float))

    from mpsync.server._fastpath import _request_ok as compiled_request_ok

    @settings(max_examples=3000, deadline=None, database=None)
    @given(st.lists(slot, min_size=8, max_size=8))
    def check(msg):
        ok = _what_is_wrong(msg) is None
        assert _request_ok(msg) == ok, (msg, _what_is_wrong(msg))
        assert compiled_request_ok(np.array(msg)) == ok, (msg, _what_is_wrong(msg))

    check()
    assert _request_ok([1.0, 2.0, 0.01, 0.0, 0.0, 0.0, 0.0, 1.0])
    assert _what_is_wrong([1.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]).startswith("iteration 2.5")
    assert _what_is_wrong([1.0, 2.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0]) == "negative time"


def test_next_report_due_is_the_earliest_computing_workers_last_event_plus_its_compute():
    from mpsync.server._loop import next_report_due
    from mpsync.server._policies import WorkerTable

    t = WorkerTable(4)
    in_sync, held = np.zeros(4, dtype=bool), np.zeros(4, dtype=bool)
    assert next_report_due(t, in_sync, held) is None          # nothing known yet
    t.last_event[:] = [10.0, 10.2, 10.1, 9.0]
    t.compute[:] = [0.5, 0.1, 0.0, 0.2]
    t.interval[:] = [0.6, 0.2, 0.7, np.nan]
    assert next_report_due(t, in_sync, held) == pytest.approx(9.2)   # worker 3
    t.done[3] = True
    assert next_report_due(t, in_sync, held) == pytest.approx(10.3)  # worker 1: 10.2 + 0.1
    in_sync[1] = True                                  # aggregating: its next message is a reset
    assert next_report_due(t, in_sync, held) == pytest.approx(10.5)  # worker 0
    held[0] = True                                     # waiting for the server
    assert next_report_due(t, in_sync, held) == pytest.approx(10.8)  # worker 2: no compute time
    t.removed[2] = True
    assert next_report_due(t, in_sync, held) is None


@pytest.mark.parametrize("env, options, expected", [
    ({}, {}, True),
    ({"MPSYNC_SERVER_WAKE_AHEAD": "0"}, {}, False),
    ({}, {"server_wake_ahead": False}, False),
    ({}, {"server": "colocated"}, False),   # polling would hold the trainer's GIL
])
def test_wake_ahead_follows_the_config_and_is_off_when_co_located(env, options, expected):
    from mpi4py import MPI

    from mpsync.server._loop import StateServer

    cfg = SyncConfig.from_options(env=env, **options)
    comm = MPI.COMM_SELF.Dup()
    try:
        assert StateServer(comm, cfg, workers=[0]).wake_ahead is expected
        assert StateServer(comm, cfg, workers=[0], wake_ahead=False).wake_ahead is False
    finally:
        comm.Free()


@pytest.mark.parametrize("policy", ["bsp", "asp", "ssp", "dssp", "ebsp", "esync", "osp"])
def test_the_compiled_path_runs_here_for_every_policy_and_follows_the_config(policy):
    """On this machine (Open MPI) the server's compiled path must be on by default, so the
    multi-rank tests exercise it; ``server_fast_path`` / MPSYNC_SERVER_FAST_PATH turn it off."""
    from mpi4py import MPI

    from mpsync.server import _fastpath
    from mpsync.server._loop import StateServer

    assert _fastpath.unavailable_reason() is None
    topology = "ps" if policy in ("asp", "ssp", "dssp") else "ring"
    comm = MPI.COMM_SELF.Dup()
    try:
        for env, options, on in (({}, {}, True), ({"MPSYNC_SERVER_FAST_PATH": "0"}, {}, False),
                                 ({}, {"server_fast_path": False}, False)):
            cfg = SyncConfig.from_options(env=env, policy=policy, topology=topology, **options)
            assert (StateServer(comm, cfg, workers=[0]).fast is not None) is on
        assert StateServer(comm, cfg, workers=[0], fast_path=True).fast is not None
    finally:
        comm.Free()
