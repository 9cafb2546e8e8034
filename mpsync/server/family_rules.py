"""The per-message rules of the policy families that decide on every step: ESync (Alg. 2
QUERY-STATE, the capability test of Alg. 1 and RESET-STATE-SERVER, §4.2 delayed ACK) and
ElasticBSP (the answer within a superstep, ZipLine §3 and Fig. 5).

Part of :mod:`mpsync.server.rules` (which re-exports everything here): jitted, MPI-free, each
rule with a plain-Python reference beside it, called by both serve loops and the policies.
"""

from __future__ import annotations

from mpsync.sched._numba import jit
from mpsync.sched.esync import esync_query_state, esync_reset
from mpsync.server import wire as W

__all__ = [
    "HOLD", "EBSP_MONITOR_REPORTS", "esync_step", "esync_step_reference",
    "esync_capability_test", "esync_capability_test_reference", "esync_new_round",
    "esync_new_round_reference", "ebsp_decide", "ebsp_decide_reference", "ebsp_step",
    "ebsp_step_reference", "ebsp_new_superstep", "ebsp_new_superstep_reference",
]

# A decision that cannot be made yet: the reply is held until the tables change.
HOLD = -1
# ElasticBSP's monitoring phase: reports per worker after a barrier before the next plan
# (ZipLine Fig. 5: "It requires at least two push requests per worker").
EBSP_MONITOR_REPORTS = 2


# -- ESync (Alg. 2 QUERY-STATE and RESET-STATE-SERVER, §4.2 delayed ACK) ------------------------

@jit
def esync_step(es, members, w, compute, now, eps, delayed, rtt):
    """ESync's answer to worker ``w``'s report: SYNC (READY) or LOCAL (NOT-READY), over the
    active workers ``members`` (sorted worker indices; all of them: the tables in place).

    Capability is the worker's last iteration time; in delayed-ACK mode (§4.2) it includes the
    query round trip ``rtt`` the worker measured, and a report sent before the round's READY
    reached the worker gets LOCAL (one READY per round).  t_e is the receipt time ``now``."""
    if delayed:
        es.rtt[w] = rtt
        if es.ready[w]:
            return W.LOCAL
    k_w = es.k[w] + 1
    cap = compute + es.rtt[w] if delayed else compute
    # Alg. 2 line 5 waits for the *slowest* device's PULL; a READY is given only once every
    # device has completed it, so on the PS no round-t+1 delta can reach the weights before a
    # slower-to-pull device has read w_{t+1} (on the ring the allreduce ends everywhere at once
    # and the two readings agree).
    for m in members:
        if es.rounds[m] < es.rounds[w]:
            es.k[w] = k_w
            es.capability[w] = cap
            es.last_finish[w] = now
            return W.LOCAL
    if members.shape[0] == es.k.shape[0]:
        ready = esync_query_state(es.k, es.capability, es.last_finish, es.ready, es.rounds,
                                  w, k_w, cap, now, now, eps)
    else:
        # Over the active workers only: a copy of their records, written back for w.
        p = 0
        while members[p] != w:
            p += 1
        ready = esync_query_state(es.k[members], es.capability[members],
                                  es.last_finish[members], es.ready[members],
                                  es.rounds[members], p, k_w, cap, now, now, eps)
        es.k[w] = k_w
        es.capability[w] = cap
        es.last_finish[w] = now
        if ready:
            es.ready[w] = True
    if not ready:
        return W.LOCAL
    i = es.ready_count[0]
    if i < es.ready_log.shape[0]:
        es.ready_log[i, 0] = w
        es.ready_log[i, 1] = k_w
        es.ready_count[0] = i + 1
    return W.SYNC


def esync_step_reference(es, members, w, compute, now, eps, delayed, rtt):
    from mpsync.sched.esync import esync_query_state_reference

    if delayed:
        es.rtt[w] = rtt
        if es.ready[w]:
            return W.LOCAL
    k_w = int(es.k[w]) + 1
    cap = compute + es.rtt[w] if delayed else compute
    members = [int(m) for m in members]
    if any(es.rounds[m] < es.rounds[w] for m in members):
        es.k[w], es.capability[w], es.last_finish[w] = k_w, cap, now
        return W.LOCAL
    records = [(m, int(es.k[m]), float(es.capability[m]), float(es.last_finish[m]),
                bool(es.ready[m]), int(es.rounds[m])) for m in members]
    records, ready = esync_query_state_reference(records, members.index(w), k_w, cap, now,
                                                 now, eps)
    for m, (_, k, c, f, r, rnd) in zip(members, records):
        es.k[m], es.capability[m], es.last_finish[m], es.ready[m], es.rounds[m] = k, c, f, r, rnd
    if not ready:
        return W.LOCAL
    if es.ready_count[0] < len(es.ready_log):
        es.ready_log[es.ready_count[0]] = (w, k_w)
        es.ready_count[0] = es.ready_count[0] + 1
    return W.SYNC


@jit
def esync_capability_test(es, members, w, c, now):
    """ESync Alg. 1 lines 3-8: the capability ``c`` a worker measured on one batch
    (RUN-BATCH-DATA-TEST) and its first QUERY-STATE with k = 0, which is always NOT-READY
    (Alg. 2 line 5).  The reply is held (``HOLD``) until every active worker's capability is
    known, so the first round's decisions compare real capabilities (without the test, the
    first reporter would find no slower device and be READY after one iteration)."""
    es.k[w] = 0
    es.capability[w] = c
    es.last_finish[w] = now
    for m in members:
        if not es.capability[m] > 0.0:
            return HOLD
    return W.LOCAL


def esync_capability_test_reference(es, members, w, c, now):
    es.k[w], es.capability[w], es.last_finish[w] = 0, c, now
    return HOLD if any(not es.capability[int(m)] > 0.0 for m in members) else W.LOCAL


@jit
def esync_new_round(es, w, now):
    """RESET-STATE-SERVER for ``w`` after its aggregation.  Rounds are counted here, not
    taken from the worker: a worker taken out for a while must not look "behind" forever
    (Alg. 2 line 5 would then hold everyone NOT-READY)."""
    esync_reset(es.k, es.last_finish, es.ready, es.rounds, w, es.rounds[w] + 1, now)


def esync_new_round_reference(es, w, now):
    es.k[w] = 0
    es.last_finish[w] = now
    es.ready[w] = False
    es.rounds[w] = es.rounds[w] + 1


# -- ElasticBSP: the answer within a superstep ----------------------------------------------------

@jit
def ebsp_decide(eb, w, k):
    """``(action, local_iters)`` for ``w`` at local iteration ``k``: SYNC once it reached its
    planned barrier, else LOCAL with the iterations left; ``(LOCAL, 0)`` while no barrier is
    planned for it (the monitoring phase of ZipLine Fig. 5: it trains on, asynchronously,
    while the server learns its iteration interval)."""
    if eb.target[w] < 0:
        return W.LOCAL, 0
    if k >= eb.target[w]:
        return W.SYNC, 0
    return W.LOCAL, eb.target[w] - k


def ebsp_decide_reference(eb, w, k):
    target = int(eb.target[w])
    if target < 0:
        return W.LOCAL, 0
    return (W.SYNC, 0) if k >= target else (W.LOCAL, target - k)


@jit
def ebsp_step(eb, w, k):
    """A report of ``w`` at iteration ``k``: counted (reports since its last barrier are the
    monitoring phase's pushes), then :func:`ebsp_decide`."""
    eb.reports[w] += 1
    return ebsp_decide(eb, w, k)


def ebsp_step_reference(eb, w, k):
    eb.reports[w] = eb.reports[w] + 1
    return ebsp_decide_reference(eb, w, k)


@jit
def ebsp_new_superstep(eb, w):
    """``w`` passed its barrier (its reset): no barrier is planned for it until the next
    monitoring phase has seen it report (ZipLine Fig. 5: the two phases repeat after every
    synchronization)."""
    eb.target[w] = -1
    eb.reports[w] = 0
    eb.barrier_pushed[w] = False


def ebsp_new_superstep_reference(eb, w):
    eb.target[w], eb.reports[w], eb.barrier_pushed[w] = -1, 0, False
