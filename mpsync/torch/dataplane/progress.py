"""The progress engine: the one way a worker waits on a collective in flight.

Open MPI has no progress thread here: a non-blocking collective (``Iallreduce``) moves bytes
only while some thread of the rank is inside MPI.  A waiter that sleeps between ``Test`` calls
therefore stalls its own transfer, and Open MPI's non-blocking algorithms (``libnbc``) are
also 2-3x slower than its blocking ones (``tuned``) for large buffers on shared memory.  So a
collective is moved one of two ways, chosen by its size (the same on every worker):

* **small** (below ``thread_min_bytes``; an allreduce below ``REDUCE_THREAD_MIN_BYTES``,
  smaller: libnbc's ``Iallreduce`` falls behind its blocking twin early): the non-blocking
  call, and the waiter spins on ``Test`` without ever sleeping (it yields the core between
  tests, as Open MPI's own blocking calls do with ``mpi_yield_when_idle``): a thread
  hand-off would cost more than the transfer;
* **large**: the blocking call (tuned algorithms, progressing on its own) on a *lane*, a
  communication thread owned by one communicator, and the waiter blocks on the lane's event
  (no core, no sleep), waking at most every ``poll_every`` seconds only when it must keep
  serving something else meanwhile (member 0's negotiation answers, a joined worker's part in
  the others' collectives, a local-step policy's idle iterations).

A lane runs its calls in submission order, which is the same on every worker because every
caller starts its collectives in an order all workers agree on; each lane has its own
communicator, so two lanes (the script's and the optimizer's) never interleave on one.  A
lane's thread is a daemon blocked on its queue when nothing is in flight: no core is taken.

At the deadline the waiter raises :class:`~mpsync.torch.dataplane.waiting.CollectiveTimeout`
(naming the silent peers as :class:`~mpsync.torch.dataplane.waiting.PeerWatch` knows them),
as the polling waits did.  A blocking call cannot be cancelled: its lane thread stays inside
it (a daemon, so it never keeps the process alive) and the lane's later calls queue behind it.
If the silent peer comes back, the call completes and the queue drains in order on every
worker; otherwise the job is ending anyway.

A worker's waits on its parameter-server shards go through :meth:`ProgressEngine.wait` too
(``mpsync.server.shards.ShardClient.waiter``, set by the runtime: the server layer cannot
import this one): weights coming in are spun on, a push's answers are waited for as bytes
that move elsewhere (the shards copy them).

The waits count what they did in :attr:`ProgressEngine.counts` (``sleeps`` stays 0 while a
collective is in flight: the engine only ever sleeps while it waits for a peer to *submit*
one, before any data step has started, see :meth:`ProgressEngine.wait`).
"""

from __future__ import annotations

import os
import queue
import threading
import time

from mpsync.torch.dataplane.waiting import UNKNOWN_MISSING, CollectiveTimeout, PeerWatch

__all__ = ["ProgressEngine", "Flight", "engine", "THREAD_MIN_BYTES", "REDUCE_THREAD_MIN_BYTES",
           "poll_until_done", "wait_on_event"]

# Below this a thread hand-off costs more than it saves (measured on 2 ranks of one host, the
# script's collectives: at 4 MB a spun Iallreduce took 4.3 ms, the blocking Allreduce on a
# lane 2.2 ms; at 1 MB on a loaded machine the lane's two thread wake-ups cost more than
# libnbc's slower algorithm; bench/collectives/README.md).
THREAD_MIN_BYTES = 4 << 20
# An allreduce takes the lane from a smaller size: libnbc's Iallreduce is the slowest of the
# non-blocking calls against its blocking twin (2 ranks of one host, median ms at 1 MB: the
# spun Iallreduce 0.49-0.59, the blocking Allreduce on a lane 0.32-0.38; at 2 MB 1.07 against
# 0.49), where Iallgather, Ibcast and Ialltoall at 1-2 MB are as fast as or faster than their
# blocking calls on a lane (bench/collectives/README.md).
REDUCE_THREAD_MIN_BYTES = 1 << 20

# While no data step has started (the waiter waits for a peer to submit the collective), the
# waiter spins this long, then pauses ``_BACKOFF_S`` between tests so a late peer on the same
# cores gets them.
_SPIN_BEFORE_BACKOFF_S = 2e-3
_BACKOFF_S = 1e-4


class Flight:
    """A blocking call running on a lane: ``test()`` (or calling it) is True once it returned,
    and raises what it raised; ``event`` is set then."""

    __slots__ = ("event", "_error")

    def __init__(self):
        self.event = threading.Event()
        self._error: list[BaseException] = []

    def test(self) -> bool:
        if not self.event.is_set():
            return False
        if self._error:
            raise self._error[0]
        return True

    __call__ = test


class _Lane:
    """One thread running blocking calls in the order they are submitted."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn) -> Flight:
        flight = Flight()
        self._queue.put((fn, flight))
        return flight

    def _run(self) -> None:
        while True:
            fn, flight = self._queue.get()
            try:
                fn()
            except BaseException as e:  # handed to the waiter, which re-raises it
                flight._error.append(e)
            flight.event.set()


class ProgressEngine:
    """Starts blocking collectives on lanes and waits on any collective in flight."""

    def __init__(self, thread_min_bytes: int | None = THREAD_MIN_BYTES):
        self.thread_min_bytes = thread_min_bytes
        self._lanes: dict[int, _Lane] = {}
        self._lock = threading.Lock()
        self._threads_ok: bool | None = None
        # What the waits did: waits, spins (Test calls while data moved), event_waits (blocks
        # on a lane's event), sleeps (backoff pauses, only before a data step starts), pauses
        # (waits on another library's thread, see ``elsewhere``),
        # lane_calls (blocking calls handed to lanes).
        self.counts = {"waits": 0, "spins": 0, "event_waits": 0, "sleeps": 0, "pauses": 0,
                       "lane_calls": 0, "beats": 0}
        # Called about every ``beat_every`` seconds while a wait lasts longer than that, on the
        # thread that set it (the worker's SyncClient.alive): a worker waiting in a collective
        # for a peer that stopped keeps telling the state server it is there, so the server
        # can name the one that fell silent instead of every worker in the collective.
        self._beat = None
        self._beat_thread: int | None = None
        self.beat_every = 1.0

    def set_heartbeat(self, beat) -> None:
        """``beat()`` (rate-limited by the callee) runs during long waits on this thread; None
        removes it."""
        self._beat = beat
        self._beat_thread = threading.get_ident() if beat is not None else None

    # -- starting -------------------------------------------------------------------------------
    def threads_ok(self) -> bool:
        """Lanes need MPI_THREAD_MULTIPLE (mpi4py asks for it by default)."""
        if self._threads_ok is None:
            from mpi4py import MPI

            self._threads_ok = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        return self._threads_ok

    def use_lane(self, nbytes: int, threshold: int | None = -1, reduction: bool = False) -> bool:
        """Should a collective of ``nbytes`` (the same on every worker) run blocking on a lane?
        ``threshold``: the caller's own (None: never), default the engine's; ``reduction``
        (an allreduce): from :data:`REDUCE_THREAD_MIN_BYTES` already, or the engine's own
        threshold where that is lower."""
        threshold = self.thread_min_bytes if threshold == -1 else threshold
        if reduction and threshold is not None:
            threshold = min(threshold, REDUCE_THREAD_MIN_BYTES)
        return threshold is not None and nbytes >= threshold and self.threads_ok()

    def run_on_lane(self, comm, fn) -> Flight:
        """Run ``fn()`` (a blocking call on ``comm``) on ``comm``'s lane, after the calls
        submitted there before.  ``comm`` must be used by nothing but its lane."""
        key = comm.py2f()
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(f"mpsync-lane-{key}")
        self.counts["lane_calls"] += 1
        return lane.submit(fn)

    # -- waiting --------------------------------------------------------------------------------
    def wait(self, test, *, deadline: float, what: str, watch: PeerWatch | None = None,
             seq: int = 0, event: threading.Event | None = None, poll_every: float | None = None,
             started=None, elsewhere: tuple[float, float] | None = None, idle=None,
             idle_after: float = 0.0, notice_after: float | None = None) -> None:
        """Until ``test()`` is True; :class:`CollectiveTimeout` at ``deadline`` seconds.

        ``test`` makes progress when called (``Request.Test``; it may also serve other
        messages, e.g. negotiation).  ``event``: set when the data moved on a lane (or a
        function giving that event, None while the data step is not on a lane); the waiter
        blocks on it, calling ``test`` every ``poll_every`` seconds (None: only when set or at
        a notice/deadline checkpoint).  Without an event the waiter spins on ``test``,
        yielding the core between calls, and never sleeps, except:

        * ``started()`` False: no data step has started (the collective waits for a peer to
          submit it); after a 2 ms spin the waiter pauses 0.1 ms between tests;
        * ``elsewhere=(spin_for, pause)``: the bytes move on a thread that is not the
          waiter's (Horovod's background thread): after ``spin_for`` seconds it pauses
          ``pause`` seconds between tests, leaving the core to that thread.

        ``idle()`` is called about every millisecond once ``idle_after`` seconds have passed
        (a local-step policy's idle iterations).  ``watch`` announces the wait after
        ``notice_after`` (default min(1 s, deadline / 4)) and names the silent peers at the
        deadline.  The heartbeat (:meth:`set_heartbeat`) runs every ``beat_every`` seconds of
        a wait on the thread that set it.
        """
        if test():
            return
        counts = self.counts
        counts["waits"] += 1
        start = now = time.monotonic()
        if notice_after is None:
            notice_after = min(1.0, deadline / 4)
        announced = False
        next_idle = start + idle_after
        yield_ = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
        spins = 0
        pausing = False
        lane_event = event if not callable(event) else None
        beat = self._beat if self._beat_thread == threading.get_ident() else None
        next_beat = start + self.beat_every if beat is not None else float("inf")
        while True:
            if callable(event):
                lane_event = event()
            if lane_event is not None:
                # The data moves on a lane: block until it is done or something is due.
                due = min(start + (deadline if announced or watch is None else notice_after),
                          next_beat)
                if idle is not None:
                    due = min(due, next_idle)
                step = max(0.0, due - now)
                if poll_every is not None:
                    step = min(step, poll_every)
                counts["event_waits"] += 1
                lane_event.wait(step)
                if test():
                    return
                now = time.monotonic()
            else:
                if test():
                    return
                spins += 1
                if not pausing and spins & 31 and idle is None:
                    counts["spins"] += 1
                    yield_()
                    continue  # the clock is read every 32nd pass
                now = time.monotonic()
                waited = now - start
                if elsewhere is not None and waited > elsewhere[0]:
                    pausing = True
                    counts["pauses"] += 1
                    time.sleep(elsewhere[1])
                elif started is not None and waited > _SPIN_BEFORE_BACKOFF_S and not started():
                    pausing = True
                    counts["sleeps"] += 1
                    time.sleep(_BACKOFF_S)
                else:
                    pausing = False
                    counts["spins"] += 1
                    yield_()
            waited = now - start
            if idle is not None and now >= next_idle:
                idle()
                next_idle = time.monotonic() + 1e-3
            if now >= next_beat:
                counts["beats"] += 1
                beat()
                next_beat = now + self.beat_every
            if watch is not None and not announced and waited > notice_after:
                watch.announce(seq, what)
                announced = True
            if waited > deadline:
                self._expire(test, lane_event, deadline=deadline, what=what, watch=watch, seq=seq,
                             grace=min(notice_after, 1.0))
                return

    def _expire(self, test, event, *, deadline, what, watch, seq, grace) -> None:
        """Past the deadline: let late notices arrive (the transfer may still finish), then
        raise naming the silent peers.  A lane's blocking call stays where it is."""
        if watch is None:
            raise CollectiveTimeout(what, deadline, [], why=UNKNOWN_MISSING)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if test():
                return
            if event is not None:
                event.wait(min(1e-2, max(0.0, end - time.monotonic())))
            else:
                os.sched_yield()
        raise watch.timeout(what, seq, deadline)


_ENGINE = ProgressEngine()


def engine() -> ProgressEngine:
    """The process's engine (one per process: its lanes are keyed by communicator)."""
    return _ENGINE


def poll_until_done(test, *, deadline: float, what: str, watch: PeerWatch | None, seq: int,
                    notice_after: float | None = None, sleep: float = 0.0,
                    spin_for: float = 0.0) -> None:
    """Call ``test()`` until it returns True; raise :class:`CollectiveTimeout` at ``deadline``
    (the progress engine's wait, :meth:`mpsync.torch.dataplane.progress.ProgressEngine.wait`).

    ``test`` must make progress when called (``MPI.Request.Test`` progresses Open MPI's
    non-blocking collectives; nothing else does): the waiter spins on it, yielding the core
    between calls, and never sleeps.  ``sleep`` > 0 is for waits whose bytes move on a thread
    that is not the caller's (Horovod's): after ``spin_for`` seconds the waiter sleeps
    ``sleep`` seconds between tests, leaving the core to that thread.
    """
    _ENGINE.wait(test, deadline=deadline, what=what, watch=watch, seq=seq,
                 notice_after=notice_after,
                 elsewhere=(spin_for, sleep) if sleep > 0 else None)


def wait_on_event(event, *, deadline: float, what: str, watch: PeerWatch | None, seq: int,
                  notice_after: float | None = None) -> None:
    """Block until ``event`` is set (a collective finished on a communication thread);
    announce the wait after ``notice_after`` and raise :class:`CollectiveTimeout` at
    ``deadline`` (the progress engine's wait)."""
    _ENGINE.wait(event.is_set, deadline=deadline, what=what, watch=watch, seq=seq,
                 event=event, notice_after=notice_after)
