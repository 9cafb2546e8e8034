"""The state server's per-message rules (``mpsync.server.rules``): every jitted rule against its
plain-Python reference on seeded random tables and messages, the way ``mpsync.sched``'s kernels
are tested.  One process, no MPI: what both serve loops do with a message is decided here."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from mpsync.server import rules, wire as W

N = 6


def _random_state(rng, n=N):
    """Random but consistent tables for ``n`` workers (some NaNs where a value is unknown)."""
    t = rules.new_tables(n)
    t.iteration[:] = rng.integers(0, 50, n)
    t.last_event[:] = np.where(rng.random(n) < 0.2, np.nan, rng.random(n) * 10)
    t.interval[:] = np.where(rng.random(n) < 0.2, np.nan, rng.random(n))
    t.compute[:] = rng.random(n) * 0.1
    t.round[:] = rng.integers(0, 5, n)
    t.in_sync[:] = rng.random(n) < 0.3
    t.waiting[:] = rng.random(n) < 0.3
    t.last_heard[:] = rng.random(n) * 10
    c = rules.new_counters(n)
    for a in c:
        a[:] = rng.integers(0, 100, n) if a.dtype == np.int64 else rng.random(n)
    ev = rules.new_events(8)
    ev.count[0] = rng.integers(0, 20)
    es = rules.new_esync_tables(n, 4)
    es.k[:] = rng.integers(0, 4, n)
    es.capability[:] = rng.random(n) * 0.1 + np.where(rng.random(n) < 0.3, 0.0, 0.01)
    es.last_finish[:] = rng.random(n) * 10
    es.ready[:] = rng.random(n) < 0.3
    es.rounds[:] = rng.integers(3, 5, n)
    es.rtt[:] = rng.random(n) * 1e-3
    es.ready_count[0] = rng.integers(0, 5)
    eb = rules.new_ebsp_tables(n)
    eb.target[:] = np.where(rng.random(n) < 0.3, -1, rng.integers(0, 60, n))
    eb.reports[:] = rng.integers(0, 10, n)
    return {"tables": t, "counters": c, "events": ev, "esync": es, "ebsp": eb}


def _same(a: dict, b: dict, where: str) -> None:
    for group in a:
        for name, x in a[group]._asdict().items():
            y = getattr(b[group], name)
            assert x.dtype == y.dtype and x.shape == y.shape, (where, group, name)
            assert x.tobytes() == y.tobytes(), (
                f"{where}: {group}.{name} differs\njitted:    {x!r}\nreference: {y!r}")


def _both(seed, call):
    """Run ``call(rule_module_lookup, state)`` with the jitted rules on one copy of a random
    state and the references on another; both results and every array must agree."""
    rng = np.random.default_rng(seed)
    state = _random_state(rng)
    twin = copy.deepcopy(state)
    got = call(lambda name: getattr(rules, name), state)
    want = call(lambda name: getattr(rules, name + "_reference"), twin)
    _same(state, twin, f"seed {seed}")
    return got, want


@pytest.mark.parametrize("seed", range(40))
def test_recording_rules_equal_their_references(seed):
    rng = np.random.default_rng(1000 + seed)
    w = int(rng.integers(0, N))
    k, compute, now = int(rng.integers(0, 100)), float(rng.random()), float(10 + rng.random())

    def call(rule, s):
        rule("record_report")(s["tables"], w, k, compute, now)
        rule("count_step")(s["counters"], w, compute, 0.25)
        rule("record_heard")(s["tables"], w, now)
        rule("record_reset")(s["tables"], (w + 1) % N, 7, now)
        rule("count_reset")(s["counters"], (w + 1) % N, 0.5)
        rule("log_event")(s["events"], now, w, rules.K_REPORT, k)
        for action in (W.SYNC, W.LOCAL):
            rule("record_answer")(s["tables"], s["counters"], s["events"], w, action, now)
        reply = np.zeros(W.MSG_LEN)
        rule("fill_reply")(reply, W.LOCAL, 3, 4, 5, 6, 7, 8)
        return reply.tolist()

    got, want = _both(seed, call)
    assert got == want


@pytest.mark.parametrize("seed", range(60))
def test_decision_rules_equal_their_references(seed):
    rng = np.random.default_rng(2000 + seed)
    w = int(rng.integers(0, N))
    members = np.arange(N) if seed % 2 else np.sort(np.unique(np.append(
        rng.choice(N, size=3, replace=False), w)))
    delayed = bool(seed % 3 == 0)
    k, compute, now = int(rng.integers(0, 60)), float(rng.random() * 0.1), float(10 + rng.random())

    def call(rule, s):
        out = []
        for kind in (rules.FAST_BASE, rules.FAST_ESYNC, rules.FAST_EBSP):
            action, local = rule("fast_decision")(kind, s["esync"], s["ebsp"], members, w, k,
                                                   compute, now, 0.002, delayed, 1e-4)
            out.append((int(action), int(local)))
        out.append(tuple(int(x) for x in rule("ebsp_decide")(s["ebsp"], (w + 1) % N, k)))
        rule("esync_new_round")(s["esync"], (w + 2) % N, now)
        out.append(int(rule("esync_capability_test")(s["esync"], members, (w + 3) % N,
                                                      compute, now)))
        rule("ebsp_new_superstep")(s["ebsp"], (w + 4) % N)
        for kind in (rules.FAST_BASE, rules.FAST_ESYNC, rules.FAST_EBSP):
            for tag in (W.STEP, W.RESET):
                out.append(bool(rule("fast_hands_over")(kind, tag, k % 2, seed % 2 - 1,
                                                        s["ebsp"], w)))
        return out

    got, want = _both(seed, call)
    assert got == want


def test_esync_step_sends_ready_to_the_slowest_and_not_ready_to_a_fast_worker_in_its_shadow():
    """A hand-checked Alg. 2 case: worker 1 (0.3 s per iteration) is the slowest; worker 0
    (0.1 s) finished at t=10.0 with worker 1's next iteration due at 10.25: one more local
    iteration fits, so NOT-READY; worker 1 itself is always READY (line 6)."""
    es = rules.new_esync_tables(2)
    es.capability[:] = [0.1, 0.3]
    es.last_finish[:] = [9.9, 9.95]
    es.k[:] = [1, 1]
    members = np.arange(2)
    assert rules.esync_step(es, members, 0, 0.1, 10.0, 0.0, False, 0.0) == W.LOCAL
    assert rules.esync_step(es, members, 1, 0.3, 10.25, 0.0, False, 0.0) == W.SYNC
    assert es.ready.tolist() == [False, True] and es.k.tolist() == [2, 2]
    assert es.ready_log[:es.ready_count[0]].tolist() == [[1, 2]]
    # Delayed ACK (§4.2): once READY, further reports of the round get LOCAL, and the
    # capability includes the query round trip.
    assert rules.esync_step(es, members, 1, 0.3, 10.3, 0.0, True, 0.05) == W.LOCAL
    assert es.rtt[1] == 0.05


def test_ebsp_trains_on_while_monitored_and_counts_down_to_the_barrier():
    eb = rules.new_ebsp_tables(2)
    # No barrier planned (the monitoring phase): keep training, reports counted.
    assert rules.ebsp_step(eb, 0, 5) == (W.LOCAL, 0) and eb.reports[0] == 1
    eb.target[0] = 8
    assert rules.ebsp_decide(eb, 0, 5) == (W.LOCAL, 3)
    assert rules.ebsp_step(eb, 0, 8) == (W.SYNC, 0) and eb.reports[0] == 2
    eb.barrier_pushed[0] = True
    rules.ebsp_new_superstep(eb, 0)
    assert (eb.target[0], eb.reports[0], eb.barrier_pushed[0]) == (-1, 0, False)


def test_esync_gives_no_ready_before_every_worker_pulled_the_last_round():
    """Worker 0 is in round 4, worker 1 (not the slowest) still in round 3 (its pull of the
    last aggregate has not been reset yet): worker 0 would be READY by Alg. 2 alone (it is the
    slowest), but gets NOT-READY until worker 1 has pulled; its record is written anyway."""
    es = rules.new_esync_tables(2)
    es.capability[:] = [0.3, 0.1]
    es.rounds[:] = [4, 3]
    members = np.arange(2)
    assert rules.esync_step(es, members, 0, 0.3, 10.0, 0.0, False, 0.0) == W.LOCAL
    assert (es.k[0], es.capability[0], es.last_finish[0]) == (1, 0.3, 10.0)
    es.rounds[1] = 4
    assert rules.esync_step(es, members, 0, 0.3, 10.3, 0.0, False, 0.0) == W.SYNC


def test_esync_capability_test_is_not_ready_and_held_until_every_capability_is_known():
    """ESync Alg. 1 line 3 and line 8 with k = 0."""
    es = rules.new_esync_tables(3)
    members = np.arange(3)
    assert rules.esync_capability_test(es, members, 1, 0.2, 5.0) == rules.HOLD
    assert rules.esync_capability_test(es, members, 0, 0.1, 5.1) == rules.HOLD
    assert rules.esync_capability_test(es, members, 2, 0.4, 5.2) == W.LOCAL
    assert es.capability.tolist() == [0.1, 0.2, 0.4] and es.k.tolist() == [0, 0, 0]
    # Over the active workers only: a worker taken out does not hold the others.
    es2 = rules.new_esync_tables(3)
    assert rules.esync_capability_test(es2, np.array([0, 2]), 0, 0.1, 1.0) == rules.HOLD
    assert rules.esync_capability_test(es2, np.array([0, 2]), 2, 0.1, 1.0) == W.LOCAL


def test_the_compiled_loop_hands_over_monitoring_steps_resets_and_capability_tests():
    eb = rules.new_ebsp_tables(2)
    eb.target[1] = 7
    assert rules.fast_hands_over(rules.FAST_EBSP, W.STEP, 3, 0, eb, 0)      # monitoring
    assert not rules.fast_hands_over(rules.FAST_EBSP, W.STEP, 3, 0, eb, 1)  # planned
    eb.reports[0] = rules.EBSP_MONITOR_REPORTS   # monitored, waiting for the others: LOCAL
    assert not rules.fast_hands_over(rules.FAST_EBSP, W.STEP, 3, 0, eb, 0)
    assert rules.fast_hands_over(rules.FAST_EBSP, W.RESET, 3, 0, eb, 1)
    assert rules.fast_hands_over(rules.FAST_ESYNC, W.STEP, 0, -1, eb, 0)
    assert not rules.fast_hands_over(rules.FAST_ESYNC, W.STEP, 1, -1, eb, 0)
    assert not rules.fast_hands_over(rules.FAST_BASE, W.STEP, 0, -1, eb, 0)


def test_the_request_check_accepts_exactly_what_its_reference_accepts_and_says_why():
    from hypothesis import given, settings, strategies as st

    special = st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, -1e-300, 2.0 ** 53 - 1, 2.0 ** 53,
                               2.0 ** 60, 1e300, float("nan"), float("inf"), float("-inf")])
    slot = st.one_of(special, st.floats(), st.integers(0, 100).map(float))

    @settings(max_examples=3000, deadline=None, database=None)
    @given(st.lists(slot, min_size=8, max_size=8))
    def check(msg):
        code = rules.request_problem_reference(msg)
        assert rules.request_problem(np.array(msg)) == code, msg
        assert (rules.describe_problem(msg) is None) == (code == 0)
        ok = all(math.isfinite(v) for v in msg) and all(
            0 <= msg[i] < 2 ** 53 and msg[i] == int(msg[i]) for i in (0, 1, 3, 6, 7)) and all(
            msg[i] >= 0 for i in (2, 4, 5))
        assert ok == (code == 0), msg

    check()
    assert rules.describe_problem([1.0, 2.0, 0.01, 0.0, 0.0, 0.0, 0.0, 1.0]) is None
    assert rules.describe_problem([1.0, 2.5, 0, 0, 0, 0, 0, 0]).startswith("iteration 2.5")
    assert rules.describe_problem([1.0, 2.0, -0.5, 0, 0, 0, 0, 0]) == "negative time"
    assert rules.describe_problem([1.0, float("nan"), 0, 0, 0, 0, 0, 0]) == \
        "NaN or inf in the message"


def test_next_report_due_is_the_earliest_computing_workers_last_event_plus_its_compute():
    t = rules.new_tables(4)
    gone = np.zeros(4, dtype=bool)
    assert rules.next_report_due(t, gone) is None          # nothing known yet
    t.last_event[:] = [10.0, 10.2, 10.1, 9.0]
    t.compute[:] = [0.5, 0.1, 0.0, 0.2]
    t.interval[:] = [0.6, 0.2, 0.7, np.nan]
    assert rules.next_report_due(t, gone) == pytest.approx(9.2)   # worker 3
    gone[3] = True
    assert rules.next_report_due(t, gone) == pytest.approx(10.3)  # worker 1: 10.2 + 0.1
    t.in_sync[1] = True                       # aggregating: its next message is a reset
    assert rules.next_report_due(t, gone) == pytest.approx(10.5)  # worker 0
    t.waiting[0] = True                       # waiting for the server
    assert rules.next_report_due(t, gone) == pytest.approx(10.8)  # worker 2: no compute time
    gone[2] = True
    assert rules.next_report_due(t, gone) is None


def test_the_python_loop_and_the_compiled_loop_call_the_same_rules():
    """No copy of a rule outside ``rules``: the compiled loop names the rules it calls, and no
    message slot is indexed by number outside the wire module."""
    import re
    from pathlib import Path

    server = Path(rules.__file__).parent
    for path in server.glob("*.py"):
        if path.name != "wire.py":
            assert not re.search(r"(reply|msg|_rep|_req|msgs)\[\d\]", path.read_text()), path
    compiled = (server / "_fastpath.py").read_text()
    start = compiled.index("def _serve(")
    serve = compiled[start:compiled.index("\n\n\n", start)]
    for rule in ("request_problem", "record_heard", "record_report", "count_step",
                 "fast_decision", "record_answer", "fill_reply", "record_reset",
                 "count_reset", "esync_new_round", "log_event"):
        assert f"rules.{rule}(" in serve, rule
