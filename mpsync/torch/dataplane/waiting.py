"""Waiting on collectives with a deadline, and naming the peers that never arrived.

A blocking ``MPI_Allreduce`` waits forever for a peer that stopped (SIGSTOP, a hung data
loader, a livelocked GPU); Open MPI only ends the job when a process *dies*.  mpsync therefore
starts every collective non-blocking and polls it (``Iallreduce`` + ``Test``, or Horovod's
``poll``) until it completes or the deadline passes.

A collective cannot say which peer is missing, so workers that have waited for a while tell
each other so: :class:`PeerWatch` sends a one-integer "I am waiting in collective #s" notice to
every peer on its own communicator.  When the deadline passes, the peers that have announced
neither that collective nor a later one are the silent ones, and :class:`CollectiveTimeout`
names them.  Notices are sent only after ``notice_after`` seconds of waiting, so a healthy job
pays one ``Iprobe`` per collective for them and nothing else.
"""

from __future__ import annotations

import os
import time

import numpy as np

__all__ = ["CollectiveTimeout", "PeerWatch", "poll_until_done", "wait_on_event"]

from mpsync.server import DeadlineExceeded
from mpsync.torch.dataplane.exceptions import HorovodInternalError


class CollectiveTimeout(DeadlineExceeded, HorovodInternalError):
    """A collective did not complete within the deadline (a :class:`HorovodInternalError`,
    which is what a Horovod script catches when a collective fails).

    ``silent_ranks`` are ranks of the workers' communicator that never reached it (as far as the
    notices tell); ``what`` names the collective.
    """

    def __init__(self, what: str, deadline: float, silent_ranks: list[int],
                 world_ranks: list[int] | None = None, why: str | None = None):
        self.what = what
        self.deadline = deadline
        self.silent_ranks = list(silent_ranks)
        world = list(world_ranks if world_ranks is not None else silent_ranks)
        if silent_ranks:
            who = ", ".join(
                f"worker {w} (world rank {g})" for w, g in zip(self.silent_ranks, world))
            why = f"no word from {who}"
        elif why is None:
            why = "every peer announced it was waiting (a lost message or a broken transport)"
        super().__init__(f"{what} not complete after {deadline:g}s deadline: {why}",
                         world, what)


_NOTICE_TAG = 7301
_UNKNOWN = "which worker is missing is not known (this wait exchanges no notices)"


class PeerWatch:
    """Who has reached collective #seq?  One instance per workers' communicator.

    ``comm`` must be reserved for notices (a ``Dup()``), so an ``Iprobe`` never matches other
    traffic.  ``world_ranks[i]`` is the world rank of worker ``i`` (for messages only).
    """

    def __init__(self, comm, world_ranks: list[int] | None = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.world_ranks = list(world_ranks) if world_ranks is not None else list(range(self.size))
        self.latest = np.full(self.size, -1, dtype=np.int64)  # highest collective announced
        self._sends: list = []
        self._buf = np.zeros(1, dtype=np.int64)

    def announce(self, seq: int) -> None:
        """Tell every peer: I am waiting in collective ``seq``."""
        self._sends = [r for r in self._sends if not r.Test()]
        self.latest[self.rank] = max(self.latest[self.rank], seq)
        msg = np.array([seq], dtype=np.int64)
        for peer in range(self.size):
            if peer != self.rank:
                self._sends.append(self.comm.Isend(msg, dest=peer, tag=_NOTICE_TAG))

    def drain(self) -> None:
        """Receive every notice that has arrived (cheap when there is none)."""
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_NOTICE_TAG, status=status):
            src = status.Get_source()
            self.comm.Recv(self._buf, source=src, tag=_NOTICE_TAG)
            self.latest[src] = max(self.latest[src], int(self._buf[0]))

    def silent(self, seq: int) -> list[int]:
        """Peers that have not announced collective ``seq`` or a later one."""
        self.drain()
        return [r for r in range(self.size) if r != self.rank and self.latest[r] < seq]

    def timeout(self, what: str, seq: int, deadline: float) -> CollectiveTimeout:
        silent = self.silent(seq)
        return CollectiveTimeout(what, deadline, silent, [self.world_ranks[r] for r in silent])


def poll_until_done(test, *, deadline: float, what: str, watch: PeerWatch | None, seq: int,
                    notice_after: float | None = None, sleep: float = 0.0,
                    spin_for: float = 0.0) -> None:
    """Call ``test()`` until it returns True; raise :class:`CollectiveTimeout` at ``deadline``.

    ``test`` must make progress when called (``MPI.Request.Test`` progresses Open MPI's
    non-blocking collectives; nothing else does).  Between calls the rank yields the core
    (``sched_yield``, what Open MPI's blocking calls do with ``mpi_yield_when_idle``); after
    ``spin_for`` seconds it sleeps ``sleep`` seconds instead when ``sleep`` > 0 (for waits whose
    progress happens on another thread, e.g. Horovod's, a short spin catches fast completions
    and the sleep then leaves the core to that thread).
    """
    if test():
        return
    start = time.monotonic()
    if notice_after is None:
        notice_after = min(1.0, deadline / 4)
    announced = False
    spins = 0
    sleeping = False
    yield_ = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
    while True:
        if test():
            return
        spins += 1
        if sleeping or spins & 63 == 0:
            waited = time.monotonic() - start
            sleeping = sleep > 0 and waited > spin_for
            if watch is not None and not announced and waited > notice_after:
                watch.announce(seq)
                announced = True
            if waited > deadline:
                if watch is None:
                    raise CollectiveTimeout(what, deadline, [], why=_UNKNOWN)
                # Let late notices arrive before naming anyone.
                grace_end = time.monotonic() + min(notice_after, 1.0)
                while time.monotonic() < grace_end:
                    if test():
                        return
                    time.sleep(0.01)
                raise watch.timeout(what, seq, deadline)
        if sleeping:
            time.sleep(sleep)
        else:
            yield_()


def wait_on_event(event, *, deadline: float, what: str, watch: PeerWatch | None, seq: int,
                  notice_after: float | None = None) -> None:
    """Sleep until ``event`` is set (a collective finished on another thread); announce the
    wait after ``notice_after`` and raise :class:`CollectiveTimeout` at ``deadline``."""
    if event.is_set():
        return
    if notice_after is None:
        notice_after = min(1.0, deadline / 4)
    if event.wait(notice_after):
        return
    if watch is not None:
        watch.announce(seq)
    if event.wait(max(0.0, deadline - notice_after)):
        return
    if watch is None:
        raise CollectiveTimeout(what, deadline, [], why=_UNKNOWN)
    if event.wait(min(notice_after, 1.0)):  # let late notices arrive before naming anyone
        return
    raise watch.timeout(what, seq, deadline)
