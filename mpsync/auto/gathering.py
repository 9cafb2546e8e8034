"""``auto`` leaving the parameter server: the round the PS policies do not have, made on the
state server.  Pure: it reads and writes the server's ``WorkerTable`` only.

ASP, SSP and DSSP have no round every worker takes part in, so a switch from the PS to the
ring makes one (:class:`Gathering`):

1. every worker's next step query is held (its local update is done, not yet pushed); a
   pull that SSP's or DSSP's bound would hold meanwhile is granted (``AutoPolicy.may_pull``):
   it waits for a slower worker's push, and that worker is held here until everyone is;
2. once every running worker is held, each is answered SYNC with the code of the ring policy
   to run next, and the common round ``R`` = 1 + the highest round any worker reset;
3. each pushes what it has not pushed yet; a pull of the switch is granted only once every
   held worker's switch push is in on every shard (:meth:`may_pull`), and nobody pushes
   again before the ring starts, so every worker pulls the same weights;
4. each worker then resets round ``R`` and its ring strategy starts from what it pulled.

A worker that sent its last push (it joined: it will not step again, and would wait in the
PS's join barrier while the others ran the ring) cancels the gathering before the release:
the PS policy goes on.  A worker that stops without joining is not waited for here: the
state server finds it silent (held workers are not) and ends the job, naming it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Gathering"]


class Gathering:
    """The rendezvous of one switch from the PS to the ring, over ``table``."""

    def __init__(self, table, now: float = 0.0):
        self.t = table
        self.started, self.released_at = now, None
        self.held = np.zeros(table.n, dtype=bool)
        self.released = np.zeros(table.n, dtype=bool)
        self.push_target = np.zeros(table.n, dtype=np.int64)
        self.round: int | None = None     # R, set at the release

    @property
    def cancelled(self) -> bool:
        """A running worker sent its last push before the release (module doc)."""
        return self.round is None and bool((self.t.active & self.t.final_pushed).any())

    def hold(self, w: int) -> None:
        self.held[w] = True

    def ready(self, w: int, now: float = 0.0) -> bool:
        """May held worker ``w`` be answered (every running worker is held, or was)?"""
        t = self.t
        if self.round is None:
            running = t.active & ~t.final_pushed
            if not running.any() or not (self.held | ~running).all():
                return False
            self.round = int(t.round[running].max()) + 1
            self.released_at = now
        if not self.released[w]:
            self.released[w] = True
            self.push_target[w] = t.pushes[w] + 1
        return True

    def switching(self, w: int) -> bool:
        """Is ``w`` between its release and its reset of round R?"""
        return bool(self.released[w]) and int(self.t.round[w]) < (self.round or 0)

    @property
    def held_s(self) -> float | None:
        """From the switch's decision to its release: how long the first workers held waited
        for the last."""
        return None if self.released_at is None else self.released_at - self.started

    def may_pull(self, w: int) -> bool:
        """The switch's pull: once every released worker's switch push is in."""
        t = self.t
        waiting = self.released & t.active
        return bool((t.pushes[waiting] >= self.push_target[waiting]).all())
