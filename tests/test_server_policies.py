"""The server's policy objects driven in one process by an exact, noise-free clock, and the
server's switches (wake-ahead, the compiled path).

The multi-rank tests in test_server.py run the same policies on a real machine, where each
interval the server measures carries scheduling noise; here the timestamps are exact, so an
algorithmic property (ElasticBSP with equal speeds is BSP-like) is checked on its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpsync.config import SyncConfig
from mpsync.server import make_policy
from mpsync.server.wire import SYNC


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


@pytest.mark.parametrize("env, options, expected", [
    ({}, {}, True),
    ({"MPSYNC_SERVER_WAKE_AHEAD": "0"}, {}, False),
    ({}, {"server_wake_ahead": False}, False),
    ({}, {"server": "colocated"}, False),   # polling would hold the trainer's GIL
])
def test_wake_ahead_follows_the_config_and_is_off_when_co_located(env, options, expected):
    from mpi4py import MPI

    from mpsync.server import StateServer

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

    from mpsync.server import StateServer, compiled_path_unavailable

    assert compiled_path_unavailable() is None
    topology = "ps" if policy in ("asp", "ssp", "dssp") else "ring"
    comm = MPI.COMM_SELF.Dup()
    try:
        for env, options, on in (({}, {}, True), ({"MPSYNC_SERVER_FAST_PATH": "0"}, {}, False),
                                 ({}, {"server_fast_path": False}, False)):
            cfg = SyncConfig.from_options(env=env, policy=policy, topology=topology, **options)
            assert StateServer(comm, cfg, workers=[0]).view().fast_path is on
        assert StateServer(comm, cfg, workers=[0], fast_path=True).view().fast_path
    finally:
        comm.Free()
