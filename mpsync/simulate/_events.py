"""The exact engine: one event at a time, every decision made by the real policy object.

Workers follow the strategies of ``mpsync.torch.strategies`` (compute, report, then on SYNC a
ring collective or a push and a pull through the parameter server, then reset), the server
answers through :class:`~mpsync.simulate._adapter.PolicyDriver`.  Cost: a few µs of Python per
event plus the policy's own work, so it is the reference and the engine for small runs and
trace replays; :mod:`mpsync.simulate._fast` is the one for thousands of workers.
"""

from __future__ import annotations

import heapq

import numpy as np

from mpsync.server.wire import SYNC
from mpsync.simulate._adapter import PolicyDriver
from mpsync.simulate._stats import Recorder

__all__ = ["run_events"]

# event kinds, ordered so that at equal times a server message is handled before a worker
# acts on a reply sent at that same instant
_SRV_STEP, _SRV_RESET, _SRV_PUSH, _SRV_PULL, _DONE, _REPLY, _AGG_DONE, _PULLED = range(8)


def run_events(config, speeds, cost, *, iterations=None, duration=None, batch_size=32):
    """Simulate ``config.policy`` on ``speeds`` until ``n * iterations`` worker iterations are
    done in total or the virtual clock reaches ``duration``; returns a :class:`Recorder`."""
    n = speeds.n
    drv = PolicyDriver(config, n)
    ps = config.topology == "ps"
    rec = Recorder(n, ps=ps, batch_size=batch_size)
    heap: list = []
    seq = 0

    def push_event(t, kind, w, arg=None):
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, kind, seq, w, arg))

    half = cost.query / 2
    k = np.zeros(n, dtype=np.int64)          # iterations done per worker
    rnd = np.zeros(n, dtype=np.int64)        # rounds completed per worker
    last_c = np.zeros(n)
    held: list = []                          # (kind, w, k) replies the policy holds
    entered: list = []                       # ring: workers in the current collective
    enter_max = 0.0
    link_free = 0.0                          # PS: when the server's link is free again
    total_target = None if iterations is None else n * iterations
    osp_ics = config.osp_ics_max_fraction if config.policy == "osp" else 0.0

    pause = speeds.pause

    def start_iteration(w, t):
        c = speeds.time_of(w, t)
        last_c[w] = c
        if pause is not None and pause[w] > 0:
            rec.pause(w, t, pause[w])
            t += pause[w]
        else:
            rec.phase(w, "compute", t)
        push_event(t + c, _DONE, w)

    def link(t):
        nonlocal link_free
        if not cost.shared_link:
            return t + cost.link()
        link_free = max(t, link_free) + cost.link()
        return link_free

    def answer(w, decision, now):
        action = decision[0]
        if action == SYNC:
            rec.sync(w)
        push_event(now + half, _REPLY, w, action)

    def retry_held(now):
        nonlocal held
        still = []
        for item in held:
            kind, w, kw = item
            if kind == _SRV_STEP:
                d = drv.retry(w, kw, now)
                if d is None:
                    still.append(item)
                else:
                    answer(w, d, now)
            elif drv.may_pull(w):
                rec.staleness(drv.staleness(w))
                push_event(link(now) + half, _PULLED, w)
            else:
                still.append(item)
        held = still

    for w in range(n):
        start_iteration(w, 0.0)
    t_end = 0.0
    while heap:
        t, kind, _, w, arg = heapq.heappop(heap)
        if duration is not None and t > duration:
            t_end = duration
            break
        t_end = t
        if kind == _DONE:
            k[w] += 1
            rec.iteration(w, last_c[w])
            rec.phase(w, "wait", t)
            push_event(t + half, _SRV_STEP, w, last_c[w])
            if total_target is not None and rec.total_iterations >= total_target:
                break
        elif kind == _SRV_STEP:
            rec.message()
            d = drv.step(w, int(k[w]), arg, t)
            if d is None:
                held.append((_SRV_STEP, w, int(k[w])))
            else:
                answer(w, d, t)
        elif kind == _REPLY:
            if arg != SYNC:
                rec.local(w)
                start_iteration(w, t)
            elif ps:
                rec.phase(w, "aggregate", t)
                push_event(link(t), _SRV_PUSH, w)
            else:
                rec.phase(w, "aggregate", t)
                entered.append(w)
                enter_max = max(enter_max, t)
                if len(entered) == n:
                    blocking = cost.ring(n, 1.0 - osp_ics)
                    # OSP's In-Computation Sync overlaps the next iteration; what does not
                    # fit under the shortest next compute is paid on top.
                    hidden = max(0.0, cost.ring(n, osp_ics) - float(last_c.min())) \
                        if osp_ics else 0.0
                    done = enter_max + blocking + hidden
                    rec.aggregation_cost(blocking + hidden, n)
                    for v in entered:
                        push_event(done, _AGG_DONE, v)
                    entered, enter_max = [], 0.0
        elif kind == _AGG_DONE or kind == _PULLED:
            rnd[w] += 1
            if kind == _PULLED:
                rec.aggregation_cost(2 * cost.link(), 1)
            push_event(t + half, _SRV_RESET, w, int(rnd[w]))
            start_iteration(w, t)
            rec.round(w)
        elif kind == _SRV_RESET:
            rec.message()
            drv.reset(w, arg, t)
        elif kind == _SRV_PUSH:
            rec.message()
            drv.push(w, t)
            # the push's reply goes back and the pull request comes in: one query round trip
            push_event(t + cost.query, _SRV_PULL, w)
        elif kind == _SRV_PULL:
            rec.message()
            if drv.may_pull(w):
                rec.staleness(drv.staleness(w))
                push_event(link(t) + half, _PULLED, w)
            else:
                held.append((_SRV_PULL, w, 0))
        if held and kind in (_SRV_STEP, _SRV_RESET, _SRV_PUSH, _SRV_PULL):
            retry_held(t)
    rec.finish(t_end)
    rec.policy_state = drv.describe()
    return rec
