"""The sharded parameter server's push-and-pull request (``PUSH_PULL``) served by the compiled
loop (``server/pull_rules.py``): the same decisions as the policy objects, the same tables,
counters, events and replies as the Python loop, and what it must leave to the Python loop.

One process talks to its own server over ``COMM_SELF`` (real MPI messages to itself); the
rules for many workers are checked against the policy objects on random tables.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpsync.config import SyncConfig
from mpsync.server import StateServer, pull_rules, rules, wire as W
from mpsync.server._fastpath import PROBED, RECEIVED
from mpsync.server.policies import DSSP, WorkerTable, make_policy


def _config(policy, **kw):
    return SyncConfig.from_options(env={}, policy=policy, topology="ps", server="colocated",
                                   silent_timeout=600.0, deadline=600.0, **kw)


def _server(policy, fast=True):
    comm = MPI.COMM_SELF.Dup()
    server = StateServer(comm, _config(policy, staleness=2, staleness_low=2, staleness_high=4),
                         workers=[0], fast_path=fast)
    server.weights.init(np.empty(0))   # the model is on the shards (PS_INIT with no payload)
    return comm, server


def _send_push_pulls(comm, count, flag=0, first=1):
    requests, bufs = [], []
    for i in range(first, first + count):
        msg = W.new_msg()
        msg[W.SEQ], msg[W.ITER], msg[W.FLAG] = i, i, flag
        bufs.append(msg)
        requests.append(comm.Isend([msg, MPI.DOUBLE], dest=0, tag=W.PUSH_PULL))
    return requests, bufs


def _replies(comm, count):
    out = []
    for _ in range(count):
        reply = W.new_msg()
        comm.Recv([reply, MPI.DOUBLE], source=0, tag=W.REPLY)
        out.append(reply)
    return out


def _state(server):
    """What a request writes, without the clock's readings (the twins' clocks differ)."""
    t, c, ev = server.table, server.counters, server.events
    rows = ev.rows[:ev.count]
    return {"pushes": t.pushes.tolist(), "counted": c.pushes.tolist(), "pulls": c.pulls.tolist(),
            "version": server.weights.version, "max_gap": c.max_gap,
            "interval_known": np.isfinite(t.interval).tolist(),
            "unawaited": t.unawaited.tolist(), "not_awaited": server._not_awaited().tolist(),
            "events": [(int(w), rules.EVENT_KINDS[int(k)], int(v)) for _, w, k, v in rows]}


@pytest.mark.parametrize("policy", ["asp", "ssp", "dssp"])
def test_the_compiled_loop_serves_push_pulls_as_the_python_loop_does(policy):
    # (DSSP with one worker: every push is within s_L, Alg. 1 lines 7-9)
    n = 6
    comm, fast = _server(policy)
    comm2, slow = _server(policy, fast=False)
    try:
        assert fast.ps.cells[pull_rules.PS_BOUND] == (-1 if policy == "asp" else 2)
        assert fast.ps.cells[pull_rules.PS_DSSP] == (policy == "dssp")
        requests, _ = _send_push_pulls(comm, n)
        now = MPI.Wtime()
        done = fast._serve_compiled(now, 0.05, now + 30.0, 0.0)
        MPI.Request.Waitall(requests)
        assert done.handled == n, done
        compiled = _replies(comm, n)
        requests, _ = _send_push_pulls(comm2, n)
        status = MPI.Status()
        for _ in range(n):
            comm2.Probe(0, W.PUSH_PULL, status)
            slow._receive(0, W.PUSH_PULL, status.Get_count(MPI.BYTE))
        MPI.Request.Waitall(requests)
        python = _replies(comm2, n)
        for a, b in zip(compiled, python):
            assert np.array_equal(a, b), (a, b)
        assert [int(r[W.R_VERSION]) for r in compiled] == list(range(1, n + 1))
        assert _state(fast) == _state(slow)
        assert fast.table.push_table[0, 0] <= fast.table.push_table[0, 1]
        # Under ASP nobody waits for these replies (SyncClient.push_pull collects each after
        # the next exchange): the loop does not wake up for the worker's next one.  SSP's and
        # DSSP's next pull may be asked: it does.
        assert _state(fast)["not_awaited"] == [policy == "asp"]
        if policy == "dssp":
            assert fast.policy.r_extra.tolist() == slow.policy.r_extra.tolist() == [0]
            assert not fast.policy.held.any() and fast.policy.describe() == \
                slow.policy.describe()
    finally:
        comm.Free()
        comm2.Free()


def test_a_last_push_and_a_policy_without_a_compiled_rule_go_to_the_python_loop():
    # (A DSSP push its controller rules on: the random tables below.)
    comm, server = _server("ssp")
    try:
        requests, bufs = _send_push_pulls(comm, 1, flag=1)
        now = MPI.Wtime()
        done = server._serve_compiled(now, 0.05, now + 30.0, 0.0)
        MPI.Request.Waitall(requests)
        assert (done.code, done.handled) == (RECEIVED, 0), done
        assert np.array_equal(server._msg, bufs[0])
        assert server.table.pushes[0] == 0 and server.weights.version == 0   # untouched
    finally:
        comm.Free()
    # DSSP's bookkeeping for a worker out of the comparison (a push after its last) is the
    # Python loop's: received, handed over untouched.
    comm, server = _server("dssp")
    try:
        server.table.final_pushed[0] = True
        requests, bufs = _send_push_pulls(comm, 1)
        now = MPI.Wtime()
        done = server._serve_compiled(now, 0.05, now + 30.0, 0.0)
        MPI.Request.Waitall(requests)
        assert (done.code, done.handled) == (RECEIVED, 0), done
        assert server.table.pushes[0] == 0 and server.weights.version == 0
    finally:
        comm.Free()

    class Patient(DSSP):     # a plugin's pull rule: not the one compiled
        def may_pull(self, w):
            return super().may_pull(w)

    plugin = Patient(WorkerTable(2), _config("dssp"))
    assert plugin.compiled_pull_bound() == pull_rules.NOT_SERVED
    assert plugin.compiled_controller() is None


def test_before_the_model_is_on_the_shards_nothing_is_served_here():
    comm = MPI.COMM_SELF.Dup()
    try:
        _assert_left_in_the_queue(comm, StateServer(comm, _config("asp"), workers=[0]))
    finally:
        comm.Free()


def _assert_left_in_the_queue(comm, server):
    """A PUSH_PULL the compiled loop probes and leaves for the Python loop to receive."""
    requests, _ = _send_push_pulls(comm, 1)
    now = MPI.Wtime()
    done = server._serve_compiled(now, 0.05, now + 30.0, 0.0)
    assert (done.code, done.tag, done.handled) == (PROBED, W.PUSH_PULL, 0), done
    comm.Recv([W.new_msg(), MPI.DOUBLE], source=0, tag=W.PUSH_PULL)
    MPI.Request.Waitall(requests)


@pytest.mark.parametrize("policy", ["asp", "ssp"])
def test_the_compiled_rules_decide_as_the_policy_objects_on_random_tables(policy):
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(1, 7))
        config = _config(policy, staleness=int(rng.integers(0, 4)))
        p = make_policy(config, n)
        t = p.t
        t.pushes[:] = rng.integers(0, 6, n)
        t.done[:] = rng.random(n) < 0.2
        t.removed[:] = rng.random(n) < 0.2
        t.final_pushed[:] = rng.random(n) < 0.2
        t.compute[:] = np.where(rng.random(n) < 0.5, 0.0, 0.01)
        t.last_event[:] = np.where(rng.random(n) < 0.3, np.nan, 1.0)
        counted, pulls = np.zeros(n, np.int64), np.zeros(n, np.int64)
        ps = pull_rules.new_ps_tables(t.pushes, t.push_table, t.final_pushed, t.done, counted,
                                      pulls)
        ps.cells[pull_rules.PS_BOUND] = p.compiled_pull_bound()
        w = int(rng.integers(0, n))
        copies = [(t.cells._replace(**{f: getattr(t.cells, f).copy()
                                       for f in t.cells._fields}),
                   ps._replace(**{f: getattr(ps, f).copy() for f in ps._fields}))
                  for _ in range(2)]
        granted = pull_rules.ps_pull_granted(t.cells, ps, w)
        assert granted == pull_rules.ps_pull_granted_reference(t.cells, ps, w)
        # The policy objects: count the push, then rule on the pull and the sure pulls.
        before = t.pushes.copy()
        p.on_push(w, 2.0)
        assert granted == p.may_pull(w), (trial, before, w)
        sure = p.sure_pulls(w)
        t.pushes[:] = before
        for (tables, copy), run in zip(copies, (pull_rules.ps_push_pull,
                                                pull_rules.ps_push_pull_reference)):
            assert run(tables, copy, w, 2.0) == sure, (trial, run)
            assert copy.pushes[w] == before[w] + 1
        (t1, c1), (t2, c2) = copies
        for f in ps._fields:
            assert np.array_equal(getattr(c1, f), getattr(c2, f), equal_nan=True), f
        for f in t1._fields:
            assert np.array_equal(getattr(t1, f), getattr(t2, f), equal_nan=True), f


def test_dssps_compiled_rule_grants_what_alg1_grants_without_the_controller():
    """DSSP on random tables: the compiled rule grants a pull exactly where the policy's
    ``on_push`` grants it without its controller (an extra iteration left, Alg. 1 lines
    3-5, or within s_L, lines 7-9), and then leaves r_p, the held flag and the sure pulls
    as the policy does; everything else (the controller's grant or hold) it hands over."""
    rng = np.random.default_rng(11)
    served = handed = 0
    for trial in range(400):
        n = int(rng.integers(1, 7))
        low = int(rng.integers(0, 3))
        p = make_policy(_config("dssp", staleness_low=low, staleness_high=low + 3), n)
        t = p.t
        t.pushes[:] = rng.integers(0, 8, n)
        t.push_table[:] = np.sort(rng.random((n, 2)), axis=1)
        t.done[:] = rng.random(n) < 0.15
        t.removed[:] = rng.random(n) < 0.15
        t.final_pushed[:] = rng.random(n) < 0.15
        p.r_extra[:] = np.where(rng.random(n) < 0.3, rng.integers(1, 3, n), 0)
        p.held[:] = rng.random(n) < 0.3
        ps = pull_rules.new_ps_tables(t.pushes, t.push_table, t.final_pushed, t.done,
                                      np.zeros(n, np.int64), np.zeros(n, np.int64),
                                      (p.r_extra.copy(), p.held.copy()))
        ps.cells[pull_rules.PS_BOUND] = p.compiled_pull_bound()
        w = int(rng.integers(0, n))
        granted = pull_rules.ps_pull_granted(t.cells, ps, w)
        assert granted == pull_rules.ps_pull_granted_reference(t.cells, ps, w), trial
        going = ~(t.done | t.removed | t.final_pushed)
        before, r_before, grants = t.pushes.copy(), int(p.r_extra[w]), p.granted.sum()
        after = before + (np.arange(n) == w)          # counting this push
        without_controller = bool(going[w]) and (
            r_before > 0 or after[w] - after[going].min() <= low)
        assert granted == without_controller, (trial, before, w, r_before)
        if not granted:
            handed += 1
            continue
        served += 1
        copies = [ps._replace(**{f: getattr(ps, f).copy() for f in ps._fields})
                  for _ in range(2)]
        cells = [t.cells._replace(**{f: getattr(t.cells, f).copy() for f in t.cells._fields})
                 for _ in range(2)]
        p.on_push(w, 2.0)
        assert p.may_pull(w) and p.granted.sum() == grants, trial
        sure = p.sure_pulls(w)
        t.pushes[:] = before
        for tables, copy, run in zip(cells, copies, (pull_rules.ps_push_pull,
                                                     pull_rules.ps_push_pull_reference)):
            assert run(tables, copy, w, 2.0) == sure, (trial, run)
            assert copy.r_extra.tolist() == p.r_extra.tolist(), (trial, run)
            assert copy.held.tolist() == p.held.tolist(), (trial, run)
    assert served > 100 and handed > 50, (served, handed)



def test_the_gap_recorded_is_over_the_workers_the_bound_compares():
    """The largest gap granted counts the lead over the slowest worker still pushing, as the
    bound does: a worker that has pushed its last update (none left to miss) or a final pull
    (its weights never trained on) is no staleness granted; the Python loop and both compiled
    rules record the same."""
    cases = [([6, 8], [False, False], 2),   # both going: the lead is granted staleness
             ([5, 8], [True, False], 0)]    # worker 0 is done pushing: nothing to miss
    for pushes, final, gap in cases:
        comm = MPI.COMM_SELF.Dup()
        try:
            server = StateServer(comm, _config("ssp", staleness=2), workers=[0, 1],
                                 fast_path=False)
            server.weights.init(np.empty(0))
            server.table.pushes[:] = pushes
            server.table.final_pushed[:] = final
            server._answer_pull(0, 1, 1.0, 0)
            _replies(comm, 1)
            assert server.counters.max_gap == gap, (pushes, final)
            server.table.pushes[:] = [2, 9]
            server._answer_pull(0, 1, 2.0, 0, final=True)   # a final pull: not counted
            _replies(comm, 1)
            assert server.counters.max_gap == gap, (pushes, final)
        finally:
            comm.Free()
        t = WorkerTable(2)
        t.final_pushed[:] = final
        for run in (pull_rules.ps_push_pull, pull_rules.ps_push_pull_reference):
            t.pushes[:] = pushes
            t.pushes[1] -= 1    # the push this request counts
            ps = pull_rules.new_ps_tables(t.pushes, t.push_table, t.final_pushed, t.done,
                                          np.zeros(2, np.int64), np.zeros(2, np.int64))
            ps.cells[pull_rules.PS_BOUND] = 2
            run(t.cells, ps, 1, 1.0)
            assert ps.cells[pull_rules.PS_MAX_GAP] == gap, (run, pushes, final)


def _colocated(policy, topology="ps"):
    """A client and its server (a thread of this process) over ``COMM_SELF``: real
    messages, the server's own loop."""
    from mpsync.server import SyncClient, start_colocated

    comm = MPI.COMM_SELF.Dup()
    config = SyncConfig.from_options(env={}, policy=policy, topology=topology,
                                      server="colocated", silent_timeout=600.0, deadline=60.0)
    return comm, start_colocated(comm, config), SyncClient(comm, config)


@pytest.mark.parametrize("policy", ["asp", "ssp", "dssp"])
def test_steps_are_reported_without_waiting_and_every_one_is_counted(policy):
    from mpsync import policies

    # Their servers answer every step SYNC (what they rule on is the pull); not the others'.
    assert all(policies.get(p).steps_unawaited for p in ("asp", "ssp", "dssp"))
    assert not any(policies.get(p).steps_unawaited for p in ("bsp", "ebsp", "esync", "osp",
                                                             "auto"))
    comm, server, client = _colocated(policy)
    steps = 3 * len(client._later_bufs) + 1   # more than the buffers: the oldest are collected
    try:
        for k in range(1, steps + 1):
            assert client.step_unawaited(k, 0.002).sync
            assert len(client._later) <= len(client._later_bufs)
        assert client.iteration == steps
    finally:
        client.shutdown()          # collects every reply still out (a call that waits)
        stats = server.join(timeout=60)
        comm.Free()
    assert client._later == []
    worker = stats["workers"]["0"]
    assert (worker["iterations"], worker["last_iteration"]) == (steps, steps)
    assert worker["decisions"] == {"LOCAL": 0, "SYNC": steps}
    assert worker["compute_s"] == pytest.approx(0.002 * steps)


@pytest.mark.parametrize("policy", ["asp", "ssp"])
def test_the_server_does_not_wake_for_reports_nobody_waits_for(policy):
    # A reporting worker (compute > 0) whose push-and-pull replies are read later: under ASP
    # its steps are unawaited too, so the loop need not wake for its next message; SSP's
    # next gated pull reads the sure pulls of a reply: it does.
    comm, server = _server(policy)
    try:
        steps = []
        for k in (1, 2):
            msg = W.new_msg()
            msg[W.SEQ], msg[W.ITER], msg[W.COMPUTE] = 10 + k, k, 0.01
            steps.append(comm.Isend([msg, MPI.DOUBLE], dest=0, tag=W.STEP))
        requests, _ = _send_push_pulls(comm, 1, first=3)
        now = MPI.Wtime()
        done = server._serve_compiled(now, 0.05, now + 30.0, 0.0)
        MPI.Request.Waitall(steps + requests)
        assert done.handled == 3, done
        _replies(comm, 3)
        assert server.table.compute[0] > 0
        assert server._not_awaited().tolist() == [policy == "asp"]
    finally:
        comm.Free()


def test_a_step_reported_without_waiting_that_the_server_answers_local_is_an_error():
    # ElasticBSP answers a first step LOCAL (no barrier planned yet): a worker that took it
    # for SYNC would aggregate alone, so the reply, once collected, raises.
    from mpsync.server import ServerError

    comm, server, client = _colocated("ebsp", topology="ring")
    try:
        assert client.step_unawaited(1, 0.002).sync
        with pytest.raises(ServerError, match="answered LOCAL to a step"):
            client.stats()
        comm2, server2, twin = _colocated("ebsp", topology="ring")   # the same, waited for
        try:
            assert not twin.step(1, 0.002).sync
        finally:
            twin.shutdown()
            server2.join(timeout=60)
            comm2.Free()
    finally:
        client.shutdown()
        server.join(timeout=60)
        comm.Free()
