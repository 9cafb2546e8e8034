"""The state server's ``auto`` policy driven on a virtual clock, without MPI: four ring workers
that step, report their training loss, are held or told SYNC, and reset together once all four
were told SYNC; the ranking runs in its real helper process.  Shared by the tests that watch
what auto does with the losses (``test_auto_stability``, ``test_auto_progress``)."""

from __future__ import annotations

import math
import time

import numpy as np


class RingDriver:
    """``pol``: an ``AutoPolicy`` on the ring; ``loss_at(now, iterations)``: the training
    loss a worker reports at an iteration (a lognormal spread of ``noise`` around it)."""

    def __init__(self, pol, loss_at, *, seed: int = 3, noise: float = 0.2,
                 tick_s: float = 0.01):
        self.pol, self.loss_at, self.noise = pol, loss_at, noise
        self.rng = np.random.default_rng(seed)
        self.tick_s, self.now = tick_s, 0.0
        n = pol.t.n
        self.k, self.state, self.due = [0] * n, ["step"] * n, [0.0] * n

    def run(self, period_s, until, limit_s) -> bool:
        """Workers stepping every period_s[w] for up to ``limit_s`` of the virtual clock;
        True as soon as ``until()`` holds."""
        from mpsync.server.wire import SYNC

        pol, n = self.pol, len(period_s)
        end = self.now + limit_s
        while self.now < end:
            self.now = now = round(self.now + self.tick_s, 6)
            for w in range(n):
                d = None
                if self.state[w] == "step" and now >= self.due[w]:
                    self.k[w] += 1
                    loss = self.loss_at(now, pol.steps_done)
                    pol.on_loss(w, self.k[w], loss * math.exp(self.rng.normal(0.0, self.noise)),
                                1, now)
                    d = pol.on_step(w, self.k[w], period_s[w], now)
                    self.state[w] = "held"
                elif self.state[w] == "held":
                    d = pol.decide_held(w, self.k[w], now)
                if d is not None:
                    self.state[w] = "agg" if d[0] == SYNC else "step"
                    self.due[w] = now + period_s[w]
            if all(s == "agg" for s in self.state):
                for w in range(n):
                    pol.on_reset(w, int(pol.t.round[w]) + 1, now + 0.002)
                    self.state[w], self.due[w] = "step", now + period_s[w]
            # Real time for the helper's answer: 60 s of this clock is 12 s or more of the
            # machine's, room for the helper's start (its imports) on a loaded host.
            time.sleep(0.002)
            if until():
                return True
        return False


def ring_auto(n: int = 4):
    """``auto`` on the ring only, started on BSP (its rounds drive the driver), with no
    exploring first decision, its helper warmed up."""
    from mpsync.config import SyncConfig
    from mpsync.server.policies import make_policy

    pol = make_policy(SyncConfig(policy="auto", auto_ps=False).validate(), n)
    pol.decider.explore = False
    pol._start_on(pol.candidates[0], measuring=False)   # (BSP: its rounds drive this)
    pol.warm_up()
    return pol
