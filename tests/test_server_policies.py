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
from mpsync.server.policies import pull_sure_within
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
    # Every superstep: the monitoring phase (two reports each, Fig. 5), then the earliest
    # barrier (§4.2 Thm. 1: z = 0), one iteration later: three iterations per superstep.
    assert all(ran.tolist() == [3, 3, 3] for ran in per_round[1:])
    # The first plan may pick a later common index: with exactly equal intervals every common
    # index has the same d up to rounding.
    assert len(policy.plans) == 12
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


# -- the papers' worked scenarios, by hand ---------------------------------------------------------

class _PsClock:
    """Drives a PS policy the way the serve loop does, on an exact clock: a worker's step is
    record_report + on_step (+ record_answer's in_sync on SYNC), then its push (on_push) and
    its pull (may_pull; a held pull is retried after every event), then, after a barrier,
    its reset."""

    def __init__(self, policy_name, n, **config):
        from mpsync.server import rules

        self.rules = rules
        self.policy = make_policy(SyncConfig(policy=policy_name, topology="ps", **config), n)
        self.t = self.policy.t
        self.t.registered[:] = True


def test_ebsp_ps_superstep_pushes_every_iteration_and_holds_the_barrier_pull_at_zipline_z():
    """ZipLine §3, Fig. 5, §6.2.5 on two workers, 1.0 s and 2.4 s per iteration, both starting
    at t = 0.  Monitoring: worker 1's second report (t = 4.8) completes it; worker 0 has
    reported 4 times (t = 1..4).  Prediction from the latest reports: worker 0 at 4 + j,
    worker 1 at 4.8 + 2.4 j; the only exact meeting within R = 15 is t = 12 (worker 0's
    iteration 12, z = 7; worker 1's iteration 5, z = 2): the barrier.  Worker 0 pushes 12 times
    (ASP: its pulls answered at once), its barrier pull waits for worker 1's barrier push."""
    from mpsync.server.wire import LOCAL

    c = _PsClock("ebsp", 2, lookahead=15)
    p, t = c.policy, c.t
    t.last_event[:] = 0.0
    interval = [1.0, 2.4]
    k = [0, 0]
    pushes = [0, 0]
    held = []
    events = sorted([(round(j * interval[w], 9), w) for w in (0, 1) for j in range(1, 14)])
    synced_at = {}
    for now, w in events:
        if w in synced_at:
            continue
        k[w] += 1
        t.record_report(w, k[w], interval[w], now)
        action, local, _ = p.on_step(w, k[w], interval[w], now)
        if action == SYNC:
            t.in_sync[w] = True
        p.on_push(w, now)
        pushes[w] += 1
        if action == SYNC:
            synced_at[w] = (k[w], now)
            assert not p.may_pull(w) or len(synced_at) == 2
            held.append(w)
        else:
            assert action == LOCAL and p.may_pull(w), (w, k[w])   # ASP within the superstep
        if len(synced_at) == 2:
            break
    plan = p.plans[0]
    assert plan["base_iteration"] == [4, 2] and plan["z"] == [7, 2]
    assert plan["target_iteration"] == [12, 5] and plan["last_push"] == [4.0, 4.8]
    assert synced_at == {0: (12, 12.0), 1: (5, 12.0)}
    assert pushes == [12, 5]
    assert all(p.may_pull(w) for w in (0, 1))            # every barrier push is in
    for w in (0, 1):
        c.rules.record_reset(t.cells, w, 1, 12.1)
        p.on_reset(w, 1, 12.1)
    got = p.superstep_metrics()[0]
    assert got["barrier_iteration"] == {"0": 12, "1": 5} and got["pushes"] == {"0": 12, "1": 5}


def test_ebsp_runs_the_monitoring_phase_after_every_barrier_and_learns_a_new_speed():
    """Fig. 5's lower half: after a barrier no barrier is planned until every worker has
    reported twice more; a worker that changed speed during monitoring is predicted with its
    new interval."""
    from mpsync.server.wire import LOCAL

    policy = make_policy(SyncConfig(policy="ebsp", topology="ring", lookahead=8), 2)
    t = policy.t
    t.registered[:] = True
    t.last_event[:] = 0.0
    # Superstep 0 with equal speeds (1 s): monitoring ends at t = 2, barrier at iteration 3.
    for now in (1.0, 2.0, 3.0):
        for w in (0, 1):
            t.record_report(w, int(now), 1.0, now)
            action = policy.on_step(w, int(now), 1.0, now)[0]
    assert action == SYNC and policy.plans[0]["target_iteration"] == [3, 3]
    for w in (0, 1):
        policy.on_reset(w, 1, 3.0)
    assert policy.target.tolist() == [-1, -1] and policy.reports.tolist() == [0, 0]
    # Worker 1 now takes 0.5 s: its two monitoring reports arrive at 3.5 and 4.0; worker 0's
    # first one at 4.0: still monitoring, so no plan and LOCAL without a count-down.
    t.record_report(1, 4, 0.5, 3.5)
    assert policy.on_step(1, 4, 0.5, 3.5) == (LOCAL, 0, 0)
    t.record_report(1, 5, 0.5, 4.0)
    assert policy.on_step(1, 5, 0.5, 4.0) == (LOCAL, 0, 0)
    t.record_report(0, 4, 1.0, 4.0)
    assert policy.on_step(0, 4, 1.0, 4.0) == (LOCAL, 0, 0) and len(policy.plans) == 1
    t.record_report(0, 5, 1.0, 5.0)
    policy.on_step(0, 5, 1.0, 5.0)
    # Second plan at t = 5 (worker 0's second report); worker 1 last reported at 4.0 (it is
    # computing iteration 6, due at 4.5, then 5.0, ...): predicted with 0.5 s.
    plan = policy.plans[1]
    assert plan["interval"] == [1.0, 0.5] and plan["last_push"] == [5.0, 4.0]
    assert plan["monitor_reports"] == [2, 2]
    # Worker 1's predictions 4.5, 5.0, ..., worker 0's 6, 7, ...: the first exact meeting is
    # at t = 6 (worker 0 z = 0, worker 1 z = 3).
    assert plan["z"] == [0, 3] and plan["target_iteration"] == [6, 9]


def test_ebsp_plans_a_straggler_by_its_iterations_not_by_its_idle_steps():
    """A worker waiting in a collective of the script's own steps idly every 1-50 ms and
    reports its usual compute time each step (``Strategy.idle_step``).  ZipLine must still
    predict it at its iteration time: a 0.4 s worker whose idle steps came 55 ms apart was
    planned 13 more iterations (5 s of waiting for the others) in a 100 Mbit/s run."""
    policy = make_policy(SyncConfig(policy="ebsp", topology="ring", lookahead=15), 2)
    t = policy.t
    t.registered[:] = True
    t.last_event[:] = 0.0
    # Worker 0 steps every 0.1 s; worker 1 finishes one 0.4 s iteration, then idles twice
    # (55 ms apart, reporting its 0.4 s), which ends its monitoring phase.
    events = [(0, 1, 0.1, 0.1), (0, 2, 0.1, 0.2), (0, 3, 0.1, 0.3), (0, 4, 0.1, 0.4),
              (1, 1, 0.4, 0.4), (1, 2, 0.4, 0.455), (1, 3, 0.4, 0.51)]
    for w, k, compute, now in events:
        t.record_report(w, k, compute, now)
        policy.on_step(w, k, compute, now)
    plan = policy.plans[0]
    assert plan["interval"] == pytest.approx([0.1, 0.4])
    # Worker 1 next pushes at 0.91, 1.31, ...; worker 0 at 0.5, 0.6, ...: the barrier comes
    # at worker 1's next iteration or the one after, not 13 iterations (5 s) later.
    assert plan["z"][1] <= 1, plan
    assert plan["target_iteration"][1] <= 5, plan


def test_esync_on_the_ps_holds_every_pull_until_every_delta_of_the_round_is_in():
    """ESync Alg. 1 lines 17-22 on the PS: w_{t+1} is read only when every Δ of round t is in."""
    c = _PsClock("esync", 3)
    p, t = c.policy, c.t
    p.on_push(0, 1.0)
    assert not p.may_pull(0)
    p.on_push(2, 1.1)
    assert not p.may_pull(0) and not p.may_pull(2)
    p.on_push(1, 1.5)
    assert all(p.may_pull(w) for w in range(3))
    # A worker that sent its last push does not hold the others.
    p.on_push(0, 2.0)
    t.final_pushed[1] = True
    assert not p.may_pull(0)
    p.on_push(2, 2.1)
    assert p.may_pull(0)


def _osp(n=2, **config):
    return make_policy(SyncConfig(policy="osp", topology="ring", **config), n)


def test_osp_ics_is_zero_in_epoch_1_and_follows_alg_1_with_the_loss():
    """Alg. 1: S(G^u) = 0 in epoch 1 (L = its mean loss, here 2.0); in epoch i,
    (1 - loss_i / L)·U_max.  Four layers of 10 elements, U_max reported 30 elements (below the
    0.8 cap of 32); importance ranks layer 3 < 2 < 1 < 0."""
    policy = _osp()
    imp = np.array([4.0, 3.0, 2.0, 1.0])
    sizes = np.full(4, 10.0)
    k = 0
    for loss in (3.0, 1.0):          # epoch 1: mean 2.0
        k += 1
        assert not policy.bitmap_for(k, imp, sizes, loss, 1, 30.0, 0).any()
    # Epoch 2, loss 1.5: S = (1 - 0.75)·30 = 7.5 < 10: no layer fits.
    k += 1
    assert not policy.bitmap_for(k, imp, sizes, 1.5, 2, 30.0, 0).any()
    # Epoch 3, loss 0.5: S = 0.75·30 = 22.5: the two least important layers (20 elements).
    k += 1
    assert policy.bitmap_for(k, imp, sizes, 0.5, 3, 30.0, 0).tolist() == [False, False, True, True]
    # Another worker's report of the same iteration gets the same bitmap (one per iteration).
    assert policy.bitmap_for(k, imp[::-1].copy(), sizes, 0.4, 3, 30.0, 1).tolist() == \
        [False, False, True, True]
    # Epoch 4, loss 0.1: S = 0.95·min(30, 32) = 28.5: still two layers (a third would be 30).
    k += 1
    assert policy.bitmap_for(k, imp, sizes, 0.1, 4, 30.0, 0).sum() == 2
    fractions = {e["epoch"]: e["ics_fraction"] for e in policy.ics_fraction_per_epoch()}
    assert fractions == {1: 0.0, 2: 0.0, 3: 0.5, 4: 0.5}
    assert policy.first_loss == 2.0


def test_osp_u_max_follows_the_measured_rate_halving_it_shrinks_ics():
    """Eq. 5 from measurements: U_max = rate·T_c / itemsize.  A 4 MB/s aggregation rate and
    0.01 s of compute give 40 kB = 10 000 float32 elements; halving the rate halves U_max and
    with it the layers that fit in ICS."""
    from mpsync.torch.strategies.two_stage import osp_u_max

    assert osp_u_max(4e6, 0.01, 4) == pytest.approx(10_000)
    assert osp_u_max(2e6, 0.01, 4) == pytest.approx(5_000)
    sizes = np.array([4000.0, 4000.0, 4000.0, 4000.0])    # 16 000 elements, cap 12 800
    imp = np.array([4.0, 3.0, 2.0, 1.0])

    def ics_layers(rate):
        policy = _osp(n=1)
        policy.bitmap_for(1, imp, sizes, 1.0, 1, osp_u_max(rate, 0.01, 4), 0)
        return int(policy.bitmap_for(2, imp, sizes, 0.0, 2, osp_u_max(rate, 0.01, 4), 0).sum())

    # Loss 0 in epoch 2: S(G^u) = U_max.  10 000 elements: 2 layers; 5 000: 1 layer.
    assert ics_layers(4e6) == 2 and ics_layers(2e6) == 1
    # The fixed fraction is an option: U_max = 0.5 of the model whatever the rate.
    policy = _osp(n=1, osp_ics_size="fixed", osp_ics_max_fraction=0.5)
    policy.bitmap_for(1, imp, sizes, 1.0, 1, 1.0, 0)
    assert policy.bitmap_for(2, imp, sizes, 0.0, 2, 1.0, 0).sum() == 2
    # The smallest worker's bound counts (every worker's ICS must land in time).
    policy = _osp(n=2)
    policy.bitmap_for(1, imp, sizes, 1.0, 1, 12_000.0, 0)
    policy.bitmap_for(1, imp, sizes, 1.0, 1, 4_000.0, 1)
    assert policy.bitmap_for(2, imp, sizes, 0.0, 2, 12_000.0, 0).sum() == 1


def test_osp_round_opened_by_a_joined_worker_belongs_to_the_current_epoch():
    """A joined worker reports no epoch (0): the round it opens is sized and logged in the
    epoch the others are in, so osp_ics_fraction has no epoch 0 and the bitmap is theirs."""
    policy = _osp()
    imp = np.array([4.0, 3.0, 2.0, 1.0])
    sizes = np.full(4, 10.0)
    policy.bitmap_for(1, imp, sizes, 2.0, 1, 30.0, 0)
    policy.bitmap_for(2, imp, sizes, 0.5, 3, 30.0, 0)          # epoch 3: S = 22.5, 2 layers
    # Iteration 3 opened by worker 1, joined (no loss, epoch 0): epoch 3's bitmap.
    assert policy.bitmap_for(3, imp, sizes, None, 0, 30.0, 1).tolist() == \
        [False, False, True, True]
    assert [e["epoch"] for e in policy.ics_fraction_per_epoch()] == [1, 3]


@pytest.mark.parametrize("policy", ["ssp", "dssp"])
def test_a_pull_the_server_says_is_sure_is_granted_whatever_comes_before_it(policy):
    """``sure_pulls`` (sent with each pull's reply): the worker reads that many of its next
    pulls without asking, so each must be one ``may_pull`` grants at once, whatever the others
    did meanwhile -- pushes, workers taken out for silence and back, last pushes, shutdowns.
    Random events; a held worker pushes again only once its pull is granted."""
    rng = np.random.default_rng(3)
    n = 4
    p = make_policy(SyncConfig(policy=policy, topology="ps", staleness=2, staleness_low=1,
                               staleness_high=3), n)
    t = p.t
    sure_until = np.zeros(n, dtype=np.int64)   # the last own push whose pull is sure
    held = np.zeros(n, dtype=bool)
    used = checked = granted = 0

    def answered(w):    # a pull's reply: how many next pulls are sure
        nonlocal granted
        sure = p.sure_pulls(w)
        granted += policy == "dssp" and sure > pull_sure_within(t, w, 1)   # controller's
        sure_until[w] = t.pushes[w] + sure
    for step in range(6000):
        now = 0.01 * step
        for w in np.flatnonzero(held):
            if p.may_pull(w):
                held[w] = False
                answered(w)
        w = int(rng.choice(n, p=[0.32, 0.32, 0.32, 0.04]))   # worker 3 slow
        if t.done[w] or t.final_pushed[w] or held[w]:
            continue
        event = rng.random()
        if event < 0.02:
            t.removed[w] = not t.removed[w]       # taken out for silence, or back
            p.on_rejoin(w) if not t.removed[w] else p.on_membership_change()
        elif event < 0.022:
            p.on_push(w, now)                     # its last push (join)
            t.final_pushed[w] = True
        elif event < 0.023:
            t.done[w] = True
            p.on_membership_change()
        else:
            p.on_push(w, now)
            checked += 1
            if t.pushes[w] <= sure_until[w]:
                used += 1
                assert p.may_pull(w), (step, w, t.pushes.tolist(), sure_until.tolist())
            if p.may_pull(w):
                answered(w)
            else:
                held[w] = True
    assert used > checked // 10 and checked > 1000, (used, checked)   # not vacuous
    assert policy == "ssp" or granted > 20, granted   # DSSP: its controller's grants too
