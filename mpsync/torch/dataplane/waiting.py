"""Waiting on collectives with a deadline, and naming the peers that never arrived.

A blocking ``MPI_Allreduce`` waits forever for a peer that stopped (SIGSTOP, a hung data
loader, a livelocked GPU); Open MPI only ends the job when a process *dies*.  mpsync therefore
waits on every collective with a deadline: a non-blocking one tested in a loop, a blocking one
run on a communication thread while the caller waits on its event, both through the progress
engine (:mod:`mpsync.torch.dataplane.progress`), until it completes or the deadline passes.

A collective cannot say which peer is missing, so workers that have waited for a while tell
each other so: :class:`PeerWatch` sends a one-integer "I am waiting in collective #s" notice to
every peer on its own communicator.  When the deadline passes, the peers that have announced
neither that collective nor a later one are the silent ones, and :class:`CollectiveTimeout`
names them.  A notice carries the collective's name too: where every peer has announced, one
that waits in another collective of the same number is named with it (the workers called
different collectives: a mismatched sequence hangs as a lost message would), and so is one
past this collective (it left it, or never called it).
Notices are sent only after ``notice_after`` seconds of waiting, so a healthy job pays one
``Iprobe`` per collective for them and nothing else.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CollectiveTimeout", "LOST", "PeerWatch", "UNKNOWN_MISSING"]

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
            why = LOST
        super().__init__(f"{what} not complete after {deadline:g}s deadline: {why}",
                         world, what)


_NOTICE_TAG = 7301
# A notice: the collective's number (8 bytes), then its name (UTF-8, NUL-padded, cut to fit).
_NOTICE_BYTES = 160
UNKNOWN_MISSING = "which worker is missing is not known (this wait exchanges no notices)"
LOST = "every peer announced it was waiting in it (a lost message or a broken transport)"


def _notice(seq: int, what: str) -> np.ndarray:
    buf = np.zeros(_NOTICE_BYTES, dtype=np.uint8)
    buf[:8] = np.frombuffer(np.int64(seq).tobytes(), dtype=np.uint8)
    name = what.encode("utf-8", "replace")[:_NOTICE_BYTES - 8]
    buf[8:8 + len(name)] = np.frombuffer(name, dtype=np.uint8)
    return buf


def _read_notice(buf: np.ndarray) -> tuple[int, str]:
    seq = int(np.frombuffer(buf[:8].tobytes(), dtype=np.int64)[0])
    return seq, buf[8:].tobytes().rstrip(b"\0").decode("utf-8", "replace")


class PeerWatch:
    """Who has reached collective #seq, and in which collective does each wait?  One instance
    per workers' communicator.

    ``comm`` must be reserved for notices (a ``Dup()``), so an ``Iprobe`` never matches other
    traffic.  ``world_ranks[i]`` is the world rank of worker ``i`` (for messages only).
    """

    def __init__(self, comm, world_ranks: list[int] | None = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.world_ranks = list(world_ranks) if world_ranks is not None else list(range(self.size))
        self.latest = np.full(self.size, -1, dtype=np.int64)  # highest collective announced
        self.names = [""] * self.size                         # ... and its name
        self._sends: list = []
        self._buf = np.zeros(_NOTICE_BYTES, dtype=np.uint8)

    def announce(self, seq: int, what: str = "") -> None:
        """Tell every peer: I am waiting in collective ``seq``, named ``what``."""
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        self._note(self.rank, seq, what)
        msg = _notice(seq, what)
        for peer in range(self.size):
            if peer != self.rank:
                # (the buffer is kept with its request until the send completes)
                self._sends.append((self.comm.Isend(msg, dest=peer, tag=_NOTICE_TAG), msg))

    def _note(self, rank: int, seq: int, what: str) -> None:
        if seq >= self.latest[rank]:
            self.latest[rank], self.names[rank] = seq, what

    def drain(self) -> None:
        """Receive every notice that has arrived (cheap when there is none)."""
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_NOTICE_TAG, status=status):
            src = status.Get_source()
            self.comm.Recv(self._buf, source=src, tag=_NOTICE_TAG)
            self._note(src, *_read_notice(self._buf))

    def silent(self, seq: int) -> list[int]:
        """Peers that have not announced collective ``seq`` or a later one."""
        self.drain()
        return [r for r in range(self.size) if r != self.rank and self.latest[r] < seq]

    def elsewhere(self, seq: int, what: str) -> list[tuple[int, str]]:
        """Peers that announced a collective other than ``seq`` named ``what``, each with a
        line saying where it waits (drain first: :meth:`silent`)."""
        out = []
        for r in range(self.size):
            if r == self.rank or self.latest[r] < seq:
                continue
            who = f"worker {r} (world rank {self.world_ranks[r]})"
            there = self.names[r] or f"collective #{self.latest[r]}"
            if self.latest[r] > seq:
                out.append((r, f"{who} is past it, waiting in {there}"))
            elif self.names[r] and what and self.names[r] != what:
                out.append((r, f"{who} waits in {there} instead"))
        return out

    def timeout(self, what: str, seq: int, deadline: float) -> CollectiveTimeout:
        silent = self.silent(seq)
        why = None
        other = [] if silent else self.elsewhere(seq, what)
        if other:
            # A collective one worker called and another did not (or in another order) hangs
            # as a lost message does; the notices tell the two apart where a peer waits in
            # another collective of the same number.  One past this collective may have left
            # it (a broadcast's root does, once it has sent) with the message to this worker
            # lost, or never called it.
            mismatch = any(line.endswith(" instead") for _, line in other)
            why = "; ".join(line for _, line in other) + (
                ": the workers called different collectives" if mismatch else
                ": a collective this worker called and the others did not, or its last "
                "message to this worker was lost")
        return CollectiveTimeout(what, deadline, silent, [self.world_ranks[r] for r in silent],
                                 why=why)
