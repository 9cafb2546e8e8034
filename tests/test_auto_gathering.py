"""The round ``auto`` makes to leave the parameter server (``mpsync.auto.gathering``), on the
server's own ``WorkerTable``, without MPI: every worker held before any is released, the
switch round above every worker's, each switch pull granted only once every worker's switch
push is in, and a worker's last push before the release calling the switch off."""

from __future__ import annotations

from mpsync.auto.gathering import Gathering
from mpsync.server.policies import WorkerTable


def _table(rounds):
    t = WorkerTable(len(rounds))
    t.round[:] = rounds
    t.pushes[:] = rounds
    return t


def test_nobody_is_released_before_everyone_is_held_and_the_round_is_above_all():
    t = _table([7, 3, 5])
    g = Gathering(t, now=10.0)
    g.hold(0)
    assert not g.ready(0, 10.1)
    g.hold(2)
    assert not g.ready(2, 10.2) and not g.ready(0, 10.2)
    g.hold(1)
    assert g.ready(1, 10.5) and g.ready(0, 10.5) and g.ready(2, 10.5)
    assert g.round == 8 and abs(g.held_s - 0.5) < 1e-12
    assert all(g.switching(w) for w in range(3))


def test_a_switch_pull_waits_for_every_workers_switch_push():
    t = _table([4, 4, 2])
    g = Gathering(t)
    for w in range(3):
        g.hold(w)
    assert all(g.ready(w) for w in range(3))
    t.pushes[0] += 1
    assert not g.may_pull(0)
    t.pushes[2] += 1
    assert not g.may_pull(2)
    t.pushes[1] += 1
    assert g.may_pull(0) and g.may_pull(1) and g.may_pull(2)
    t.round[:] = g.round           # each reset round R: past the switch
    assert not any(g.switching(w) for w in range(3))


def test_a_worker_that_joined_calls_the_switch_off_and_one_taken_out_is_not_waited_for():
    t = _table([3, 3, 3])
    g = Gathering(t)
    g.hold(0)
    t.final_pushed[1] = True       # worker 1 sent its last push: it will not step again
    assert g.cancelled
    t2 = _table([3, 3, 3])
    g2 = Gathering(t2)
    g2.hold(0)
    g2.hold(1)
    t2.removed[2] = True           # taken out (the PS's rule): not waited for
    assert g2.ready(0) and g2.ready(1) and g2.round == 4


def test_a_pull_the_staleness_bound_holds_does_not_deadlock_the_gathering():
    """The state server's ``AutoPolicy`` on SSP (bound 1) with worker 2 four times slower,
    told by its plan to go back to BSP on the ring: the fast workers' pulls wait on the bound
    for worker 2's pushes while worker 2 is held at its step for the gathering.  Every worker
    must still be released to the ring (a seen deadlock: the job waited for its deadline)."""
    from mpsync import policies
    from mpsync.config import SyncConfig
    from mpsync.server.policies import make_policy

    pol = make_policy(SyncConfig(policy="auto", auto_plan="1:ssp,6:bsp", staleness=1)
                      .validate(), 3)
    for w in range(3):
        pol.on_step(w, 1, 0.01, 0.0)
    for w in range(3):
        pol.on_reset(w, 1, 0.0)
    bsp = policies.auto_code("bsp", "ring")
    state, k, period, released, saw_bound = ["step"] * 3, [1] * 3, [1, 1, 4], set(), False
    for tick in range(1, 80):
        now = 0.01 * tick
        for w in range(3):
            if w in released:
                continue
            d = None
            if state[w] == "step" and tick % period[w] == 0:
                k[w] += 1
                d = pol.on_step(w, k[w], 0.01 * period[w], now)
                state[w] = "held" if d is None else "push"
            elif state[w] == "held":
                d = pol.decide_held(w, k[w], now)
                state[w] = "held" if d is None else "push"
            if state[w] == "push":
                if d[2] == bsp:       # released to the ring: the switch's own round follows
                    released.add(w)
                    continue
                pol.on_push(w, now)
                state[w] = "pull"
            if state[w] == "pull":
                if pol.may_pull(w):
                    pol.on_reset(w, int(pol.t.round[w]) + 1, now)
                    state[w] = "step"
                else:
                    saw_bound = True
        if len(released) == 3:
            break
    assert saw_bound, "the scenario never held a pull on the staleness bound"
    assert released == {0, 1, 2}, (state, pol.t.pushes.tolist(), pol.gathering)
