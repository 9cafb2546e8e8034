"""What each request does, by message type: the state server's handlers.

Each handler gets a request already received and checked by the serve loop (``_loop``), from
worker ``w``, with its receipt time ``now``; it applies the per-message rules (``rules``), asks
the policy, updates the parameter server's weights (``weights``) and replies.  A reply the
tables cannot give yet is held and decided again after every message (``_retry_held``).
"""

from __future__ import annotations

import json

import numpy as np
from mpi4py import MPI

from mpsync import policies
from mpsync.server import rules, wire as W

__all__ = ["MessageHandlers"]

_NO_PAYLOAD = np.empty(0)   # a sharded PS's push: the data went to the shard servers


class MessageHandlers:
    """The handlers of :class:`~mpsync.server.StateServer` (a base class of it: they share
    its tables, policy, weights and reply buffer)."""

    # -- replies ----------------------------------------------------------------------------
    def _send_reply(self, src, seq, action=W.SYNC, local_iters=0, extra=0, count=0, version=0,
                    pull_round=0):
        rules.fill_reply(self._reply, action, local_iters, self.table.round[self.index[src]],
                         seq, extra, count, version)
        self._reply[W.R_PULL_ROUND] = pull_round
        self.comm.Send(self._reply_spec, dest=src, tag=W.REPLY)

    # -- handlers ---------------------------------------------------------------------------
    def _on_register(self, src, w, msg, now):
        self.table.registered[w] = True
        self.table.last_event[w] = now
        self.events.add(now - self.t0, w, "register", 0)
        if msg[W.FLAG] == W.RING_ONLY and hasattr(self.policy, "worker_ring_only"):
            self.policy.worker_ring_only(w)
        self._send_reply(src, msg[W.SEQ])

    def _on_step(self, src, w, msg, now):
        k, compute = int(msg[W.ITER]), msg[W.COMPUTE]
        rules.record_report(self.cells, w, k, compute, now)
        rules.count_step(self.counters.cells, w, compute, msg[W.WAIT])
        delayed = msg[W.FLAG] == 1 and self.delayed_ack
        if delayed:
            decision = self.policy.on_step(w, k, compute, now, delayed_ack=True, rtt=msg[W.AGG])
        else:
            decision = self.policy.on_step(w, k, compute, now)
        self.events.add(now - self.t0, w, "report", k)
        if decision is None:
            self.held.append((W.STEP, src, w, msg[W.SEQ], k))
            self.table.waiting[w] = True
            return
        self._answer_step(src, w, msg[W.SEQ], decision, now, delayed)

    def _answer_step(self, src, w, seq, decision, now, delayed=False):
        action, local_iters, extra = decision
        rules.record_answer(self.cells, self.counters.cells, self.events.cells, w, action,
                            now - self.t0)
        if action == W.LOCAL and delayed:
            return  # §4.2: NOT-READY is implicit in delayed-ACK mode
        self._send_reply(src, seq, action, local_iters, extra)

    def _on_reset(self, src, w, msg, now):
        rnd = int(msg[W.ROUND])
        rules.count_reset(self.counters.cells, w, msg[W.AGG])
        self.policy.on_reset(w, rnd, now)
        self.events.add(now - self.t0, w, "reset", rnd)
        # No reply: the worker does not wait for it (the next step's reply orders everything,
        # messages from one rank are received in the order they were sent).

    def _on_loss(self, src, w, msg, now):
        flag = int(msg[W.FLAG])
        loss = float("inf") if flag & W.NOT_FINITE else msg[W.AGG]
        if flag & W.LR_CHANGED:
            self.policy.on_learning_rate_change(w, int(msg[W.ITER]), now)
        self.policy.on_loss(w, int(msg[W.ITER]), loss, max(int(msg[W.COUNT]), 1), now)
        if msg[W.L_PAIRS] >= 1:
            noise = float(msg[W.L_NOISE])
            self.policy.on_gradient_noise(w, noise, float(msg[W.L_POWER]) - noise,
                                          int(msg[W.L_PAIRS]), now)
        # No reply, as for a reset.

    def _on_stride(self, src, w, msg, now):
        """Auto's step test since the worker's last report (``mpsync.auto.curvature``)."""
        data = self._payload(src, w, W.STRIDE, msg, now, int(msg[W.COUNT]), "stride")
        if data is None:
            return
        no_test = data.size == W.STRIDE_LEN and data[0] == 0 and not np.any(data[1:])
        if data.size != W.STRIDE_LEN or not np.all(np.isfinite(data)) or \
                (data[0] < 1 and not no_test) or data[2] < 0:
            return self._reject(src, W.STRIDE, f"step test: expected {W.STRIDE_LEN} finite "
                                               f"sums (pairs >= 1, a >= 0; or all 0: no step "
                                               f"test), got {data.tolist()}")
        self.policy.on_stride(w, int(data[0]), float(data[1]), float(data[2]), float(data[3]),
                              now)

    def _on_alive(self, src, w, msg, now):
        """Nothing to decide: receiving it (``_received``) is what marks the worker alive."""

    def _on_importance(self, src, w, msg, now):
        n_layers = int(msg[W.COUNT])
        data = self._payload(src, w, W.IMPORTANCE, msg, now, 2 * n_layers, "importance")
        if data is None:
            return
        if not self.policy.takes_importance:
            return self._reject(src, W.IMPORTANCE, f"importance report under policy "
                                                   f"{self.config.policy!r}")
        if not np.all(np.isfinite(data)) or np.any(data[n_layers:] < 0):
            return self._reject(src, W.IMPORTANCE, "importance or layer sizes not finite/>= 0")
        loss = float(msg[W.AGG]) if msg[W.FLAG] >= 1 else None
        u_max = float(msg[W.COMPUTE]) if msg[W.COMPUTE] > 0 else None
        bitmap = self.policy.bitmap_for(int(msg[W.ITER]), data[:n_layers], data[n_layers:],
                                        loss, int(msg[W.FLAG]), u_max, w)
        out = bitmap.astype(np.float64)
        self._send_reply(src, msg[W.SEQ], count=n_layers)
        self.comm.Send([out, MPI.DOUBLE], dest=src, tag=W.REPLY_DATA)

    def _on_ps_init(self, src, w, msg, now):
        data = self._payload(src, w, W.PS_INIT, msg, now, int(msg[W.COUNT]), "ps_init")
        if data is None:
            return
        if not policies.hosts_shards(self.config):
            return self._reject(src, W.PS_INIT, "ps_init on topology='ring' (and no auto_ps)")
        self.weights.init(data)
        self._send_reply(src, msg[W.SEQ], version=self.weights.version)

    def _on_push(self, src, w, msg, now):
        data = self._payload(src, w, W.PUSH, msg, now, int(msg[W.COUNT]), "push")
        if data is not None and self._count_push(src, w, msg, now, data, W.PUSH):
            self._send_reply(src, msg[W.SEQ], version=self.weights.version)

    def _on_push_pull(self, src, w, msg, now):
        """Sharded PS: a push the shards applied (or, ASP, are applying) and the pull after
        it, in one header (``SyncClient.push_pull``): counted as a push, then answered as a
        pull, one reply, the pull's.  Half the messages of a PUSH and a PULL, for the
        exchange every ASP iteration and every sure SSP/DSSP pull makes."""
        if int(msg[W.COUNT]) != 0:
            return self._reject(src, W.PUSH_PULL, "push_pull with a payload: the shard "
                                                  "servers hold the model")
        if self._count_push(src, w, msg, now, _NO_PAYLOAD, W.PUSH_PULL):
            self._on_pull(src, w, msg, now, push_pull=True)

    def _count_push(self, src, w, msg, now, data, tag) -> bool:
        """Apply (a sharded PS: count) worker ``w``'s push; False if it was refused."""
        problem = self.weights.apply(data)
        if problem:
            self._reject(src, tag, problem)
            return False
        self.counters.pushes[w] += 1
        self.policy.on_push(w, now)
        if not self.table.compute[w] > 0:
            # A worker that reports no steps (ASP, SSP, DSSP: push and pull are its only
            # messages) is paced by its pushes: the serve loop wakes up for the next one
            # (``rules.next_report_due``) instead of sleeping through it.  A reporting one
            # (ElasticBSP) keeps its report intervals, which ZipLine predicts from.
            last = self.table.last_event[w]
            if last == last:
                self.table.interval[w] = now - last
            self.table.last_event[w] = now
        if msg[W.FLAG] == 1:
            # Its last push: a staleness rule must not wait for a worker that stopped training.
            self.table.final_pushed[w] = True
        self.events.add(now - self.t0, w, "push", int(msg[W.ITER]))
        return True

    def _on_pull(self, src, w, msg, now, push_pull=False):
        if not self.weights.ready or (msg[W.FLAG] != 1 and not self.policy.may_pull(w)):
            # Held: worker 0's ps_init may still be on its way, or the staleness rule.
            if self.weights.ready:
                self.counters.held_pulls[w] += 1
                self.events.add(now - self.t0, w, "held", int(self.table.pushes[w]))
            self.held.append((W.PULL, src, w, float(msg[W.SEQ]), int(msg[W.COUNT])))
            self.table.waiting[w] = True
            return
        self._answer_pull(src, w, float(msg[W.SEQ]), int(msg[W.COUNT]),
                          final=msg[W.FLAG] == 1, push_pull=push_pull)

    def _answer_pull(self, src, w, seq, count, final=False, push_pull=False):
        """``push_pull``: answering a ``PUSH_PULL``, where the worker reads the shards in
        one exchange; where the policy never holds a pull (ASP) its next one's reply is
        collected later (``table.unawaited``, as ``pull_rules.ps_push_pull`` marks it).
        A sure pull's is too, but the worker may still ask (a benchmark of the asked path
        does): the loop keeps waking up for those."""
        problem = self.weights.pull_problem(count)
        if problem:
            return self._reject(src, W.PULL, problem)
        # (count 0: the sharded PS's pull, whose weights come from the shards)
        round_, left_out = (self._round_told(w) if self.rounds_told and not final
                            and count == 0 else (0, None))
        if left_out is not None:
            count = left_out.size
        # EXTRA: the further pushes whose pulls the policy grants whatever comes meanwhile
        # (``Policy.sure_pulls``): the worker reads those from the shards without asking.
        extra = self.policy.sure_pulls(w)
        self._send_reply(src, seq, count=count, version=self.weights.version,
                         extra=extra, pull_round=round_)
        self.table.unawaited[w] = push_pull and not final and self.pulls_ungated
        if left_out is not None:
            if left_out.size:
                self.comm.Send([left_out, MPI.DOUBLE], dest=src, tag=W.REPLY_DATA)
        elif count:   # (none: a sharded PS, the worker reads the shard servers next)
            self.comm.Send([self.weights.weights, MPI.DOUBLE], dest=src, tag=W.REPLY_DATA)
        self.counters.pulls[w] += 1
        self.events.add(MPI.Wtime() - self.t0, w, "pull", int(self.table.pushes[w]))
        # Staleness actually granted: how far this worker is ahead of the slowest one the
        # rule compares (``pull_within_staleness``: active, its last update not yet pushed).
        # A worker that has pushed its last update has none left for this one to miss, and
        # a final pull's weights are never trained on: neither counts as staleness granted.
        going = self.table.active & ~self.table.final_pushed
        if going.any() and not final and not self.table.final_pushed[w]:
            gap = int(self.table.pushes[w] - self.table.pushes[going].min())
            self.counters.max_gap = max(self.counters.max_gap, gap)

    def _round_told(self, w):
        """BSP with the server-side optimizer on shards (``ServerUpdates``): the round worker
        ``w``'s pull reads, its pushes counted, and the workers whose pushes that round
        leaves out (float64 indices): those with fewer pushes when the round's first pull
        was granted -- taken out for silence, joined, gone.  Fixed then, so that every pull
        of the round tells every shard the same, whoever comes back meanwhile (a push of a
        worker taken out may reach one shard before the round's first pull there and
        another after it).  A round's pulls are all granted before any worker pushes the
        next, so the last few rounds are kept."""
        round_ = int(self.table.pushes[w])
        if round_ <= 0:
            return 0, np.empty(0)
        left_out = self._left_out.get(round_)
        if left_out is None:
            left_out = np.flatnonzero((self.table.pushes < round_)
                                      & ~self.table.done).astype(np.float64)
            self._left_out[round_] = left_out
            for old in [r for r in self._left_out if r < round_ - 4]:
                del self._left_out[old]
        return round_, left_out

    def _on_stats(self, src, w, msg, now):
        payload = np.frombuffer(json.dumps(self.stats()).encode(), dtype=np.uint8)
        self._send_reply(src, msg[W.SEQ], count=payload.size)
        self.comm.Send([payload, MPI.BYTE], dest=src, tag=W.REPLY_STATS)

    def _on_shutdown(self, src, w, msg, now):
        self.table.done[w] = True
        self._check_gone = True
        self.events.add(now - self.t0, w, "shutdown", int(self.table.iteration[w]))
        self._send_reply(src, msg[W.SEQ])
        self.policy.on_membership_change()

    _HANDLERS = {W.REGISTER: _on_register, W.STEP: _on_step, W.RESET: _on_reset,
                 W.IMPORTANCE: _on_importance, W.PS_INIT: _on_ps_init, W.PUSH: _on_push,
                 W.PULL: _on_pull, W.STATS: _on_stats, W.SHUTDOWN: _on_shutdown,
                 W.LOSS: _on_loss, W.ALIVE: _on_alive, W.PUSH_PULL: _on_push_pull,
                 W.STRIDE: _on_stride}

    def _retry_held(self, now: float) -> None:
        """Decide again on the held replies, at ``now``: the receipt time of the message that
        changed the tables (or the housekeeping's clock), so a release is dated by what caused
        it."""
        still = []
        for item in self.held:
            tag, src, w, seq, arg = item
            if self.table.done[w]:
                continue
            if tag == W.STEP:
                decision = self.policy.decide_held(w, arg, now)
                if decision is None:
                    still.append(item)
                else:
                    self.table.waiting[w] = False
                    # The worker was idle while held: its next iteration starts now, so the
                    # interval its next report closes is measured from here.
                    self.table.last_event[w] = now
                    self.events.add(now - self.t0, w, "resume", arg)
                    self._answer_step(src, w, seq, decision, now)
            else:  # PULL
                if self.weights.ready and self.policy.may_pull(w):
                    self.table.waiting[w] = False
                    self._answer_pull(src, w, seq, arg)
                else:
                    still.append(item)
        self.held = still
