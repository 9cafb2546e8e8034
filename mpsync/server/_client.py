"""The worker's side of the control plane: one small class, usable from any script.

Every call pre-posts the receive for its reply, then sends its request (so a reply never sits
in the unexpected queue, where a co-located server's probe would see it), and waits for the
reply by polling with a deadline: a server that does not answer raises
:class:`DeadlineExceeded` naming the server rank and the call, instead of hanging.

The wait polls without sleeping for 2 ms, yielding the core between polls after the first
50 µs: a decision usually comes back within tens of microseconds, and a sleep, however
short, costs a scheduler wake-up (on a busy VM a 20 µs sleep returns after ~120 µs, at
times a 4 ms tick).  Replies
the server holds (a barrier, a staleness bound) take longer; after 2 ms the wait sleeps,
20 µs doubling to 1 ms, so a held worker does not keep a core busy.
"""

from __future__ import annotations

import array
import json
import math
import os
import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from mpsync.server import _fastpath, wire as W
from mpsync.server._client_ps import ParameterServerCalls

__all__ = ["SyncClient", "Decision", "PendingImportance", "ServerError", "DeadlineExceeded",
           "LOCAL", "SYNC"]

LOCAL = W.LOCAL
SYNC = W.SYNC
_BUSY_S = 50e-6          # poll without yielding this long: a prompt reply comes in ~10 µs
_SPIN_S = 2e-3           # poll without sleeping this long (module doc)
_SLEEP_MIN_S = 20e-6
_SLEEP_MAX_S = 1e-3
_new_tuple = tuple.__new__
_MSG_BYTES = W.MSG_LEN * 8


class ServerError(RuntimeError):
    """The state server answered something that breaks the protocol."""


class DeadlineExceeded(ServerError, TimeoutError):
    """A blocking wait passed its deadline; ``ranks`` are the silent ranks, ``awaited`` what
    was waited for."""

    def __init__(self, message: str, ranks=(), awaited: str = ""):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.awaited = awaited


class Decision(NamedTuple):
    """The server's answer to a step: ``action`` LOCAL or SYNC; ``local_iters`` more local
    iterations before the barrier (ElasticBSP; 0 when unknown or SYNC); ``round``; ``extra``."""

    action: int
    local_iters: int
    round: int
    extra: int = 0

    @property
    def sync(self) -> bool:
        return self.action == SYNC

    def __repr__(self) -> str:
        name = "SYNC" if self.action == SYNC else "LOCAL"
        return f"Decision({name}, local_iters={self.local_iters}, round={self.round})"


# A step's answer under a policy whose steps are all SYNC (``SyncClient.step_unawaited``).
_SYNC_UNAWAITED = Decision(SYNC, 0, 0)


class PendingDecision:
    """A delayed-ACK query in flight (ESync §4.2): ``poll()`` returns the READY decision once
    the server sent it, else None; the worker keeps training meanwhile.

    One pending decision covers all the reports of a round until READY: ``sent`` keeps each
    report's send time by sequence number, so the READY's round trip is measured from the
    report it answers (the reply's SEQ slot)."""

    _MAX_SENT = 4096   # reports remembered per round (a bound; a round rarely has 100)

    def __init__(self, client: "SyncClient", request: MPI.Request):
        self.client = client
        self.request = request
        self.decision: Decision | None = None
        self.sent: dict[int, float] = {}

    def _note_sent(self, seq: int, when: float) -> None:
        if len(self.sent) >= self._MAX_SENT:
            del self.sent[next(iter(self.sent))]
        self.sent[seq] = when

    def _check(self) -> bool:
        """Has READY arrived?  Records the query's round trip the first time it is seen."""
        if self.decision is None and self.request.Test():
            seen = time.perf_counter()
            self.client.control_received += _MSG_BYTES
            self.decision = self.client._decision()
            sent = self.sent.get(int(self.client._rep[W.R_SEQ]))
            if sent is not None:
                self.client.query_rtt = seen - sent
        return self.decision is not None

    def poll(self) -> Decision | None:
        if self._check() and self.client._pending is self:
            self.client._pending = None
        return self.decision


class PendingImportance:
    """An OSP importance report in flight (``SyncClient.start_report_importance``): its
    reply's receives are posted at once, into buffers of its own, so another call's reply
    cannot land in them."""

    def __init__(self, client: "SyncClient", iteration: int, seq: int, n_layers: int):
        self.client, self.iteration, self.seq = client, iteration, seq
        self._rep = np.empty(W.MSG_LEN, dtype=np.float64)
        self._out = np.empty(n_layers, dtype=np.float64)
        self._requests = (client.comm.Irecv([self._rep, MPI.DOUBLE], source=client.server,
                                            tag=W.REPLY),
                          client.comm.Irecv([self._out, MPI.DOUBLE], source=client.server,
                                            tag=W.REPLY_DATA))

    def wait(self) -> np.ndarray:
        """The bitmap (True = In-Computation Sync); waits with the client's deadline."""
        what = f"importance for iteration {self.iteration}"
        for request in self._requests:
            self.client._wait(request, what)  # noqa: SLF001 - the client's own wait
        if int(self._rep[W.R_SEQ]) != self.seq:
            raise ServerError(f"{what}: reply to request {int(self._rep[W.R_SEQ])}, expected "
                              f"{self.seq}")
        return self._out.astype(bool)


class SyncClient(ParameterServerCalls):
    """Talks to the state server at ``server_rank`` of ``comm`` (the control communicator);
    the parameter server's calls are :class:`ParameterServerCalls`'."""

    def __init__(self, comm, config, *, server_rank: int = 0, shards=None):
        self.comm = comm
        self.server = server_rank
        # The sharded parameter server's data plane (``shards.ShardClient``): PS payloads go
        # there and the state server gets the headers only.  None: to the state server's own
        # store (one process holding the whole model, float64).
        self.shards = shards
        self.deadline = float(config.deadline)
        # Request and reply: two halves of one array.array block (the compiled step takes its
        # address), written and read cell by cell through memoryviews, ~0.05 µs a cell against
        # ~0.4 µs for a numpy scalar.
        cells = array.array("d", bytes(16 * W.MSG_LEN))
        both = np.frombuffer(cells, dtype=np.float64)
        self._req, self._rep = memoryview(cells)[:W.MSG_LEN], memoryview(cells)[W.MSG_LEN:]
        self._req_spec = [self._req, MPI.DOUBLE]
        self._rep_spec = [self._rep, MPI.DOUBLE]
        self._seq = 0
        self.alive_every = float(getattr(config, "silent_timeout", 10.0)) / 4
        self._next_alive = 0.0
        self._heartbeat = None
        self._pending: PendingDecision | None = None
        # Replies to requests sent without waiting (push_pull, an unawaited step), collected
        # before the next call that waits for a reply: (request, buffer, seq, what, step).
        self._later: list = []
        # Their buffers (ASP's: a step's and a push_pull's reply for each of two iterations,
        # collected after the next exchange): a request waits for the oldest only when all
        # are in use (``_post_later``).
        self._later_bufs = tuple(W.new_msg() for _ in range(4))
        self._version = 0        # the model version in the latest pull reply collected
        self.iteration = 0
        # Control-plane bytes on this worker's link (headers, replies, their payloads).
        self._control_sent = 0
        self._control_received = 0
        self._fast_steps = 0     # compiled steps: a request and a reply each (control bytes)
        self.loss_reports = 0    # LOSS messages sent (report_loss)
        self.wait_s = 0.0        # total time spent waiting for the server
        self.last_rtt = 0.0      # duration of the last blocking call (any kind)
        # ESync §4.2 delayed ACK: the round trip of a state query, as the worker experiences
        # it (see step_async); 0 until the first READY arrived.
        self.query_rtt = 0.0
        # The compiled step (_fastpath), where this MPI allows it: header, send and polling
        # in one call instead of five through mpi4py and a Python wait loop.
        self._fast = None
        if getattr(config, "server_fast_path", True) and _fastpath.unavailable_reason() is None:
            self._fast = _fastpath.ClientPath(comm, server_rank, both)
            self._query, self._query_args = self._fast.call, self._fast.args
            self._fast_decision = self._fast.decision
        # The first reply comes only once the server has started (imports, its rules compiled
        # or loaded from cache), which on a busy node takes longer than a decision may: the
        # server allows a worker ``startup_timeout`` to register, and the worker allows the
        # server as much, as the broadcasts after model construction do.
        steady = self.deadline
        self.deadline = max(steady, float(getattr(config, "startup_timeout", steady)))
        try:
            self._call(W.REGISTER, "register")
        finally:
            self.deadline = steady
        self.wait_s = 0.0        # the server's start-up is not waiting for decisions
        self.last_rtt = 0.0      # nor a round trip

    # -- plumbing ---------------------------------------------------------------------------
    def _header(self, iteration=0, compute=0.0, round_=0, agg=0.0, count=0, flag=0):
        self._seq += 1
        m = self._req
        m[W.SEQ] = self._seq
        m[W.ITER] = iteration
        m[W.COMPUTE] = compute
        m[W.ROUND] = round_
        m[W.AGG] = agg
        m[W.WAIT] = self.wait_s
        m[W.COUNT] = count
        m[W.FLAG] = flag
        return self._req_spec

    def _wait(self, request: MPI.Request, what: str) -> None:
        clock, test = time.perf_counter, request.Test
        start = clock()
        if not test():
            self._poll(request, start, start + _BUSY_S, what)
        elapsed = clock() - start
        self.wait_s += elapsed
        self.last_rtt = elapsed

    def _poll(self, request: MPI.Request, start: float, busy_until: float, what: str) -> None:
        """Wait for ``request`` (module doc): busy until ``busy_until``, then yielding, then
        sleeping until the deadline."""
        clock, test = time.perf_counter, request.Test
        spin_until = start + _SPIN_S
        while not test():
            now = clock()
            if now < busy_until:
                continue
            if now < spin_until:
                os.sched_yield()  # a busy node: let whatever else is runnable go first
                continue
            self._sleep_until_reply(request, start, what)
            break

    def _sleep_until_reply(self, request: MPI.Request, start: float, what: str) -> None:
        """A reply the server holds: poll with sleeps (module doc) until the deadline."""
        sleep = _SLEEP_MIN_S
        limit = start + self.deadline
        while not request.Test():
            if time.perf_counter() > limit:
                request.Cancel()
                raise DeadlineExceeded(
                    f"no reply from the state server (rank {self.server}) to {what} "
                    f"within the {self.deadline:g}s deadline", [self.server], what)
            time.sleep(sleep)
            sleep = min(2 * sleep, _SLEEP_MAX_S)

    def _call(self, tag: int, what: str, *, header=None, data=None, reply_data=None):
        if self._later:
            self._collect_later()
        if self._pending is not None:
            # A delayed-ACK query still waiting for READY must not catch this call's reply.
            if not self._pending.request.Test():
                self._pending.request.Cancel()
                self._pending.request.Wait()
            self._pending = None
        header = self._header() if header is None else header
        seq = self._seq
        rep = self.comm.Irecv(self._rep_spec, source=self.server, tag=W.REPLY)
        rdata = None
        if reply_data is not None:
            rdata = self.comm.Irecv([reply_data, MPI.DOUBLE], source=self.server,
                                    tag=W.REPLY_DATA)
        self.comm.Send(header, dest=self.server, tag=tag)
        self.control_sent += _MSG_BYTES
        if data is not None:
            self.comm.Send([data, MPI.DOUBLE], dest=self.server, tag=W.DATA)
            self.control_sent += data.nbytes
        self._wait(rep, what)
        self.control_received += _MSG_BYTES + (reply_data.nbytes if reply_data is not None
                                               else 0)
        self._check_reply_to(seq, what)
        if rdata is not None:
            self._wait(rdata, what + " (payload)")
        return self._rep

    def _collect_later(self, keep: int = 0, steps_if_in: bool = False) -> None:
        """Wait for the replies to the requests sent without waiting (``push_pull``,
        ``step_unawaited``), all but the newest ``keep``; ``steps_if_in``: a step's reply
        only if it is in (the others wait for the next collection)."""
        cut = max(len(self._later) - keep, 0)
        later, self._later = self._later[:cut], self._later[cut:]
        left = []
        for entry in later:
            request, buf, seq, what, step = entry
            if step and steps_if_in and not request.Test():
                left.append(entry)
                continue
            self._wait(request, what)
            self.control_received += _MSG_BYTES
            if int(buf[W.R_SEQ]) != seq:
                raise ServerError(f"{what}: reply to request {int(buf[W.R_SEQ])}, expected {seq}")
            if step:
                if int(buf[W.R_ACTION]) != SYNC:
                    raise ServerError(f"{what}: the server answered LOCAL to a step this "
                                      f"worker reported without waiting (its policy's steps "
                                      f"are all SYNC: server and workers of one version?)")
                continue
            self._version = int(buf[W.R_VERSION])
            self.sure_pulls = int(buf[W.R_EXTRA])   # (a pull's reply is collected last)
        self._later[:0] = left

    def _post_later(self, tag: int, header, what: str, step: bool = False) -> None:
        """Send the request ``header`` (``tag``) to the server, its reply to be collected
        later (:meth:`_collect_later`) into a buffer of its own; where every buffer waits for
        a reply, the oldest is collected first."""
        if len(self._later) >= len(self._later_bufs):
            self._collect_later(keep=len(self._later_bufs) - 1)
        pending = {id(entry[1]) for entry in self._later}
        buf = next(b for b in self._later_bufs if id(b) not in pending)
        request = self.comm.Irecv([buf, MPI.DOUBLE], source=self.server, tag=W.REPLY)
        self.comm.Send(header, dest=self.server, tag=tag)
        self._later.append((request, buf, self._seq, what, step))
        self.control_sent += _MSG_BYTES

    def _check_reply_to(self, seq: int, what: str) -> None:
        """The reply in the buffer must answer request ``seq``."""
        if int(self._rep[W.R_SEQ]) != seq:
            raise ServerError(f"{what}: reply to request {int(self._rep[W.R_SEQ])}, expected "
                              f"{seq} (two users of one SyncClient?)")

    def _decision(self) -> Decision:
        r = self._rep
        # tuple.__new__ (what namedtuple's _make uses): 0.3-0.4 µs less than Decision(...).
        return _new_tuple(Decision, (int(r[W.R_ACTION]), int(r[W.R_LOCAL]),
                                     int(r[W.R_ROUND]), int(r[W.R_EXTRA])))

    # -- the calls --------------------------------------------------------------------------
    @property
    def control_sent(self) -> int:
        """Control-plane bytes this worker sent (headers and their payloads)."""
        return self._control_sent + self._fast_steps * _MSG_BYTES

    @control_sent.setter
    def control_sent(self, value: int) -> None:
        self._control_sent = value - self._fast_steps * _MSG_BYTES

    @property
    def control_received(self) -> int:
        """Control-plane bytes this worker received (replies and their payloads)."""
        return self._control_received + self._fast_steps * _MSG_BYTES

    @control_received.setter
    def control_received(self, value: int) -> None:
        self._control_received = value - self._fast_steps * _MSG_BYTES

    @property
    def compiled(self) -> bool:
        """True where this client's steps run the compiled round trip (``_fastpath``)."""
        return self._fast is not None

    def step(self, iteration: int, compute_time: float) -> Decision:
        """Report that local iteration ``iteration`` finished after ``compute_time`` seconds
        and ask what to do next, in one round trip."""
        self.iteration = it = int(iteration)
        if self._later:
            self._collect_later()
        if self._fast is None or self._pending is not None:
            self._call(W.STEP, f"step {iteration}", header=self._header(it, compute_time))
            return self._decision()
        # The compiled round trip: header, receive posted, send, 50 µs of busy polling, the
        # reply's sequence number checked.  Every line here is on each iteration's critical
        # path (bench/server/README.md), hence the local names.
        seq = self._seq = self._seq + 1
        self._fast_steps += 1
        elapsed = self._query(*self._query_args, seq, it, float(compute_time), self.wait_s,
                              _BUSY_S)
        if elapsed < 0.0:
            return self._slow_step(elapsed, seq, it)
        self.wait_s += elapsed
        self.last_rtt = elapsed
        return _new_tuple(Decision, self._fast_decision)

    def step_unawaited(self, iteration: int, compute_time: float) -> Decision:
        """Report that local iteration ``iteration`` finished after ``compute_time``
        seconds, for a policy whose every step is SYNC (``PolicySpec.steps_unawaited``:
        ASP, SSP, DSSP), without waiting for the reply: SYNC, at once.  The reply is
        collected after the next exchange (or before the next call that waits for one) and
        must say SYNC.

        Why: there the round trip decided nothing and was a wait on every iteration (ASP:
        0.7-1.0 s per worker in 10 s of the wide MLP on 4 workers, 2 cores), while the
        server still needs the report (compute times, iterations, the trace)."""
        self.iteration = it = int(iteration)
        if self._pending is not None:   # (a delayed-ACK query: not this policy's)
            return self.step(iteration, compute_time)
        self._post_later(W.STEP, self._header(it, compute_time), f"step {iteration}",
                         step=True)
        return _SYNC_UNAWAITED

    def _slow_step(self, code: float, seq: int, iteration: int) -> Decision:
        """The compiled step's reply did not come within its busy polling (wait for it here),
        or came wrong."""
        what = f"step {iteration}"
        if code == _fastpath.REPLY_OUT_OF_ORDER:
            self._check_reply_to(seq, what)
        if code < -1.0:
            raise MPI.Exception(int(-2.0 - code))
        clock = time.perf_counter
        start = clock() - _BUSY_S   # (it polled that long already)
        self._poll(self._fast.pending(), start, start, what)
        self._check_reply_to(seq, what)
        self.last_rtt = elapsed = clock() - start
        self.wait_s += elapsed
        return self._decision()

    def step_async(self, iteration: int, compute_time: float) -> PendingDecision:
        """ESync delayed-ACK mode (§4.2): report without waiting; only READY is answered.

        The report carries ``query_rtt``, which §4.2 adds to the capability ("the time to
        process b samples and the RTT of state query operation on device i").  NOT-READY is
        never sent in this mode, so the only round trip a worker can time is a READY's: from
        the send of the report it answers to the moment the worker sees it.  A worker sees
        replies only between iterations (here, or in ``poll``), so this includes up to one
        iteration of detection delay besides network and server time; that is intended: the
        capability must say how long after READY the device actually joins the aggregation,
        and a polling device runs exactly the iterations that fit in this span (δ - 1 of
        §4.2) before it does.  The duration of blocking calls (``last_rtt``: push/pull with
        their payloads on the PS) is a different operation and is not used.
        """
        self.iteration = int(iteration)
        if self._pending is not None:
            # READY may have arrived during the iteration just finished: see it now, so its
            # round trip is not stretched by the caller's next poll.
            self._pending._check()
        else:
            req = self.comm.Irecv(self._rep_spec, source=self.server, tag=W.REPLY)
            self._pending = PendingDecision(self, req)
        header = self._header(iteration, compute_time, agg=self.query_rtt, flag=1)
        self._pending._note_sent(self._seq, time.perf_counter())
        self.comm.Send(header, dest=self.server, tag=W.STEP)
        self.control_sent += _MSG_BYTES
        return self._pending

    def ready_arrived(self) -> bool:
        """Delayed-ACK mode (§4.2): has the READY to an earlier report arrived?  Checked
        without sending anything (the worker asks between backward and the optimizer step,
        to abort the iteration READY interrupted)."""
        pending = self._pending
        return pending is not None and pending.poll() is not None

    def reset(self, round_: int, aggregation_time: float) -> None:
        """The aggregation that ends round ``round_ - 1`` finished (no reply is awaited)."""
        header = self._header(self.iteration, 0.0, round_, aggregation_time)
        self.comm.Send(header, dest=self.server, tag=W.RESET)
        self.control_sent += _MSG_BYTES

    def report_loss(self, loss: float, count: int = 1, noise=(0.0, 0.0, 0),
                    lr_changed: bool = False) -> None:
        """This worker's mean training loss over its last ``count`` iterations (policy
        ``auto`` watches it: ``mpsync.auto.stability``) and its gradient noise since the last
        report, ``noise`` = (summed ½|g₁ - g₂|², summed g₁ · g₂, pairs) (``mpsync.auto.noise``);
        ``lr_changed``: its learning rate changed since the last report.  No reply is
        awaited.  A loss below 0 (a loss that is not a divergence measure) is not sent, nor
        is its noise (a change of learning rate waits for the next report)."""
        finite = math.isfinite(loss)
        if finite and loss < 0:
            return
        flag = (0 if finite else W.NOT_FINITE) | (W.LR_CHANGED if lr_changed else 0)
        header = self._header(self.iteration, 0.0, 0, loss if finite else 0.0,
                              count=max(int(count), 1), flag=flag)
        m = self._req
        half_diff, dot, pairs = noise
        m[W.L_NOISE], m[W.L_POWER], m[W.L_PAIRS] = half_diff, max(half_diff + dot, 0.0), pairs
        self.comm.Send(header, dest=self.server, tag=W.LOSS)
        self.control_sent += _MSG_BYTES
        self.loss_reports += 1

    def report_stride(self, pairs: int, p: float, a: float, q: float) -> None:
        """Auto's step test over ``pairs`` probes since the last report: summed ``p``, ``a``
        and ``q`` (``mpsync.torch.strategies.gradient_pairs``, ``mpsync.auto.curvature``).
        No reply is awaited."""
        data = np.array([pairs, p, a, q], dtype=np.float64)
        self.comm.Send(self._header(self.iteration, count=data.size), dest=self.server,
                       tag=W.STRIDE)
        self.comm.Send([data, MPI.DOUBLE], dest=self.server, tag=W.DATA)
        self.control_sent += _MSG_BYTES + data.nbytes

    def alive(self) -> None:
        """Tell the server this worker is busy outside its steps (a script's own collectives:
        an evaluation's metric averaging, a test suite's collectives between models), so a
        worker that stepped once and then runs only those for longer than ``silent_timeout``
        is not taken for a silent one.  At most one message per quarter of that timeout; none
        while a reply is pending (the server then counts the worker as waiting for it)."""
        now = time.monotonic()
        if now < self._next_alive or self._pending is not None or self._later:
            return
        self._next_alive = now + self.alive_every
        self.comm.Send(self._header(self.iteration), dest=self.server, tag=W.ALIVE)
        self.control_sent += _MSG_BYTES

    def start_heartbeat(self, period: float, shard: int = -1) -> bool:
        """Beat every ``period`` seconds from a thread (:mod:`mpsync.server.heartbeat`), so
        the server suspects this worker within seconds if its process or link stops; False
        (no thread) when ``period`` is 0 or MPI was not initialised with threads.  ``shard``:
        the PS shard this process hosts (-1: none)."""
        from mpsync.server.heartbeat import Heartbeat

        self.stop_heartbeat()
        if not period > 0 or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return False
        self._heartbeat = Heartbeat(self.comm, self.server, period, W.BEAT, shard)
        return True

    def stop_heartbeat(self) -> None:
        beat, self._heartbeat = getattr(self, "_heartbeat", None), None
        if beat is not None:
            beat.stop()

    def report_importance(self, importance, layer_sizes=None, loss: float | None = None,
                          epoch: int = 0, u_max: float | None = None) -> np.ndarray:
        """OSP: the layer importance of the previous iteration's global gradients (and layer
        sizes), this iteration's loss and 1-based epoch, and the ICS bound ``u_max`` (model
        elements) this worker measured; returns this iteration's bitmap, True = In-Computation
        Sync (the same for every worker)."""
        header, data = self._importance_message(self.iteration, importance, layer_sizes, loss,
                                                epoch, u_max)
        out = np.empty(data.size // 2, dtype=np.float64)
        self._call(W.IMPORTANCE, "importance", header=header, data=data, reply_data=out)
        return out.astype(bool)

    def start_report_importance(self, iteration: int, importance, layer_sizes=None,
                                loss: float | None = None, epoch: int = 0,
                                u_max: float | None = None) -> "PendingImportance":
        """``report_importance`` for the bitmap of ``iteration`` without waiting: the reply
        lands in buffers of its own while the worker computes, and ``wait()`` returns the
        bitmap.  Calls made meanwhile are answered after it (the server answers one rank's
        requests in order, and a rank's messages on one tag are received in that order)."""
        header, data = self._importance_message(iteration, importance, layer_sizes, loss,
                                                epoch, u_max)
        pending = PendingImportance(self, int(iteration), self._seq, data.size // 2)
        self.comm.Send(header, dest=self.server, tag=W.IMPORTANCE)
        self.comm.Send([data, MPI.DOUBLE], dest=self.server, tag=W.DATA)
        return pending

    def _importance_message(self, iteration, importance, layer_sizes, loss, epoch, u_max):
        if self._pending is not None:
            raise ServerError("importance report while a delayed-ACK query is pending")
        imp = np.ascontiguousarray(importance, dtype=np.float64)
        sizes = (np.ones_like(imp) if layer_sizes is None
                 else np.ascontiguousarray(layer_sizes, dtype=np.float64))
        if sizes.shape != imp.shape:
            raise ValueError(f"layer_sizes has shape {sizes.shape}, importance {imp.shape}")
        flag = int(epoch) if loss is not None else 0
        header = self._header(iteration, 0.0 if not u_max else float(u_max), 0,
                              0.0 if loss is None else float(loss), count=imp.size, flag=flag)
        return header, np.concatenate([imp, sizes])

    def ring_only(self) -> None:
        """Policy ``auto``: this worker's model cannot go on the parameter server (it mixes
        dtypes), so the server drops its PS candidates; sent before the first step, and
        answered, so no decision is made without it."""
        self._call(W.REGISTER, "ring only", header=self._header(flag=W.RING_ONLY))

    def stats(self) -> dict:
        self._call(W.STATS, "stats")
        size = int(self._rep[W.R_COUNT])
        buf = np.empty(size, dtype=np.uint8)
        req = self.comm.Irecv([buf, MPI.BYTE], source=self.server, tag=W.REPLY_STATS)
        self._wait(req, "stats (payload)")
        self.control_received += size
        return json.loads(buf.tobytes().decode())

    def shutdown(self) -> None:
        self.stop_heartbeat()   # its last beat leaves before the goodbye
        self._call(W.SHUTDOWN, "shutdown")
