"""The compiled engines decide as the state server does: what they keep instead of the server's
scans (``simulate._index``) gives the scans' answers, and their decision steps, driven with the
same seeded random and adversarial messages as the server's policy objects and rules, give the
same answers and leave the same tables.  Single process, no MPI."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from mpsync import sched
from mpsync.config import SyncConfig
from mpsync.server import rules
from mpsync.server.policies import make_policy
from mpsync.server.wire import SYNC
from mpsync.simulate import _fast_esync as fe
from mpsync.simulate import _fast_ps as fp
from mpsync.simulate._queue import HEAP_KIND, KINDS, new_queue, pop, push
from mpsync.simulate._index import (count_up, lowest_at_min, lowest_at_min_reference,
                                    new_argmax_tree, new_counts, new_lowest_at_min, tree_set,
                                    tree_top)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [1, 5, 64, 100])
def test_argmax_tree_is_esync_slowest_ties_included(seed, n):
    rng = np.random.default_rng(seed)
    # few distinct values: ties everywhere (the lowest index must win, as the scan's)
    values = rng.choice([0.0, 0.1, 0.2, 0.3], n)
    tree = new_argmax_tree(values)
    for _ in range(300):
        i = int(rng.integers(n))
        values[i] = rng.choice([0.0, 0.1, 0.2, 0.3, rng.random()])
        tree_set(tree, values, i)
        assert tree_top(tree) == sched.esync_slowest(values)


@pytest.mark.parametrize("seed", range(3))
def test_counts_keep_the_minimum_and_maximum_of_the_scan(seed):
    rng = np.random.default_rng(seed)
    n = 37
    counts = np.zeros(n, np.int64)
    hist, lo, hi = new_counts(n), 0, 0
    # the slowest lags far behind (the histogram grows), then everyone catches up
    for step in range(4000):
        w = int(rng.integers(n)) if step < 3000 else int(np.argmin(counts))
        if step < 3000 and w == 0 and rng.random() < 0.9:
            continue
        old = int(counts[w])
        counts[w] += 1
        hist, lo, hi, raised = count_up(hist, old, lo, hi)
        assert (lo, hi) == (counts.min(), counts.max())
        assert raised == (old == lo - 1 and not (counts == old).any())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [1, 2, 9, 64])
def test_lowest_at_min_is_dssp_slowest_ties_included(seed, n):
    # counts that grow by one, asked after some pushes (not all: the cursor must catch up over
    # several departures), the low indices often the slowest (the cursor moves far), ties
    # everywhere; the answer is the scan's and sched.dssp_slowest's
    rng = np.random.default_rng(seed)
    counts = np.zeros(n, np.int64)
    state = new_lowest_at_min()
    asked = 0
    for step in range(1500):
        w = int(rng.integers(n)) if rng.random() < 0.6 else int(np.argmin(counts))
        if w < n // 3 and rng.random() < 0.5:
            continue
        counts[w] += 1
        if rng.random() < 0.4:
            lo = int(counts.min())
            got = lowest_at_min(state, counts, lo)
            assert got == lowest_at_min_reference(counts, lo) == sched.dssp_slowest(counts)
            asked += 1
    assert asked > 300


def test_lowest_at_min_refuses_a_minimum_no_count_holds():
    with pytest.raises(ValueError, match="minimum"):
        lowest_at_min(new_lowest_at_min(), np.array([2, 3], np.int64), 1)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n", [1, 3, 50])
def test_event_queue_pops_in_the_single_heaps_order(seed, n):
    # the engines' queue against one heap of (time, kind, scheduling order): iteration ends at
    # any time, every other kind at times that never decrease, equal times everywhere
    rng = np.random.default_rng(seed)
    q = new_queue(n)
    ref, seq, now = [], 0, 0.0
    last = [0.0] * KINDS
    pending = set()
    for _ in range(3000):
        if pending and (len(pending) == n * KINDS or rng.random() < 0.5):
            t, kind, w = pop(q)
            want = heapq.heappop(ref)
            assert (t, kind, w) == (want[0], want[1], want[3])
            pending.discard((kind, w))
            now = t
            continue
        kind, w = int(rng.integers(KINDS)), int(rng.integers(n))
        if (kind, w) in pending:
            continue
        if kind == HEAP_KIND:
            t = now + float(rng.choice([0.0, 0.5, 1.0, rng.random()]))
        else:
            t = max(last[kind], now) + float(rng.choice([0.0, 0.0, 0.25]))
            last[kind] = t
        push(q, kind, t, w)
        heapq.heappush(ref, (t, kind, seq, w))
        seq += 1
        pending.add((kind, w))
    while ref:
        want = heapq.heappop(ref)
        assert pop(q) == (want[0], want[1], want[3])
    assert pop(q)[1] == -1


def _esync_tables_equal(a, b):
    for name, x, y in zip(a._fields, a, b):
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("seed", range(6))
def test_esync_steps_with_the_index_are_the_servers_rule(seed):
    # the same messages to rules.esync_capability_test / esync_step / esync_new_round over
    # every worker and to the engine's indexed versions: same answers, same tables
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    eps = float(rng.choice([0.0, 0.05]))
    members = np.arange(n, dtype=np.int64)
    server, engine = rules.new_esync_tables(n, 8), rules.new_esync_tables(n, 8)
    index = fe.new_index(engine)
    now = 0.0
    tested = np.zeros(n, bool)
    for _ in range(600):
        now += float(rng.choice([0.0, 0.01, 0.1]))   # equal times too
        w = int(rng.integers(n))
        # capabilities from a small set: ties for the slowest
        c = float(rng.choice([0.05, 0.1, 0.2, 0.4]))
        op = rng.random()
        if not tested.all() and (not tested[w] or op < 0.3):
            got = fe._capability_test(engine, index, w, c, now)
            want = rules.esync_capability_test(server, members, w, c, now)
            tested[w] = True
        elif op < 0.25:
            # a reset: only once every worker is in w's round or later (the ring's rounds
            # differ by at most one), and sometimes for workers behind
            fe._new_round(engine, index, w, now)
            rules.esync_new_round(server, w, now)
            got = want = None
        else:
            got = fe._step(engine, index, w, c, now, eps)
            want = rules.esync_step(server, members, w, c, now, eps, False, 0.0)
        assert got == want
        _esync_tables_equal(engine, server)
    assert server.ready_count[0] > 0      # READY happened (SYNC answers were compared)


def _policy(policy, n, **kw):
    return make_policy(SyncConfig(policy=policy, topology="ps", **kw), n)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy,kw", [("ssp", {"staleness": 2}), ("ssp", {"staleness": 0}),
                                       ("dssp", {"staleness_low": 1, "staleness_high": 4}),
                                       ("dssp", {"staleness_low": 0, "staleness_high": 3}),
                                       ("bsp", {}), ("asp", {})])
def test_ps_engine_pull_rules_are_the_policy_objects(policy, kw, seed):
    # pushes from random workers (one straggler pushing rarely: gaps beyond the bounds, the
    # DSSP controller granting), then every worker's pull asked of both
    rng = np.random.default_rng(seed)
    n = 7
    pol = _policy(policy, n, **kw)
    pol.t.registered[:] = True
    kind = fp._KINDS[{"ssp": "staleness", "dssp": "dynamic_staleness", "bsp": "in_step",
                      "asp": "no_wait"}[policy]]
    s = 0 if policy == "bsp" else kw.get("staleness", 0)
    s_low, s_high = kw.get("staleness_low", 0), kw.get("staleness_high", 0)
    pushes, table = np.zeros(n, np.int64), np.zeros((n, 2))
    r_extra, held = np.zeros(n, np.int64), np.zeros(n, np.bool_)
    hist, lo, hi = new_counts(n), 0, 0
    slowest = new_lowest_at_min()
    now = 0.0
    decisions = set()
    for _ in range(400):
        now += float(rng.exponential(0.05))
        w = int(rng.integers(n))
        if w == 0 and rng.random() < 0.7:
            w = 1
        pol.on_push(w, now)
        old = fp._record_push(w, now, pushes, table)
        hist, lo, hi, _ = count_up(hist, old, lo, hi)
        if kind == fp.DSSP:
            fp._dssp_push(w, pushes, lo, hi, r_extra, held, table, s_low, s_high, slowest)
        np.testing.assert_array_equal(pushes, pol.t.pushes)
        for v in range(n):
            want = pol.may_pull(v)
            got = fp._may_pull(kind, pushes[v], lo, s, s_low, held[v])
            if got:
                held[v] = False
            assert got == want, (v, pushes.tolist())
            decisions.add(want)
    assert decisions == ({True} if policy == "asp" else {True, False})


@pytest.mark.parametrize("seed", range(4))
def test_bsp_step_rule_on_the_lowest_round_is_the_policy_objects(seed):
    rng = np.random.default_rng(seed)
    n = 6
    pol = _policy("bsp", n)
    rounds = np.zeros(n, np.int64)
    hist, lo, hi = new_counts(n), 0, 0
    answers = set()
    for _ in range(300):
        w = int(rng.integers(n))
        if rng.random() < 0.5 and rounds[w] <= lo:      # a reset: at most a round ahead
            pol.on_reset(w, int(rounds[w] + 1), 0.0)
            old = int(rounds[w])
            rounds[w] += 1
            hist, lo, hi, _ = count_up(hist, old, lo, hi)
        want = pol.decide_held(w, 1, 0.0)
        got = rules.round_pulled(lo, rounds[w])
        assert got == (want is not None) and (want is None or want[0] == SYNC)
        answers.add(got)
    assert answers == {True, False}

