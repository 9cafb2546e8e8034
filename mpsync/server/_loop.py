"""The serve loop: receive, validate, dispatch to the policy, reply; an explicit stop message.

One thread, one communicator.  The loop never blocks in MPI (Open MPI's blocking receive
polls a core at 100 %): it polls with ``Iprobe`` and has four speeds.

* Hot: for ``hot_s`` after each message it polls without sleeping, and without yielding: in
  a burst (workers at a barrier, short iterations) the server is what every worker waits
  for, and the next message usually comes within this window and is answered without a
  scheduler wake-up (a ``time.sleep`` of 20 µs returns after ~120 µs on a busy VM).  200 µs
  for the dedicated server; 100 µs co-located, where polling would also hold the trainer's
  GIL.
* Backing off: then it sleeps, 50 µs doubling to 1 ms.
* Idle: after 50 ms without any message the sleep may grow to 4 ms, so an idle server costs a
  few percent of a core at most and a co-located trainer keeps its CPU.
* Expected (dedicated server): no sleep runs past the moment a computing worker's next report
  is due (its last event plus its last compute time); the loop polls again, yielding the
  core between polls, from 0.3 ms before that until 1 ms after.  A worker with 10 ms
  iterations would otherwise find the server asleep for up to 1 ms at every query.  Not for
  a message whose reply the worker collects later (the sharded PS's ``PUSH_PULL`` under
  ASP: ``_not_awaited``).

Where Open MPI and the policy allow it (``_fastpath``), the hot window runs in compiled code:
when a probe finds a message, one call receives, checks, records, decides and answers the
step and reset messages (and the sharded PS's push-and-pull requests it can grant at once,
``pull_rules``), and keeps polling for ``hot_s``; it leaves every other message, and any it
cannot complete, to this loop, which then handles them exactly as without it.

A payload header (PS init/push, OSP importance) whose DATA message has not arrived yet is
parked, not waited for: the loop keeps serving everyone else and finishes the request when
the DATA comes (or drops it after ``deadline``).
"""

from __future__ import annotations

import collections
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpsync.config import ConfigError
from mpsync.server import heartbeat, _fastpath, pull_rules, rules, wire as W
from mpsync.server._handlers import MessageHandlers
from mpsync.server.policies import make_policy
from mpsync.server._stats import EventLog, ServerCounters, rss_kb
from mpsync.server._view import ServerView
from mpsync.server.weights import WeightStore

__all__ = ["StateServer"]

_HOT_DEDICATED_S = 200e-6   # poll without sleeping this long after a message (module doc)
_HOT_COLOCATED_S = 100e-6
_SLEEP_MIN_S = 50e-6
_SLEEP_MAX_S = 1e-3
# After this long without any message the backoff may grow to _SLEEP_IDLE_MAX_S.  Trade-off:
# each wake-up costs CPU (Iprobe, a housekeeping check, the syscall), ~1,000 of them a second
# at 1 ms, which measured 6-7% of a core while idle against a target under 5%; at 4 ms that is
# ~250 a second.  The price is latency for the first query after a pause: it waits up to 4 ms
# for the server's next wake-up instead of 1 ms.  Bursts are unaffected: workers that query
# every iteration (iterations shorter than 50 ms) keep the server below this threshold, and
# any message resets the backoff to 50 µs.  Longer iterations already pay much more than 4 ms
# per iteration, so the extra delay stays a small fraction of their time.
_IDLE_AFTER_S = 0.05
_SLEEP_IDLE_MAX_S = 4e-3
# Waking up for a report that is due (serve): sleep until this long before it, poll from then
# on until this long after it.  The margin covers a sleep's overshoot (~0.1 ms median here);
# the slack, a late worker (iteration-time jitter); past it the loop backs off as usual.  Each
# expected report costs at most margin + slack of polling, with yields.  The margin grows by
# how late the loop's sleeps have been waking (``_fastpath.late_wake``): where ranks share
# cores with computing trainers a sleep may end milliseconds late.
_WAKE_MARGIN_S = 300e-6
_DUE_SLACK_S = 1e-3
_HOUSEKEEPING_S = 0.1   # how often silent workers and expired payload headers are looked for
_MSG_BYTES = W.MSG_LEN * 8
_PAYLOAD_TAGS = (W.PS_INIT, W.PUSH, W.IMPORTANCE, W.STRIDE)
_NO_PAYLOAD = np.empty(0)


class StateServer(MessageHandlers):
    """Answers every worker's per-iteration question under one policy (module doc).

    ``comm`` is the control communicator (callers pass a ``Dup()`` so user traffic can never
    match the server's receives); ``workers`` are the ranks of ``comm`` that train.
    ``wake_ahead`` (default ``config.server_wake_ahead``): the dedicated server polls for
    reports that are due instead of sleeping through them (module doc); off, it saves that
    polling's CPU and answers them later.  ``fast_path`` (default
    ``config.server_fast_path``): the per-iteration messages are served by compiled code
    (``_fastpath``) where this MPI and the policy allow it.
    """

    def __init__(self, comm, config, *, server_rank: int = 0, workers=None, log=None,
                 wake_ahead: bool | None = None, fast_path: bool | None = None):
        config.validate()
        self.comm = comm
        self.config = config
        self.server_rank = server_rank
        if workers is None:
            workers = [r for r in range(comm.Get_size())
                       if config.server == "colocated" or r != server_rank]
        self.ranks = [int(r) for r in workers]
        if not self.ranks:
            raise ConfigError("the state server has no workers (launch with at least 2 ranks "
                              "for server='dedicated')")
        self.index = {r: i for i, r in enumerate(self.ranks)}
        try:
            self.policy = make_policy(config, len(self.ranks))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        spec = config.resolved().spec
        # ESync §4.2: a report may be sent without waiting for its reply.
        self.delayed_ack = spec.reads("esync_delayed_ack")
        # The sharded PS never holds a pull (ASP): its push-and-pull replies are read later.
        self.pulls_ungated = bool(spec.ps_pull_ungated)
        # Its steps are all SYNC (ASP, SSP, DSSP): the workers collect those replies later
        # too, so under ASP nobody waits for any reply of a reporting worker.
        self.steps_unawaited = bool(spec.steps_unawaited)
        self.table = self.policy.t
        self.cells = self.table.cells          # the arrays the per-message rules write
        self.policy.warm_up()
        self.counters = ServerCounters(len(self.ranks))
        self.events = EventLog()
        self.held: list[tuple] = []          # (tag, w, seq, extra): replies the tables hold back
        # On the PS, policies that average deltas apply each push scaled by (global step) / n
        # (BSP, ESync Eq. 7-8: their pulls wait for every delta of the round, so each reads
        # w_t + ε·mean_i Δ_i, the ring's average); the others apply each update as it is
        # (Downpour style).
        n = len(self.ranks)
        self.weights = WeightStore(spec.ps_update_scale(config, n))
        # BSP with the server-side optimizer on shards: a pull's grant tells the round it reads
        # and whose pushes that round leaves out (``_round_told``), fixed at its first grant.
        self.rounds_told = bool(spec.ps_average and config.ps_optimizer == "server"
                                and config.topology == "ps")
        self._left_out: dict[int, np.ndarray] = {}
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.rejected: dict[tuple, int] = {}
        # Well-formed requests served by each loop ("python" counts the handed-over ones too).
        # Served in compiled code, in Python, received in compiled code and handed over, and
        # the due reports that found the compiled loop already waiting for them (wake-ahead);
        # of the compiled ones, the sharded PS's push-and-pull requests (pull_rules).
        self.messages = {"compiled": 0, "python": 0, "handed_over": 0, "awaited": 0,
                         "compiled_push_pulls": 0}
        self._msg = W.new_msg()
        self._reply = W.new_msg()
        self._reply_spec = [self._reply, MPI.DOUBLE]
        self._status = MPI.Status()
        self.t0 = MPI.Wtime()
        self.table.last_heard[:] = self.t0
        # Heartbeats (mpsync.server.heartbeat): each worker's period (0: it does not beat) and
        # the receipt time of its latest beat; apart from last_heard, which only the worker's
        # own messages move (a beating process may still hang in its training thread).
        self.beat_period = np.zeros(self.table.n, dtype=np.float64)
        self.last_beat = np.zeros(self.table.n, dtype=np.float64)
        self.beats = 0
        self.beat_gap = np.zeros(self.table.n, dtype=np.float64)
        self.beat_gap_at = np.zeros(self.table.n, dtype=np.int64)
        self._last_house = self.t0   # when housekeeping last ran (its beat rule's own clock)
        self._beat_status = MPI.Status()
        self._beat_buf = np.zeros(heartbeat.BEAT_LEN, dtype=np.float64)
        self.shard_of = np.full(self.table.n, -1, dtype=np.int64)  # the PS shard it hosts
        self._stop = False
        self._resuming = None      # the parked header whose DATA has just arrived
        self._msg_spec = [self._msg, MPI.DOUBLE]
        self._data_status = MPI.Status()
        self._check_gone = False   # set by a shutdown: the loop then checks whether all are gone
        self.hot_s = _HOT_DEDICATED_S if config.server == "dedicated" else _HOT_COLOCATED_S
        if wake_ahead is None:
            wake_ahead = config.server_wake_ahead
        self.wake_ahead = bool(wake_ahead) and config.server == "dedicated"
        # Payload headers waiting for their DATA message, per source rank, oldest first:
        # (tag, worker, header, receipt time, give-up time).
        self.parked: dict[int, collections.deque] = {}
        self.rss_samples: list[list] = []
        self._last_rss_sample = -1.0
        # The compiled hot path (_fastpath module doc), if this MPI and policy allow it.
        self.fast = None
        if fast_path is None:
            fast_path = config.server_fast_path
        kind = rules.FAST_KINDS.get(spec.fast_path)
        if fast_path and _fastpath.unavailable_reason() is None and kind is not None \
                and not self.policy.holds_steps:
            # The sharded PS's push-and-pull requests too, where the policy's rule is
            # compiled (pull_rules); the store's version and the largest lead travel in
            # ``ps.cells`` across each call (``_serve_compiled``).
            t = self.table
            self.ps = pull_rules.new_ps_tables(t.pushes, t.push_table, t.final_pushed, t.done,
                                               self.counters.pushes, self.counters.pulls,
                                               self.policy.compiled_controller(),
                                               unawaited=t.unawaited)
            self.ps.cells[pull_rules.PS_BOUND] = self.policy.compiled_pull_bound()
            self.fast = _fastpath.FastPath(comm, self.index, kind, self.policy, self.cells,
                                           self.counters.cells, self.events.cells, self._msg,
                                           self.t0, config.esync_slack, ps=self.ps)
            self.fast.warm_up()

    # -- the loop ---------------------------------------------------------------------------
    def serve(self) -> dict:
        """Serve until every worker has shut down; returns :meth:`stats`.

        Speeds (module doc): right after a message the loop polls without sleeping for
        ``hot_s``; then it sleeps, 50 µs doubling to 1 ms, after 50 ms of silence up to 4 ms,
        but (dedicated server) never past the moment a worker's next report is due: from
        shortly before then it polls again.  Housekeeping runs every 100 ms, off the
        per-message path.
        """
        comm, status = self.comm, self._status
        iprobe, get_source, get_tag = comm.Iprobe, status.Get_source, status.Get_tag
        get_count, any_source, any_tag = status.Get_count, MPI.ANY_SOURCE, MPI.ANY_TAG
        receive, clock, me, hot_s = self._receive, MPI.Wtime, comm.Get_rank(), self.hot_s
        wake_ahead = self.wake_ahead
        last_msg = clock()
        sleep = _SLEEP_MIN_S
        next_housekeeping = last_msg + _HOUSEKEEPING_S
        due = None           # when the next report is expected (None: unknown or none)
        due_stale = True     # the tables changed since ``due`` was computed
        fast, messages = self.fast, self.messages
        first_by = 0.0       # > 0: wait for a due report in compiled code until then
        late, late_wake = 0.0, _fastpath.late_wake.py_func   # how late its sleeps wake
        while not self._stop:
            if first_by or iprobe(any_source, any_tag, status):
                probed = True
                if fast is not None and not self.held:
                    # This message and the hot window after it in compiled code, which returns
                    # what it leaves to this loop.  Entered only when a message is waiting (a
                    # call costs about a microsecond, several times an idle poll), or to wait
                    # there for a report that is due.
                    done = self._serve_compiled(last_msg, hot_s, next_housekeeping, first_by)
                    if first_by:
                        first_by = 0.0
                        messages["awaited"] += done.handled > 0
                    code = done.code
                    if code == _fastpath.MPI_FAILED:
                        raise MPI.Exception(done.error)
                    messages["compiled"] += done.handled
                    if done.handled or code == _fastpath.RECEIVED:
                        last_msg = done.last_msg
                        sleep = _SLEEP_MIN_S
                        due_stale = True
                    if code == _fastpath.RECEIVED:
                        messages["handed_over"] += 1
                        self._received(*done.handover)
                        continue
                    probed = code == _fastpath.PROBED and iprobe(any_source, any_tag, status)
                src, tag = get_source(), get_tag()
                if probed and (tag < W.REPLY or src != me):  # else: a reply to our own client
                    receive(src, tag, get_count(MPI.BYTE))
                    last_msg = clock()
                    sleep = _SLEEP_MIN_S
                    if tag == W.PUSH_PULL:
                        # No hot window after a push_pull: the worker's next message comes
                        # after its exchange with the shards at the soonest, and polling
                        # would take a core that the shards and workers of that exchange
                        # need where ranks share cores.  The backoff still starts over (a
                        # stream of push_pulls is no idle server).
                        last_msg -= hot_s
                    due_stale = True
                    if self._check_gone:  # a shutdown arrived: was it the last one?
                        self._check_gone = False
                        if self._all_gone():
                            break
                    if last_msg < next_housekeeping:  # (else: due even under a stream)
                        continue
            now = clock()
            if now >= next_housekeeping:
                if self._keep_house(now):
                    break
                next_housekeeping = now + _HOUSEKEEPING_S
                due_stale = True
            quiet = now - last_msg
            if quiet < hot_s:
                # No yield here: in a burst the server is what everyone waits for, and a
                # yield hands the core to the clients spinning for their replies.
                continue
            nap = sleep
            if wake_ahead:
                if due_stale:
                    due = rules.next_report_due(self.cells, self._not_awaited())
                    due_stale = False
                if due is not None:
                    ahead = due - now
                    if -_DUE_SLACK_S < ahead < _WAKE_MARGIN_S + late:
                        # A report is due about now: poll for it, but let a runnable process
                        # have the core first; it may be the very worker being waited for.
                        # In compiled code where it can be answered there: the report then
                        # finds the loop already running, its code and data in the cache.
                        if fast is not None and not self.held:
                            first_by = due + _DUE_SLACK_S
                        else:
                            os.sched_yield()
                        continue
                    if ahead > 0:
                        nap = min(nap, ahead - _WAKE_MARGIN_S - late)
            time.sleep(nap)
            late = late_wake(late, clock() - now - nap)
            sleep = min(sleep * 2, _SLEEP_IDLE_MAX_S if quiet > _IDLE_AFTER_S else _SLEEP_MAX_S)
        return self.stats()

    def _not_awaited(self) -> np.ndarray:
        """The workers whose next message the loop need not wake up for: gone, or reporting
        no steps with their next ``PUSH_PULL``'s reply collected later (``table.unawaited``:
        ASP's).  Its handling would only take a core from the exchange with
        the shards it overlaps, where ranks share cores (a reporting worker keeps its due
        reports: its steps are answered at once, unless the policy's steps are unawaited
        too, ``PolicySpec.steps_unawaited``)."""
        t = self.table
        if self.steps_unawaited:
            return t.done | t.unawaited
        return t.done | (t.unawaited & ~(t.compute > 0))

    def _serve_compiled(self, last_msg, hot_s, until, first_by):
        """``FastPath.serve``, with the store's version and the largest lead handed to it
        and back (``pull_rules.PSTables.cells``; Python keeps them as attributes)."""
        cells = self.ps.cells
        cells[pull_rules.PS_VERSION] = self.weights.version
        cells[pull_rules.PS_MAX_GAP] = self.counters.max_gap
        cells[pull_rules.PS_READY] = self.weights.remote
        done = self.fast.serve(last_msg, hot_s, until, first_by=first_by)
        self.weights.version = int(cells[pull_rules.PS_VERSION])
        self.counters.max_gap = int(cells[pull_rules.PS_MAX_GAP])
        self.messages["compiled_push_pulls"] = int(cells[pull_rules.PS_SERVED])
        return done

    def _keep_house(self, now: float) -> bool:
        """What needs no message: silent workers, expired payload headers, memory samples;
        True once every worker is gone."""
        self._find_silent(now)
        self._expire_parked(now)
        self._sample_memory(now)
        return self._all_gone()

    def _sample_memory(self, now: float) -> None:
        """Resident memory about once a second (kept to 3,600 samples): shows that the
        server's memory stays flat however many messages it handles."""
        if now - self._last_rss_sample < 1.0 or len(self.rss_samples) >= 3600:
            return
        self._last_rss_sample = now
        self.rss_samples.append([round(now - self.t0, 3), rss_kb()])

    def stop(self) -> None:
        self._stop = True

    def _all_gone(self) -> bool:
        """Every worker shut down; a worker taken out for silence (PS) may still come back
        and shut down, so it is waited for until it has been silent for ``deadline``."""
        t = self.table
        if not (np.all(t.done | t.removed) and np.any(t.done)):
            return False
        gone_for = MPI.Wtime() - t.last_heard[t.removed & ~t.done]
        return bool(np.all(gone_for > self.config.deadline))

    # -- receiving and validating ---------------------------------------------------------
    def _reject(self, src: int, tag: int, reason: str, nbytes: int | None = None) -> None:
        if nbytes is not None:  # consume the message so it cannot block the queue
            self.comm.Recv([bytearray(max(nbytes, 1)), MPI.BYTE], source=src, tag=tag)
        key = (src, reason)
        self.rejected[key] = self.rejected.get(key, 0) + 1
        self.counters.rejected += 1
        if self.rejected[key] == 1:  # log each kind of rejection once per source
            self.log(f"mpsync server: dropped a message from rank {src} "
                      f"(tag {W.TAG_NAMES.get(tag, tag)}): {reason}")

    def _receive(self, src: int, tag: int, nbytes: int) -> None:
        """One probed message: validate it, hand it to its handler (the hot path: every
        worker comes through here once per iteration, so it avoids numpy scalars)."""
        if tag == W.BEAT:
            return self._on_beat(src, nbytes)
        handler = self._HANDLERS.get(tag)
        w = self.index.get(src)
        if handler is None:
            if tag == W.DATA:
                if w is not None and self.parked.get(src):
                    return self._resume_parked(src)
                return self._reject(src, tag, "payload without a header waiting for it", nbytes)
            return self._reject(src, tag, f"unknown message type {tag}", nbytes)
        if nbytes != _MSG_BYTES:
            return self._reject(src, tag, f"wrong size {nbytes} bytes (expected "
                                          f"{_MSG_BYTES})", nbytes)
        if w is None:
            return self._reject(src, tag, f"rank {src} is not a worker of this server", nbytes)
        self.comm.Recv(self._msg_spec, source=src, tag=tag)
        self._received(src, tag, w, MPI.Wtime(), handler)

    def _received(self, src: int, tag: int, w: int, now: float, handler=None) -> None:
        """The request now in ``self._msg``, from worker ``w``, received at ``now``: from the
        validation on (also where the compiled path hands over a message it leaves to us)."""
        if rules.request_problem(self._msg):
            return self._drop_payload(src, tag, rules.describe_problem(self._msg))
        msg = self._msg.tolist()   # Python floats: cheaper to read than numpy scalars
        if self.table.removed[w]:
            self.table.removed[w] = False  # it came back (PS): count it in again
            self.last_beat[w] = max(self.last_beat[w], now)  # not suspected again before its beat
            self.policy.on_rejoin(w)
            self.log(f"mpsync server: worker rank {src} is responding again; taken back in")
        rules.record_heard(self.cells, w, now)
        self.messages["python"] += 1
        self._dispatch(handler or self._HANDLERS[tag], src, tag, w, msg, now)

    def _dispatch(self, handler, src, tag, w, msg, now, retry_at=None) -> None:
        try:
            handler(self, src, w, msg, now)
        except Exception as e:  # a message no check above foresaw must not stop the server
            self._reject(src, tag, f"{type(e).__name__}: {e}")
        if self.held:
            self._retry_held(now if retry_at is None else retry_at)

    def _drop_payload(self, src, tag, reason):
        """Reject a header; if it announced a DATA payload that is already here, consume it
        too (one that comes later is dropped as a payload without a header)."""
        if tag in _PAYLOAD_TAGS and not self.parked.get(src) and \
                self.comm.Iprobe(src, W.DATA, self._data_status):
            self._reject(src, W.DATA, "payload of a rejected header",
                         self._data_status.Get_count(MPI.BYTE))
        self._reject(src, tag, reason)

    def _payload(self, src: int, w: int, tag: int, msg: list, now: float, count: int,
                 what: str) -> np.ndarray | None:
        """The DATA message announced by a header, or None: rejected, or not here yet, in
        which case the header is parked and its handler runs again when the DATA arrives
        (module doc); the loop goes on serving meanwhile."""
        if not 0 <= count <= W.MAX_COUNT:
            self._reject(src, W.DATA, f"{what}: announced size {count} out of range")
            return None
        if count == 0:
            return _NO_PAYLOAD   # sharded PS: the data went to the shard servers
        st = self._data_status
        resuming = self._resuming is msg
        self._resuming = None
        # A worker's DATA messages answer its headers in order: a header parked earlier
        # takes the next one.
        if not resuming and (self.parked.get(src) or not self.comm.Iprobe(src, W.DATA, st)):
            self.parked.setdefault(src, collections.deque()).append(
                (tag, w, msg, now, MPI.Wtime() + self.config.deadline))
            return None
        if resuming:
            self.comm.Iprobe(src, W.DATA, st)  # the loop saw it; this fills in its size
        nbytes = st.Get_count(MPI.BYTE)
        if nbytes != count * 8:
            self._reject(src, W.DATA, f"{what}: payload of {nbytes} bytes, header announced "
                                      f"{count * 8}", nbytes)
            return None
        buf = np.empty(count, dtype=np.float64)
        self.comm.Recv([buf, MPI.DOUBLE], source=src, tag=W.DATA)
        return buf

    def _resume_parked(self, src: int) -> None:
        """The DATA for ``src``'s oldest parked header has arrived: run its handler again."""
        tag, w, msg, received, _ = self.parked[src].popleft()
        self.table.last_heard[w] = MPI.Wtime()
        self._resuming = msg
        self._dispatch(self._HANDLERS[tag], src, tag, w, msg, received, retry_at=MPI.Wtime())
        if self._resuming is msg:  # the handler failed before it took its payload
            self._resuming = None
            st = self._data_status
            if self.comm.Iprobe(src, W.DATA, st):
                self._reject(src, W.DATA, "payload of a rejected header", st.Get_count(MPI.BYTE))

    def _expire_parked(self, now: float) -> None:
        for src, queue in self.parked.items():
            while queue and queue[0][4] < now:
                tag = queue.popleft()[0]
                self._reject(src, tag, f"{W.TAG_NAMES[tag]}: no payload within "
                                       f"{self.config.deadline:g}s")

    def _on_beat(self, src: int, nbytes: int) -> None:
        w = self.index.get(src)
        if w is None or nbytes != 8 * heartbeat.BEAT_LEN:
            why = (f"rank {src} is not a worker of this server" if w is None else
                   f"wrong size {nbytes} bytes (expected {8 * heartbeat.BEAT_LEN})")
            return self._reject(src, W.BEAT, why, nbytes)
        self.comm.Recv([self._beat_buf, MPI.DOUBLE], source=src, tag=W.BEAT)
        period, shard = float(self._beat_buf[0]), float(self._beat_buf[1])
        if not 0 < period <= heartbeat.MAX_PERIOD_S:
            return self._reject(src, W.BEAT, f"beat period {period!r} not in (0, "
                                             f"{heartbeat.MAX_PERIOD_S:g}] s")
        if not (shard == int(shard) and -1 <= shard < self.table.n):
            return self._reject(src, W.BEAT, f"shard {shard!r} is no shard index")
        self.shard_of[w] = int(shard)
        self.beat_period[w] = period
        now = MPI.Wtime()
        if self.last_beat[w] > 0 and now - self.last_beat[w] > self.beat_gap[w]:
            # The longest wait between two beats, and the worker's iteration then: how close
            # a live worker came to being suspected (stats).
            self.beat_gap[w] = now - self.last_beat[w]
            self.beat_gap_at[w] = self.table.iteration[w]
        self.last_beat[w] = now
        self.beats += 1

    # -- silent workers ----------------------------------------------------------------------
    def _drain_beats(self) -> None:
        """Receive every beat already here (the loop serves one message per probe; after a
        burst, or a pause of the server's own, beats may be queued behind others)."""
        status = self._beat_status
        while self.comm.Iprobe(MPI.ANY_SOURCE, W.BEAT, status):
            self._on_beat(status.Get_source(), status.Get_count(MPI.BYTE))

    def _find_silent(self, now: float) -> None:
        t = self.table
        self._drain_beats()
        away, self._last_house = now - self._last_house, now
        # The server itself was away (a long policy computation, a compile, its host's load):
        # the beats it did not receive then say nothing of the workers.  Judge at the next
        # round, against beats received since.
        started = np.frombuffer(self.counters.steps, dtype=np.int64) > 0
        lost = heartbeat.suspects(now, self.last_beat, self.beat_period,
                                  self.config.suspect_after, t.active & started,
                                  self.beat_gap) \
            if away < 1.0 else np.empty(0, dtype=np.int64)
        if lost.size:
            bound = float(heartbeat.suspect_bound(self.beat_period[lost],
                                                  self.config.suspect_after,
                                                  self.beat_gap[lost]).max())
            return self._take_out(lost, now, round(bound, 1),
                                  "no heartbeat: its process stopped, its node down or its "
                                  "link cut", gone=True)
        # A worker that has not made its first step is still starting (imports, data loading,
        # broadcasts: tens of seconds on a loaded node): it gets the start-up timeout instead.
        silent = np.flatnonzero(t.active & ~t.waiting & (
            (started & (now - t.last_heard > self.config.silent_timeout)) |
            (~started & (now - self.t0 > self.config.startup_timeout))))
        if silent.size == 0:
            return
        if self.config.topology == "ring":
            # A ring collective cannot complete without every worker: abort instead of hanging.
            # Workers told SYNC wait in the collective for the silent one and fall silent too;
            # the cause is a worker that was told to compute and never reported back.
            cause = [w for w in silent if not t.in_sync[w]] or list(silent)
            if len(cause) == len(silent) > 1 and \
                    (now - t.last_heard[silent]).min() < \
                    self.config.silent_timeout + self.config.deadline:
                # Every silent worker may be inside a collective that needs no server round
                # (BSP's, OSP's), waiting for one of the others: the server cannot tell which
                # one stopped, while each waiting worker's collective deadline names the one
                # it waits for.  Leave the naming to them; abort here only if none does.
                return
            waiting = [self.ranks[w] for w in silent if w not in cause]
            also = f"rank(s) {waiting} are waiting for them" if waiting else None
            return self._take_out(np.asarray(cause), now, self.config.silent_timeout, also)
        self._take_out(silent, now, self.config.silent_timeout, None)

    def _take_out(self, silent: np.ndarray, now: float, bound: float, why: str | None,
                  gone: bool = False) -> None:
        """Workers ``silent`` for more than ``bound`` seconds: the ring ends the job naming
        them; the PS's policies go on without them (taken back when they speak again), unless
        they are ``gone`` (no beats) and host a shard."""
        t = self.table
        ranks = [self.ranks[w] for w in silent]
        said = f"mpsync server: worker rank(s) {ranks} silent for more than {bound:g}s" + \
            (f" ({why})" if why else "")
        if self.config.topology == "ring":
            self.log(f"{said}; the ring cannot continue without them: aborting the job")
            self.comm.Abort(3)
        shards = [int(self.shard_of[w]) for w in silent if self.shard_of[w] >= 0]
        if shards and gone:
            # The others' pushes and pulls need every shard's slice of the model.  (Only for
            # a process known gone: a worker silent only by the older rule may be a live one
            # waiting for that shard.)
            self.log(f"{said}; they host PS shard(s) {shards}: the parameter server cannot "
                     f"continue without them: aborting the job")
            self.comm.Abort(3)
        for w in silent:
            t.removed[w] = True
            self.events.add(now - self.t0, int(w), "removed", int(t.iteration[w]))
        self.log(f"{said}; taken out of the {self.config.policy} decisions (ZipLine paper "
                 f"§4), the others continue")
        self.policy.on_membership_change()
        self._retry_held(now)

    # -- what the server knows -----------------------------------------------------------------
    def view(self) -> ServerView:
        """A read-only view of the server's state (``_view``): what tests and tools read
        instead of the server's internals."""
        return ServerView(self)

    def stats(self) -> dict:
        """Everything the server measured, as JSON-ready data."""
        return self.view().stats()
