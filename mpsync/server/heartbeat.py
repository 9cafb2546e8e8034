"""Heartbeats: the state server tells a worker that stopped from one that is only slow.

The server hears every worker at each of its steps, but a step's length is the worker's own
business: a 4x straggler, worker 0's evaluation, a checkpoint write or a first compile can
keep a live worker quiet for many seconds, so silence between steps can only be judged
against a long bound (``silent_timeout``, 10 s).  A stopped process (SIGSTOP, a hung node),
a dead node and a cut link all look the same from there: the worker's messages stop.

So each worker of the torch API runs :class:`Heartbeat`, a thread that sends the server one
float64 (its period) every ``heartbeat_s`` seconds on the control communicator, whatever the
training thread is doing: torch's kernels, MPI's waits and sleeps release the GIL, and
Python hands it over every 5 ms otherwise.  The beats stop only when the process or its link
does.  The server suspects a worker whose beats stopped for :func:`suspect_bound`, a few
periods with a floor of ``suspect_after`` seconds (3 s by default), and never below three
times the longest wait between two of that worker's beats the server has seen: the floor covers
a beat thread descheduled on a loaded node and an MPI transport's retransmission after a lost
packet; four periods that one late beat is not a lost one; the measured gaps what a loaded
node does to this worker (on this 2-core VM with 13 busy processes, live workers' beats came
up to 2 s apart, mostly while a process was starting: the training thread holds the GIL while
it loads a shared library).  The rule applies from a worker's first step on (before it,
start-up has ``startup_timeout``).  The link's own latency (microseconds to milliseconds) is
far inside all of these.

What the suspicion leads to is the policy's (the ZipLine paper, §4, takes a silent worker out
of the barrier decisions): the ring cannot aggregate without it and ends the job naming it;
the parameter server's policies go on without it and take it back when it speaks again,
unless it hosts a PS shard: the others' pushes and pulls cannot complete without that slice of
the model, so the job ends naming it (the beat carries the shard it hosts).

The beats tell that a process is there, not that it progresses: a worker whose training
thread hangs with its beat thread alive is found by the older rule (no step or other message
for ``silent_timeout`` while the others wait for it) and by the collectives' deadlines.
Beside the papers: ESync's state server and ZipLine learn of a worker's state only from its
reports, and neither bounds how long detection takes.  The beat is an addition of mpsync's,
as in Horovod elastic and torchft, which find a lost peer by heartbeat too; no policy's
decisions change.
"""

from __future__ import annotations

import threading
import time

import numpy as np

__all__ = ["Heartbeat", "suspect_bound", "suspects", "MAX_PERIOD_S", "BEAT_LEN"]

# A beat period the server accepts (a larger one is a malformed message): beats rarer than
# this could not find a fault in seconds anyway.
MAX_PERIOD_S = 60.0
# float64s in a beat: its period, the shard its process hosts (-1: none).
BEAT_LEN = 2
# A suspicion waits for this many missed periods (one late beat is not a lost one).
_PERIODS = 4.0
# ... and for this many times the longest wait between two beats the worker has shown: a
# loaded node delays a live worker's beats (its thread waits for a core, or for the GIL while
# the training thread loads a library), and what it did once it may do again, a bit worse.
_GAPS = 3.0


def suspect_bound(period, floor: float, worst_gap=0.0):
    """Seconds without a beat after which a worker beating every ``period`` seconds, whose
    longest wait between two beats so far was ``worst_gap``, is suspected:
    ``max(floor, 4 x period, 3 x worst_gap)`` (module doc); works on arrays."""
    return np.maximum(np.maximum(floor, _PERIODS * np.asarray(period, dtype=np.float64)),
                      _GAPS * np.asarray(worst_gap, dtype=np.float64))


def suspects(now: float, last_beat: np.ndarray, period: np.ndarray, floor: float,
             eligible: np.ndarray, worst_gap=0.0) -> np.ndarray:
    """Indices of the workers suspected at ``now``: eligible (active, started), beating (a
    period was received, > 0) and silent for longer than their :func:`suspect_bound`."""
    beating = period > 0
    late = (now - last_beat) > suspect_bound(period, floor, worst_gap)
    return np.flatnonzero(eligible & beating & late)


class Heartbeat:
    """A daemon thread sending ``[period, shard]`` to the server (tag ``BEAT``) every
    ``period`` seconds on ``comm``; ``shard``: the PS shard this process hosts (-1: none).
    At most one beat in flight: one that has not left (a cut link)
    is not piled up behind.  ``stop()`` ends it; it ends by itself if MPI fails or is
    finalized under it (a process on its way out)."""

    def __init__(self, comm, server_rank: int, period: float, tag: int, shard: int = -1):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.server = int(server_rank)
        self.period = float(period)
        self.tag = int(tag)
        self.sent = 0
        self.error: str | None = None
        # [period, the PS shard this process hosts or -1]; constant: safe while in flight.
        self._buf = np.array([self.period, float(shard)], dtype=np.float64)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpsync-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        MPI = self._MPI
        request = None
        try:
            while True:
                if MPI.Is_finalized():
                    return
                if request is None or request.Test():
                    request = self.comm.Isend([self._buf, MPI.DOUBLE], dest=self.server,
                                              tag=self.tag)
                    self.sent += 1
                if self._stop.wait(self.period):
                    break
            # The last beat leaves before the worker's goodbye (a bounded wait: its link may
            # be the one that is cut).
            end = time.monotonic() + self.period * 2
            while request is not None and not request.Test() and time.monotonic() < end:
                time.sleep(0.01)
        except Exception as e:  # MPI torn down under the thread: a process ending anyway
            self.error = f"{type(e).__name__}: {e}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period * 2 + 1.0)
