"""The sharded parameter server's push-and-pull request (``PUSH_PULL``) as a rule both serve
loops can run: count the push the shards have applied, then grant the pull after it.

The Python loop runs it through the policy objects (``_handlers._on_push_pull``: the store's
version, ``Policy.on_push``, ``may_pull``, ``sure_pulls``); the compiled loop
(``_fastpath``) runs :func:`ps_push_pull` on the same arrays, for the policies whose pull
rule is the plain staleness bound and whose push is only counted, ASP (no bound) and SSP
(``staleness``), and for DSSP's pushes that its Alg. 1 grants without the controller: an
extra iteration the controller granted earlier (lines 3-5) or a push within s_L (lines
7-9).  Where the pull would be held, or DSSP's controller (Alg. 2, lines 11-17) must rule,
it hands the request, untouched, to the Python loop (:func:`ps_pull_granted` decides that
before anything is written), which also keeps every other policy's ``PUSH_PULL`` (BSP's
rounds, ElasticBSP's and ESync's).

The arrays are shared with ``policies.WorkerTable`` (``pushes``, ``push_table``,
``final_pushed``, ``done``) and ``_stats.ServerCounters`` (``counted``, ``pulls``), and
``cells`` holds what the Python side keeps as attributes (``WeightStore.version``,
``ServerCounters.max_gap``) and the rule's setting (``PS_BOUND``, ``PS_DSSP``) and state
(``PS_READY``).  DSSP's per-worker state (``r_extra``, ``held``) is the policy object's own
arrays (``DSSP.compiled_controller``).

Every jitted rule has a plain-Python reference beside it, compared on random tables by
``tests/test_server_rules.py``; ``tests/test_server_fastpath.py`` checks that the compiled
loop leaves the tables, the counters, the events and the reply exactly as the Python loop.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpsync.sched._numba import jit

__all__ = ["PSTables", "new_ps_tables", "ps_pull_granted", "ps_pull_granted_reference",
           "ps_push_pull", "ps_push_pull_reference", "PS_VERSION", "PS_MAX_GAP", "PS_BOUND",
           "PS_READY", "PS_SERVED", "PS_DSSP", "BOUND_NONE", "NOT_SERVED"]

# ``PSTables.cells``: the store's version (pushes counted over the whole model), the largest
# push-count lead over the slowest active worker at a pull, the bound the compiled loop
# serves (``BOUND_NONE``: no bound, ASP; ``NOT_SERVED``: the Python loop serves every
# ``PUSH_PULL``), 1 once the model is on the shards (the first worker's ``ps_init``), and
# how many ``PUSH_PULL`` the compiled loop served; 1 where the rule is DSSP's (``PS_BOUND`` is
# then its s_L).
PS_VERSION, PS_MAX_GAP, PS_BOUND, PS_READY, PS_SERVED, PS_DSSP = 0, 1, 2, 3, 4, 5
BOUND_NONE, NOT_SERVED = -1, -2


class PSTables(NamedTuple):
    """The per-worker arrays a ``PUSH_PULL`` writes, and the shared cells (module doc)."""
    pushes: np.ndarray        # int64: pushes counted (the staleness rules' t_i)
    push_table: np.ndarray    # float64 (n, 2): the two latest push times
    final_pushed: np.ndarray  # bool: sent its last update
    done: np.ndarray          # bool: shut down
    counted: np.ndarray       # int64: pushes, for the stats
    pulls: np.ndarray         # int64: pulls answered, for the stats
    cells: np.ndarray         # int64 (6,): PS_VERSION ... PS_DSSP
    r_extra: np.ndarray       # int64: DSSP's r_p, the extra iterations granted and not run
    held: np.ndarray          # bool: DSSP's pull held by Alg. 1 line 17
    unawaited: np.ndarray     # bool: its next PUSH_PULL's reply is collected later (ASP)


def new_ps_tables(pushes, push_table, final_pushed, done, counted, pulls,
                  controller=None, unawaited=None) -> PSTables:
    """The tables over the server's arrays; ``controller``: DSSP's ``(r_extra, held)``
    (its rule is then compiled too, ``PS_DSSP``), None for every other policy;
    ``unawaited``: the server table's (None: an array of its own)."""
    cells = np.zeros(6, np.int64)
    cells[PS_BOUND] = NOT_SERVED
    n = pushes.shape[0]
    if controller is None:
        r_extra, held = np.zeros(n, np.int64), np.zeros(n, np.bool_)
    else:
        r_extra, held = controller
        cells[PS_DSSP] = 1
    if unawaited is None:
        unawaited = np.zeros(n, np.bool_)
    return PSTables(pushes, push_table, final_pushed, done, counted, pulls, cells, r_extra,
                    held, unawaited)


@jit
def ps_pull_granted(tables, ps, w):
    """Would the pull of worker ``w``'s ``PUSH_PULL`` (not its last push) be granted once its
    push is counted?  ``Policy.may_pull`` after ``on_push``: no bound, or within it, SSP's
    rule (``policies.pull_within_staleness``: the lead of ``w`` over the slowest worker that
    is active and has not pushed its last update, counting this push, at most the bound).
    DSSP (``PS_DSSP``, the bound its s_L): an extra iteration left (Alg. 1 lines 3-5) or
    within s_L (lines 7-9); False where its controller would rule (lines 11-17)."""
    bound = ps.cells[PS_BOUND]
    if bound == BOUND_NONE:
        return True
    dssp = ps.cells[PS_DSSP] == 1
    if ps.final_pushed[w] or ps.done[w] or tables.removed[w]:
        # Not among the workers the rule compares; DSSP's bookkeeping for it is Python's.
        return not dssp
    if dssp and ps.r_extra[w] > 0:
        return True
    mine = ps.pushes[w] + 1
    slowest = mine
    for i in range(ps.pushes.shape[0]):
        if i != w and not (ps.done[i] or tables.removed[i] or ps.final_pushed[i]):
            if ps.pushes[i] < slowest:
                slowest = ps.pushes[i]
    return mine - slowest <= bound


def ps_pull_granted_reference(tables, ps, w) -> bool:
    bound = int(ps.cells[PS_BOUND])
    if bound == BOUND_NONE:
        return True
    dssp = bool(ps.cells[PS_DSSP])
    compared = [i for i in range(len(ps.pushes))
                if not (ps.done[i] or tables.removed[i] or ps.final_pushed[i])]
    if w not in compared:
        return not dssp
    if dssp and ps.r_extra[w] > 0:
        return True
    counts = [int(ps.pushes[i]) + (i == w) for i in compared]
    return counts[compared.index(w)] - min(counts) <= bound


@jit
def ps_push_pull(tables, ps, w, now):
    """Count worker ``w``'s push, received at ``now`` (not its last: a last push goes to the
    Python loop), and book the pull granted after it (:func:`ps_pull_granted` said so);
    returns the further pulls sure to be granted (the reply's ``R_EXTRA``).  What
    ``_count_push`` and ``_answer_pull`` write, in their order: the version, the stats,
    ``Policy.on_push`` (DSSP's: r_p and the held flag), the pacing of a worker that reports
    no steps, then the pull's count and the largest lead, and whether the worker's next
    ``PUSH_PULL`` is one whose reply it collects later (``unawaited``: no bound, ASP).
    (Events are logged by the caller, which knows the clock origin.)"""
    ps.cells[PS_VERSION] += 1
    ps.counted[w] += 1
    ps.pushes[w] += 1
    ps.push_table[w, 0] = ps.push_table[w, 1] if ps.pushes[w] > 1 else now
    ps.push_table[w, 1] = now
    if not tables.compute[w] > 0:
        last = tables.last_event[w]
        if last == last:
            tables.interval[w] = now - last
        tables.last_event[w] = now
    ps.pulls[w] += 1
    n = ps.pushes.shape[0]
    lowest_active = -1  # among the workers the rule compares (``_answer_pull``'s gap)
    for i in range(n):
        if not (ps.done[i] or tables.removed[i] or ps.final_pushed[i]):
            if lowest_active < 0 or ps.pushes[i] < lowest_active:
                lowest_active = ps.pushes[i]
    if lowest_active >= 0 and not ps.final_pushed[w]:
        gap = ps.pushes[w] - lowest_active
        if gap > ps.cells[PS_MAX_GAP]:
            ps.cells[PS_MAX_GAP] = gap
    bound = ps.cells[PS_BOUND]
    ps.unawaited[w] = bound == BOUND_NONE
    if bound < 0 or ps.done[w] or ps.final_pushed[w]:
        return 0
    dssp = ps.cells[PS_DSSP] == 1
    if dssp:
        # ``DSSP.on_push`` where Alg. 1 grants without the controller: an extra iteration
        # used up (lines 3-5), or r_p stays 0 (lines 7-9); the pull is not held.
        if ps.r_extra[w] > 0:
            ps.r_extra[w] -= 1
        ps.held[w] = False
    slowest = ps.pushes[w]
    for i in range(n):
        if not (ps.done[i] or ps.final_pushed[i]) and ps.pushes[i] < slowest:
            slowest = ps.pushes[i]
    sure = max(0, bound - (ps.pushes[w] - slowest))
    if dssp and ps.r_extra[w] > sure:
        sure = ps.r_extra[w]     # (``DSSP.sure_pulls``: the larger of the two)
    return sure


def ps_push_pull_reference(tables, ps, w, now) -> int:
    ps.cells[PS_VERSION] += 1
    ps.counted[w] += 1
    ps.pushes[w] += 1
    ps.push_table[w] = (ps.push_table[w, 1] if ps.pushes[w] > 1 else now, now)
    if not tables.compute[w] > 0:
        if not np.isnan(tables.last_event[w]):
            tables.interval[w] = now - tables.last_event[w]
        tables.last_event[w] = now
    ps.pulls[w] += 1
    active = ~(ps.done | tables.removed | ps.final_pushed)
    if active.any() and not ps.final_pushed[w]:
        ps.cells[PS_MAX_GAP] = max(int(ps.cells[PS_MAX_GAP]),
                                   int(ps.pushes[w] - ps.pushes[active].min()))
    bound = int(ps.cells[PS_BOUND])
    going = ~(ps.done | ps.final_pushed)
    ps.unawaited[w] = bound == BOUND_NONE
    if bound < 0 or not going[w]:
        return 0
    extra = 0
    if ps.cells[PS_DSSP]:
        ps.r_extra[w] = max(0, int(ps.r_extra[w]) - 1)
        ps.held[w] = False
        extra = int(ps.r_extra[w])
    return max(extra, bound - int(ps.pushes[w] - ps.pushes[going].min()))
