"""Every policy on a worked scenario small enough to check by hand, in one process.

Each test drives the server's policy object (what the serve loops call) or a scheduling kernel
with exact timestamps and asserts the decisions and values worked out by hand in its
docstring; none re-derives them with the code under test.  Each one fails if its policy is
replaced by BSP or by ASP, and each paper-specific rule has a test that fails if the rule is
removed (``bench/mutations.py`` applies those mutations to the source and lists the tests
that catch them).  The multi-rank checks of the rules that live in the MPI path (ESync
§4.2's abort, ElasticBSP after a join and its barrier weights on the ring) are in
test_fidelity.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpsync import sched
from mpsync.config import SyncConfig
from mpsync.server import make_policy
from mpsync.server.wire import LOCAL, SYNC


def _ps(policy, n, **config):
    p = make_policy(SyncConfig(policy=policy, topology="ps", **config), n)
    p.t.registered[:] = True
    return p


def _ring(policy, n, **config):
    p = make_policy(SyncConfig(policy=policy, topology="ring", **config), n)
    p.t.registered[:] = True
    return p


def _pushes(policy, sequence):
    """Feed ``(time, worker)`` pushes; after each, whether worker 0's pull would be answered."""
    out = []
    for now, w in sequence:
        policy.on_push(w, now)
        out.append(policy.may_pull(0))
    return out


# -- BSP and ASP (DSSP §I.A) ------------------------------------------------------------------------
def test_bsp_on_the_ps_answers_a_pull_only_once_every_worker_pushed_as_often():
    """Three workers.  Worker 0 pushes: its pull waits (workers 1, 2 have not pushed); after
    worker 1's push it still waits; after worker 2's it is answered.  Every step is SYNC."""
    p = _ps("bsp", 3)
    assert _pushes(p, [(1.0, 0), (1.1, 1), (1.2, 2)]) == [False, False, True]
    assert p.on_step(0, 1, 1.0, 1.0)[0] == SYNC


def test_asp_on_the_ps_never_holds_a_pull():
    """Worker 0 pushes five times while workers 1 and 2 push nothing: every pull answered."""
    p = _ps("asp", 3)
    assert _pushes(p, [(float(t), 0) for t in range(1, 6)]) == [True] * 5


# -- SSP (DSSP §I.A: a difference of exactly s is allowed) ------------------------------------------
def test_ssp_holds_a_pull_exactly_when_the_worker_is_more_than_s_pushes_ahead():
    """s = 2, two workers.  Worker 1 pushes once; worker 0 pushes four times: gaps 0, 1, 2, 3
    after its pushes, so its pulls are answered, answered, answered (gap 2 = s is allowed),
    held.  Worker 1's second push brings the gap back to 2: answered."""
    p = _ps("ssp", 2, staleness=2)
    seq = [(0.5, 1), (1.0, 0), (2.0, 0), (3.0, 0), (4.0, 0), (5.0, 1)]
    assert _pushes(p, seq) == [True, True, True, True, False, True]


# -- DSSP (Alg. 1 server, Alg. 2 synchronization_controller) ------------------------------------------
def test_dssp_grants_the_controllers_extra_iterations_and_never_past_s_upper():
    """s_L = 3, s_U = 5 (r_max at most 2).  Worker 0 pushes every 1.0 s from t = 0, worker 1
    every 3.2 s from t = 0.5.  Pushes counted: after worker 0's 6th push (t = 5) the gap is
    6 - 2 = 4 > s_L and worker 0 is the fastest; r_max = min(2, s_U - 4 + 1) = 2.  Alg. 2:
    I_0 = 1, Sim_0 = 5, 6, 7; I_1 = 3.2 from its pushes at 0.5 and 3.7, Sim_1 = 6.9, 10.1,
    13.3; |Sim_1 - Sim_0| is smallest (0.1) at r = 2: r* = 2, OK now (the first extra
    iteration) and r_p = 1.  Push 7 (gap 5): r_p > 0, OK, r_p = 0.  Worker 1's 3rd push
    (6.9).  Push 8 (t = 7, gap 5): allowance left r_max = min(2, 5 - 5 + 1) = 1; Sim_0 = 7, 8;
    Sim_1 = 10.1, 13.3: r* = 1, OK.  Push 9 (gap 6): r_max = 0, r* = 0: held (Alg. 1 line
    17) until the gap is back within s_L: worker 1's pushes at 10.1 (gap 5) and 13.3 (gap 4)
    keep it held, the one at 16.5 (gap 3) releases it."""
    p = _ps("dssp", 2, staleness_low=3, staleness_high=5)
    seq = [(0.0, 0), (0.5, 1), (1.0, 0), (2.0, 0), (3.0, 0), (3.7, 1), (4.0, 0), (5.0, 0)]
    assert _pushes(p, seq) == [True] * 8
    assert p.r_extra.tolist() == [1, 0]
    assert (p.grants[0]["r_max"], p.grants[0]["r_star"], p.grants[0]["p"]) == (2, 2, 0)
    assert _pushes(p, [(6.0, 0)]) == [True] and p.r_extra[0] == 0
    assert _pushes(p, [(6.9, 1), (7.0, 0)]) == [True, True]
    assert (p.grants[1]["r_max"], p.grants[1]["r_star"]) == (1, 1)
    assert _pushes(p, [(8.0, 0)]) == [False]
    assert _pushes(p, [(10.1, 1), (13.3, 1), (16.5, 1)]) == [False, False, True]
    assert p.describe()["controller_grants"] == [2, 0]


def test_dssp_controller_on_figure_2s_shape():
    """Alg. 2 alone: worker 0 (interval 1, latest push at 10), the slowest worker 1 (interval
    2.5, latest push at 9, so Sim_1 = 11.5, 14, 16.5, ...).  r_max = 4: Sim_0 = 10..14; the
    closest pair is Sim_0[4] = 14 = Sim_1[1]: r* = 4.  With r_max = 3 the best is
    |11.5 - 11| = |11.5 - 12| = 0.5, the earliest wins: r* = 1."""
    table = np.array([[9.0, 10.0], [6.5, 9.0]])
    assert sched.dssp_controller(table, 0, 4) == 4
    assert sched.dssp_controller(table, 0, 3) == 1
    iters = np.array([8, 3], dtype=np.int64)    # gap 5 > s_L = 3, worker 0 the fastest
    assert tuple(sched.dssp_on_push(iters, 0, table, 0, 3, 4)) == (True, 3)


# -- ElasticBSP (ZipLine §3, Fig. 5, §4.2, §5) -------------------------------------------------------
def _report(policy, w, k, now, interval):
    policy.t.record_report(w, k, interval, now)
    return policy.on_step(w, k, interval, now)


def test_ebsp_places_the_barrier_where_zipline_finds_the_least_waiting():
    """Two workers from t = 0, 1.0 s and 1.6 s per iteration, R = 4.  Monitoring ends at
    worker 1's second report (t = 3.2; worker 0 has reported at 1, 2, 3).  Predicted pushes:
    worker 0 at 4, 5, 6, 7; worker 1 at 4.8, 6.4, 8.0, 9.6.  The closest pair is 5.0 and 4.8
    (d = 0.2; next best 6.0 / 6.4): z = [1, 0], barrier at t_sync = 5.0.  Worker 0 synchronizes
    after iteration 3 + 1 + 1 = 5, worker 1 after 2 + 0 + 1 = 3; before that they train on."""
    p = _ring("ebsp", 2, lookahead=4)
    p.t.last_event[:] = 0.0
    assert _report(p, 0, 1, 1.0, 1.0) == (LOCAL, 0, 0)
    assert _report(p, 1, 1, 1.6, 1.6) == (LOCAL, 0, 0)
    assert _report(p, 0, 2, 2.0, 1.0) == (LOCAL, 0, 0)
    assert _report(p, 0, 3, 3.0, 1.0) == (LOCAL, 0, 0)
    assert _report(p, 1, 2, 3.2, 1.6) == (LOCAL, 1, 0)
    plan = p.plans[0]
    assert plan["z"] == [1, 0] and plan["target_iteration"] == [5, 3]
    assert plan["d"] == pytest.approx(0.2) and plan["t_sync"] == pytest.approx(5.0)
    assert _report(p, 0, 4, 4.0, 1.0) == (LOCAL, 1, 0)
    assert _report(p, 1, 3, 4.8, 1.6)[0] == SYNC
    assert _report(p, 0, 5, 5.0, 1.0)[0] == SYNC


def _superstep(p, ws, k0, t0, barrier_k):
    """Workers ``ws`` (1.0 s per iteration, worker w offset by w/8 s: exact binary fractions, so
    equal intervals are exactly equal) report from iteration
    k0 + 1 until told SYNC at ``barrier_k``; each pushes every iteration (PS).  Returns the
    iterations at which each was told SYNC."""
    synced = {}
    for k in range(k0 + 1, barrier_k + 1):
        for w in ws:
            now = t0 + (k - k0) + 0.125 * w
            action = _report(p, w, k, now, 1.0)[0]
            if action == SYNC:
                p.t.in_sync[w] = True
                synced[w] = k
            p.on_push(w, now)
    return synced


def test_ebsp_on_the_ps_plans_over_the_workers_still_running_after_one_joins():
    """Three workers, 1.0 s per iteration, offsets 0, 1/8, 1/4 s.  Superstep 0: monitoring at
    iterations 1-2, equal intervals so z = 0 (ties go to the earliest barrier, §4.2 Thm. 1):
    barrier at iteration 3 for all.  Worker 2 then joins (its last push, then resets at its
    pace, no more steps).  Superstep 1 among workers 0 and 1: monitoring at iterations 4-5,
    plan over [0, 1], barrier at 6; worker 0's barrier pull waits for worker 1's barrier push,
    not for worker 2.  Superstep 2 follows the same way (barrier at 9)."""
    p = _ps("ebsp", 3, lookahead=4)
    p.t.last_event[:] = 0.0
    assert _superstep(p, (0, 1, 2), 0, 0.0, 3) == {0: 3, 1: 3, 2: 3}
    assert p.plans[0]["workers"] == [0, 1, 2] and p.plans[0]["z"] == [0, 0, 0]
    assert all(p.may_pull(w) for w in range(3))
    for w in range(3):
        p.on_reset(w, 1, 3.3)
    # Worker 2 joins: its last push, then a reset at its pace.
    p.on_push(2, 3.4)
    p.t.final_pushed[2] = True
    p.on_reset(2, 1, 3.5)
    for barrier, superstep in ((6, 1), (9, 2)):
        start = barrier - 3
        synced = _superstep(p, (0, 1), start, float(start), barrier)
        assert synced == {0: barrier, 1: barrier}, (superstep, synced)
        plan = p.plans[superstep]
        assert plan["workers"] == [0, 1] and plan["target_iteration"] == [barrier, barrier]
        p.on_reset(2, 1, barrier + 0.05)          # the joined worker's pace: nothing changes
        for w in (0, 1):
            p.on_reset(w, superstep + 1, barrier + 0.3)
    assert len(p.plans) == 3
    assert {(s["superstep"], s["worker"]) for s in p.supersteps} == \
        {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1)}


def test_ebsp_barrier_pull_waits_for_the_running_workers_barrier_pushes_only():
    """After the join above: worker 0 at its barrier (SYNC, pushed), worker 1 not yet: worker
    0's pull is held (BSP at the barrier); worker 1's barrier push releases it."""
    p = _ps("ebsp", 3, lookahead=4)
    p.t.last_event[:] = 0.0
    _superstep(p, (0, 1, 2), 0, 0.0, 3)
    for w in range(3):
        p.on_reset(w, 1, 3.3)
    p.on_push(2, 3.4)
    p.t.final_pushed[2] = True
    p.on_reset(2, 1, 3.5)
    _superstep(p, (0, 1), 3, 3.0, 5)               # monitoring: plan made at worker 1's 5th
    assert p.target.tolist()[:2] == [6, 6]
    assert _report(p, 0, 6, 6.0, 1.0)[0] == SYNC
    p.t.in_sync[0] = True
    p.on_push(0, 6.0)
    assert not p.may_pull(0)
    assert _report(p, 1, 6, 6.125, 1.0)[0] == SYNC
    p.t.in_sync[1] = True
    p.on_push(1, 6.125)
    assert p.may_pull(0) and p.may_pull(1)


# -- ESync (Alg. 1 capability test, Alg. 2 QUERY-STATE, §4.2) ---------------------------------------
def _esync_after_capability_test(**config):
    """Worker 0 (1.0 s per iteration) reports its capability test at t = 0: held, worker 1's
    capability is not known.  Worker 1 (3.0 s) reports at t = 0.1: NOT-READY, and worker 0's
    held reply is released at 0.1 (its t_e)."""
    p = _ring("esync", 2, esync_slack=0.05, **config)
    assert p.on_step(0, 0, 1.0, 0.0) is None
    assert p.on_step(1, 0, 3.0, 0.1) == (LOCAL, 0, 0)
    assert p.decide_held(0, 0, 0.1) == (LOCAL, 0, 0)
    return p


def test_esync_capability_test_holds_the_first_query_until_every_capability_is_known():
    p = _esync_after_capability_test()
    assert p.capability.tolist() == [1.0, 3.0] and p.last_finish.tolist() == [0.1, 0.1]


def test_esync_query_state_lets_the_fast_worker_run_until_the_slowest_is_ready():
    """After the capability test (t_e = 0.1 for both): worker 0 reports iteration 1 at 1.1:
    the slowest (worker 1, c = 3.0) finishes at 0.1 + 3.0 = 3.1, rest time 2.0 > c_0 + ε =
    1.05: NOT-READY.  Iteration 2 at 2.1: rest time 1.0 < 1.05: READY.  Worker 1 at 3.1 is
    the slowest: READY after one iteration.  Worker 0 ran 2 local iterations, worker 1 one."""
    p = _esync_after_capability_test()
    assert _report(p, 0, 1, 1.1, 1.0) == (LOCAL, 0, 0)
    assert _report(p, 0, 2, 2.1, 1.0) == (SYNC, 0, 0)
    assert _report(p, 1, 1, 3.1, 3.0) == (SYNC, 0, 0)
    assert p.describe()["local_iterations_per_round"] == [[2], [1]]


def test_esync_delayed_ack_gives_one_ready_per_round():
    """§4.2: once READY was given this round, a later report (sent before the READY reached
    the worker) is NOT-READY; the round trip counts in the capability (1.0 + 0.2)."""
    p = _esync_after_capability_test()
    assert p.on_step(0, 1, 1.0, 1.1, delayed_ack=True, rtt=0.2)[0] == LOCAL
    assert p.capability[0] == pytest.approx(1.2)
    assert p.on_step(0, 2, 1.0, 2.1, delayed_ack=True, rtt=0.2)[0] == SYNC
    assert p.on_step(0, 3, 1.0, 3.0, delayed_ack=True, rtt=0.2)[0] == LOCAL


# -- OSP (§4.1.2 Eq. 5, Alg. 1) ----------------------------------------------------------------------
def test_osp_u_max_is_eq_5_capped_at_0_8_of_the_model():
    """U_max = b(1 + lr)·T_c / N: b = 2e6 elements/s, lr = 0, T_c = 0.05 s, N = 4: 25,000
    elements; a 1e6-element model leaves it there, a 20,000-element one caps it at 16,000;
    lr = 0.5 (as printed in Eq. 5) raises it to 37,500."""
    assert sched.osp_ics_budget(2e6, 0.0, 0.05, 4, 1e6) == pytest.approx(25_000)
    assert sched.osp_ics_budget(2e6, 0.0, 0.05, 4, 20_000) == pytest.approx(16_000)
    assert sched.osp_ics_budget(2e6, 0.5, 0.05, 4, 1e6) == pytest.approx(37_500)
    assert sched.osp_ics_budget(1e6, 0.0, 0.05, 4, 1e6) == pytest.approx(12_500)


def test_osp_alg_1_schedule_is_zero_in_epoch_1_then_follows_the_loss():
    """S(G^u) = 0 in epoch 1; then (1 - loss_i / L)·U_max: L = 2.0, U_max = 1000: loss 0.5
    gives 750, loss 1.5 gives 250."""
    assert sched.osp_ics_size(1, 0.5, 2.0, 1000.0) == 0.0
    assert sched.osp_ics_size(3, 0.5, 2.0, 1000.0) == pytest.approx(750.0)
    assert sched.osp_ics_size(2, 1.5, 2.0, 1000.0) == pytest.approx(250.0)


def test_osp_server_puts_the_least_important_layers_in_ics_within_the_smallest_u_max():
    """Four layers of 10 elements (model 40, cap 32), importance 4, 3, 2, 1.  Worker 0
    reports U_max 30, worker 1 reports 25: U_max = 25.  Epoch 1 (mean loss 2.0): no ICS.
    Epoch 2, loss 0.4: S(G^u) = 0.8·25 = 20: layers 3 and 2 (the two least important) in
    ICS, layers 1 and 0 synchronized at once."""
    p = _ring("osp", 2)
    assert p.takes_importance
    imp, sizes = np.array([4.0, 3.0, 2.0, 1.0]), np.full(4, 10.0)
    assert not p.bitmap_for(1, imp, sizes, 2.0, 1, 30.0, 0).any()
    assert not p.bitmap_for(1, imp, sizes, 2.0, 1, 25.0, 1).any()
    assert p.bitmap_for(2, imp, sizes, 0.4, 2, 30.0, 0).tolist() == [False, False, True, True]
    assert p.u_max(40.0) == 25.0
    assert p.ics_log[-1]["budget"] == pytest.approx(20.0)


def test_ebsp_hurried_by_auto_places_the_switch_barrier_at_the_next_steps():
    """``hurry(round)`` (only policy auto asks, for the barrier its switch waits for): a plan
    under way is brought forward to every worker's next step; in a monitoring phase a plan is
    made at once, the reporting worker told SYNC now; a plan for an earlier barrier is left
    as ZipLine placed it.  The same two workers as above."""
    p = _ring("ebsp", 2, lookahead=4)
    p.t.last_event[:] = 0.0
    _report(p, 0, 1, 1.0, 1.0), _report(p, 1, 1, 1.6, 1.6)
    _report(p, 0, 2, 2.0, 1.0), _report(p, 0, 3, 3.0, 1.0), _report(p, 1, 2, 3.2, 1.6)
    assert p.plans[0]["target_iteration"] == [5, 3]
    p.hurry(2)                                  # (the barrier after this one: not yet)
    assert p.target.tolist() == [5, 3]
    p.hurry(1)
    assert p.target.tolist() == [4, 3]          # worker 0 from iteration 5 to its next, 4
    assert _report(p, 0, 4, 4.0, 1.0)[0] == SYNC

    q = _ring("ebsp", 2, lookahead=4)
    q.t.last_event[:] = 0.0
    assert _report(q, 0, 1, 1.0, 1.0) == (LOCAL, 0, 0)      # monitoring: no plan yet
    q.hurry(1)
    assert q.target.tolist() == [2, 1] and q.plans[-1]["hurried_for_round"] == 1
    assert _report(q, 1, 1, 1.6, 1.6)[0] == SYNC
    assert _report(q, 0, 2, 2.0, 1.0)[0] == SYNC
