"""More than one ``DistributedOptimizer`` in a process (a GAN's generator and discriminator,
two models trained one after the other): the first one made is the *leader*; it alone talks
to the state server, and every later one *follows* its rounds.

A follower never reports to the server, so the server sees one worker doing one iteration per
leader step, as its policy expects, and two optimizers can never be told SYNC at different
points on different workers (which desynchronised the ranks: one worker aggregating the first
model while another aggregated the second).  Under a policy that aggregates every step (BSP)
a follower aggregates at each of its own steps; under one with local steps (ESync,
ElasticBSP) it aggregates at its first step after the leader has aggregated.  A worker that
has joined, or whose leader aggregated in an idle iteration (while the script's own
collective waits), runs one follower round right after that leader round, which is what the
other workers do at their next follower step; so each optimizer is expected to step once per
iteration, in the same order on every worker (the usual training loop).  An optimizer that is
never stepped again takes part in nothing until the final join, where every worker runs it.
"""

from __future__ import annotations

import weakref

__all__ = ["Following", "leader_followers"]


class Following:
    """Mixed into :class:`~mpsync.torch.strategies.Strategy`."""

    leader = None            # the leader's strategy, on a follower
    _seen_round = 0          # the leader's round this follower last aggregated after

    def follow(self, leader) -> None:
        """Become a follower of ``leader`` (no server traffic of its own)."""
        self.leader, self.client = leader, None
        self.capability_test = self.delayed_ack = False
        self._seen_round = leader.round
        leader.__dict__.setdefault("_followers", []).append(weakref.ref(self))

    def join_as_leader(self) -> None:
        """``join()``, unless a follower (its rounds ran in its leader's join)."""
        if self.leader is None:
            self.join()

    def follow_decision(self):
        """None (aggregate now) or a LOCAL decision, from the leader's rounds."""
        from mpsync.server import LOCAL, Decision

        if self.aggregates_every_step or self.leader.round > self._seen_round:
            self._seen_round = self.leader.round
            return None
        return Decision(LOCAL, 0, 0)

    def followers_round(self, joined: bool = True) -> None:
        """After a round of this leader outside its own step (a join round, an idle
        iteration's round): each follower's round, contributing nothing if ``joined``."""
        for f in leader_followers(self):
            f.joined_round(joined)

    def joined_round(self, joined: bool = True) -> None:
        self._seen_round = self.leader.round
        was, self.joined = self.joined, joined or self.joined
        try:
            self.follower_aggregate()
        finally:
            self.joined = was


    def follower_aggregate(self) -> None:
        """This follower's aggregation (zeros or its local progress once it has joined)."""
        if self.aggregates_every_step:      # gradient averaging
            contributors, _ = self._average(0.0)
            if contributors:
                self.optimizer.step()
            return
        self._snapshot()                    # model-delta averaging
        self._aggregate(contributing=self.local_steps > 0)
        self.local_steps = 0


def leader_followers(strategy) -> list:
    """The followers of leader ``strategy`` still alive: a follower whose optimizer the script
    dropped runs no more rounds (held weakly; see ``_runtime.LiveOptimizers``)."""
    refs = strategy.__dict__.get("_followers", [])
    alive = [f for f in (r() for r in refs) if f is not None]
    if len(alive) < len(refs):
        strategy._followers = [weakref.ref(f) for f in alive]
    return alive
