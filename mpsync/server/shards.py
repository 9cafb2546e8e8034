"""The sharded parameter server's data plane: shard servers that store, apply and serve
bytes, and the worker's client that talks to all of them at once.

Roles (the state server decides, the shards only move bytes):

* The flat parameter vector is cut into S contiguous ranges of equal bytes
  (:mod:`mpsync.server.shard_plan`); shard k holds range k in the parameters' dtype
  (:class:`~mpsync.server.weights.WeightStore`) and applies each worker's slice of an update,
  scaled as the policy's registry entry says, on arrival.
* The state server on rank 0 never holds the model.  It counts a worker's push only when the
  worker tells it, and the worker tells it only after every shard has acknowledged applying
  its slice; it grants a pull by the policy's rule over those whole-model counts.

What each policy needs from the shards follows from that order:

* ASP (DSSP §I.A): no pull waits for any count, so a push and the pull after it are one
  message each way per shard (``push_pull``), and the worker tells the state server of both
  in one header (``PUSH_PULL``) while the shards work, collecting its reply later
  (``SyncClient.push_pull``).
* SSP / DSSP (DSSP Alg. 1): staleness is decided once, by the state server, over pushes that
  are in on *every* shard, so a granted pull reads, on every shard, at least every update the
  bound requires.  A shard may also hold newer updates of other workers (a pull is not one
  snapshot across shards); SSP's bound is a lower bound on what a read contains, so that is
  allowed, as in the per-key stores SSP was built on.  Each pull's reply also says how many
  of the worker's next pulls the rule grants whatever comes meanwhile
  (``Policy.sure_pulls``: from the slowest count of the workers that can still push, which
  never decreases); those are read like ASP's, in one exchange per shard, and the server
  is told of the push and the pull once every shard has applied the push.
* BSP and ESync (ESync Alg. 1 lines 17-22): a round's pulls are granted once every worker's
  push of the round is acknowledged by every shard, and the next round's pushes start only
  after every worker has pulled (reset) -- so every shard is at exactly the round's model
  when anyone reads it, and the sharded PS computes what the single store and the ring do.
* ElasticBSP (ZipLine §6.2.5): a barrier pull waits until every worker's barrier push is in on
  every shard, and every pull of one barrier reads, on each shard, the weights that its first
  pull found there (a fast worker pushes again as soon as its own barrier pull is back), so
  every worker restarts the superstep from the same weights; within a superstep pushes and
  pulls are ASP, on each shard as they arrive.

Placement: each shard server is a thread on a worker rank, one per node by default (the
node's lowest worker rank), beside the workers.  Threads rather than ranks of their own: the
launch (mpirun, Slurm, a hostfile, horovodrun) needs no extra ranks laid out per node, every
node's link carries 1/S of every worker's traffic, and the shard's lifetime is its host
rank's, so a dead shard is a dead rank that Open MPI reports and ends the job for.  Needs
MPI_THREAD_MULTIPLE (the trainer and its shard thread call MPI at once).  A shard thread
serves pushes and pulls in compiled code that does not take its host's interpreter lock
(``_shard_loop``, where Open MPI is the MPI); what it hands to Python shares that lock.

Wire (two ``Dup`` s of the workers' communicator, nothing else on them): requests go on one,
replies on the other, so a reply that comes after its worker gave up waiting (its receive
cancelled at the deadline) can never reach the any-tag probe of a shard thread on that
worker's rank.  A request's tag says what it is and the dtype of its payload (``INIT``/``PUSH``
+ code: the slice; ``PULL`` + code: answered with the slice in that dtype as ``DATA``;
``PUSH_PULL`` + code: a push, ACKed, then answered with the slice after it as ``DATA``, one
round trip for ASP's push and pull); ``ACK`` carries ``[version, status]``; ``BYE`` ends a
worker's use of the shard; ``WATCH`` asks how long since the shard heard from each worker
(``HEARD``).  Pushes and pulls go to all shards at once (``Isend``/``Irecv``), so a worker's
link carries about one model out and one in per synchronization.  Under ``Compression.fp16``
both travel as float16: the shards keep the master weights in the parameters' dtype and
workers compute on a float16 rounding of them, as in mixed-precision training; their updates
are applied to the master copy.  A bfloat16 model travels as bfloat16 the same way where
the shards span nodes (its store is float32: ``weights.BFLOAT16``), half the bytes of the
float32 it was sent as (``mpsync.torch.strategies.ps``).

Failures: every wait has the run's deadline.  A worker waiting for the others (``join``, a
shard's shutdown) asks the shards who has been silent for longer than that and names them;
a push is checked by the worker exactly as a shard would check it, on the bytes that go on the
wire, so it is applied on every shard or on none; whatever a shard cannot use it logs and
drops, and serves on.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpsync.config import ConfigError
from mpsync.server._client import DeadlineExceeded
from mpsync.server.shard_optimizer import ServerUpdates, pack_state, unpack_state
from mpsync.server.shard_plan import ShardLayout, plan_layout, shard_bounds
from mpsync.server.shard_server import (ACK, BYE, DATA, GONE, HEARD, INIT, LOAD, OK, OPT,
                                        PULL, PUSH, PUSH_PULL, RESTORE, SAVE, STATE,
                                        UNHEARD, WATCH, WIRE_DTYPES,
                                        ShardServer, ShardThread, wire_code)
from mpsync.server.shard_window import (SLOTS, ShardInbox, ShardWindow, inbox_layout,
                                        unavailable_reason, window_layout)
from mpsync.server.weights import BFLOAT16, all_finite, numpy_cast

__all__ = ["ShardServer", "ShardClient", "ShardThread", "start_shards", "spin_until",
           "WIRE_DTYPES"]


class ShardClient:
    """A worker's side: init, push and pull the whole flat model over every shard at once.

    ``comm`` carries the requests and ``replies`` the answers; ``hosts[k]`` is shard k's
    rank in both, ``names[k]`` how errors name it (its world rank and host), ``worker_names[w]``
    how they name worker w.  The layout is fixed by the first call, from the model's size.
    Every wait has ``deadline``: a shard that does not answer raises ``DeadlineExceeded``
    naming it, and is not asked again (a late answer would be taken for the next one's).
    ``wire``: the dtype on the wire (None: the model's own; float16 under Compression.fp16,
    ``weights.BFLOAT16`` for a bfloat16 model), converted to and from by ``cast``
    (``weights.numpy_cast``).
    """

    def __init__(self, comm, replies, hosts, names, deadline: float, worker_names=None,
                 startup: float = 120.0, cast=numpy_cast):
        self.comm = comm
        self.replies = replies
        self.hosts = tuple(int(h) for h in hosts)
        self.names = tuple(names)
        self.worker_names = (tuple(worker_names) if worker_names is not None else
                             tuple(f"worker {w}" for w in range(comm.Get_size())))
        self.deadline = float(deadline)
        self.startup = max(float(startup), self.deadline)   # for a worker never heard from
        self.wire = None
        self.cast = cast
        self.nodes = 1   # the nodes the shards are on (``start_shards``)
        self.bounds: tuple[tuple[int, int], ...] | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._acks = np.zeros((len(self.hosts), 2), dtype=np.int64)
        self._one = np.zeros(1, dtype=np.int64)
        self._pull_barrier = np.zeros(1, dtype=np.int64)  # an ElasticBSP barrier, or 0
        self._wire_buf: np.ndarray | None = None
        self._wire_in: np.ndarray | None = None
        self._lost: set[int] = set()    # shards that missed a deadline
        # How a wait on the shards' answers runs (``_wait``): None, ``spin_until``; a worker's
        # runtime sets its progress engine's ``wait``.
        self.waiter = None
        # One-sided pushes and pulls (``shard_window``): why not (``start_shards`` sets it),
        # the window once ``open_window`` opened it, this rank's own shard (it stores into
        # the window's memory), and whether a first pull has read the initial weights.
        self.one_sided_unavailable: str | None = "no window set up (start_shards)"
        self.window: ShardWindow | None = None
        self._window_comm = None
        self._local_shard: ShardServer | None = None
        self._read_once = False
        # The shards run the optimizer (``start_shards``): a window has their inbox, and a
        # read through it waits for the steps the policy's staleness bound requires
        # (``PolicySpec.read_gap``; None: none, ASP's).
        self.server_optimizer = False
        self.read_gap: int | None = None

    @property
    def count(self) -> int:
        return len(self.hosts)

    def layout(self, numel: int) -> None:
        """Fix the shards' ranges for a model of ``numel`` elements (the same on every
        worker); a :class:`ConfigError` if there are more shards than elements."""
        if self.bounds is None:
            self.bounds = shard_bounds(numel, self.count)
        elif self.bounds[-1][1] != numel:
            raise ValueError(f"the parameter server holds {self.bounds[-1][1]} elements, got "
                             f"{numel}")

    def _on_wire(self, flat: np.ndarray) -> np.ndarray:
        if self.wire is None or np.dtype(self.wire) == flat.dtype:
            return flat
        if self._wire_buf is None or self._wire_buf.size != flat.size:
            self._wire_buf = np.empty(flat.size, dtype=self.wire)
        return self._wire_buf

    def _on_wire_in(self, out: np.ndarray) -> np.ndarray:
        """Where a :meth:`push_pull` receives: ``out``, or a wire buffer of its own (the
        push's may still be in use)."""
        if self.wire is None or np.dtype(self.wire) == out.dtype:
            return out
        if self._wire_in is None or self._wire_in.size != out.size:
            self._wire_in = np.empty(out.size, dtype=self.wire)
        return self._wire_in

    def open_window(self, dtype) -> str | None:
        """Collective over the workers, once the layout and the wire are fixed: open the
        one-sided window (``shard_window``) for a model of ``dtype``, where this job can use
        it.  Returns None where it did, else why pushes and pulls stay two-sided."""
        dtype = np.dtype(dtype)
        reason = self.one_sided_unavailable
        if reason is None and dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            reason = f"the model is {dtype} (float32 and float64 only)"
        if reason is None and self.wire is not None and np.dtype(self.wire) != dtype:
            reason = f"the wire is {_name(self.wire)}, the model {dtype}"
        if self.window is not None or reason is not None or self.bounds is None:
            return reason if self.window is None else None
        n, me = len(self.worker_names), self.comm.Get_rank()
        mine = self.hosts.index(me) if me in self.hosts else None
        a, b = self.bounds[mine] if mine is not None else (0, 0)
        heard_at, pushes_at, _, size = window_layout(b - a, dtype, n)
        if self.server_optimizer:
            posted_at, taken_at, slots_at, size = inbox_layout(b - a, dtype, n)
        # On shared memory: every worker maps each shard's part (shard_window: the inbox's
        # stores, and the pulls' copies out of the weights).
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")   # each shard's part on its own pages
        win = MPI.Win.Allocate_shared(size if mine is not None else 0, 1, info=info,
                                      comm=self._window_comm)
        info.Free()
        inbox = None
        if mine is not None:
            memory = np.frombuffer(win.tomemory(), dtype=np.uint8)
            memory[:] = 0
            if self.server_optimizer:
                inbox = ShardInbox(memory[posted_at:taken_at].view(np.int64),
                                   memory[taken_at:taken_at + 8 * n].view(np.int64),
                                   memory[slots_at:size].view(dtype).reshape(SLOTS * n, -1),
                                   b - a)
            self._local_shard.pin(memory[:heard_at].view(dtype)[:b - a],
                                  memory[heard_at:pushes_at].view(np.float64),
                                  memory[pushes_at:pushes_at + 8 * n].view(np.int64), inbox)
        _OPEN_WINDOWS.append(win)   # freed with MPI at exit (a collective free could hang)
        self._window_comm.Barrier()  # every shard stores into its window before any INIT
        self.window = ShardWindow(win, self.bounds, self.hosts, dtype, n, me,
                                  inbox=self.server_optimizer, names=self.names,
                                  deadline=self.deadline, read_gap=self.read_gap)
        if inbox is not None:
            inbox.ready = True   # this rank's window is in its epoch: the shard may take
        return None

    def init(self, flat: np.ndarray) -> None:
        """The initial weights, in the store's dtype (the first worker's wins on each shard)."""
        self._send_slices(INIT, flat, flat, "ps_init")

    def load(self, flat: np.ndarray) -> None:
        """Replace the weights on every shard (or set them first): ``auto`` switching to the
        PS from the ring, whose workers all hold ``flat``."""
        self._send_slices(LOAD, flat, flat, "load")

    def next_slots(self) -> list | None:
        """Where the shards have an inbox in a window (``shard_window``): the slots this
        worker's next push goes into, ``(a, b, slot)`` per shard (``ShardWindow.next_slots``),
        to write the gradient straight into; else None."""
        if self.window is None or not self.window.inbox or not self._read_once:
            return None   # (before the first read :meth:`push_pull` sends messages)
        return self.window.next_slots()

    def push(self, delta: np.ndarray, finite: bool = False, in_slots: bool = False) -> None:
        """Apply ``delta`` on every shard; returns once every shard has applied its slice.
        Empty: every shard is told of a push with nothing in it (the server's optimizer: an
        idle iteration's push, ``ServerUpdates.take``), once the layout is fixed.
        ``finite``: as :meth:`checked_push`'s.  ``in_slots``: ``delta`` is in the slots
        :meth:`next_slots` handed out (checked as it was written: ``finite``)."""
        if in_slots and (self.window is None or not finite):
            raise ValueError("a push in the inbox's slots needs the inbox and its values "
                             "checked as they were written (finite)")
        if self.window is not None and delta.size:
            wire = self.checked_push(delta, finite)
            self.layout(wire.size)
            self.window.push(wire, in_slots)
            self.bytes_sent += wire.nbytes
            return
        if delta.size == 0:
            if self.bounds is None:
                raise ValueError("an empty push before the parameter server's layout is fixed "
                                 "(the first push or pull fixes it)")
            empty = np.ascontiguousarray(delta)
            self._send_slices(PUSH, empty, empty, "push", empty=True)
            return
        self._send_slices(PUSH, delta, self.checked_push(delta, finite), "push")

    def checked_push(self, delta: np.ndarray, finite: bool = False) -> np.ndarray:
        """``delta`` as it goes on the wire (cast into the wire buffer if the wire's dtype
        differs).  What a shard would refuse is refused here, before anything is sent, so
        that a push is applied on every shard or on none: values that are not finite *on the
        wire* (a float16 wire turns a delta above 65504 into inf).  ``finite``: the caller
        found every value of ``delta`` finite as it computed it (``weights.subtract_checked``),
        so a wire of ``delta`` itself is not read again (a cast one still is: it can
        overflow)."""
        wire = self._on_wire(delta)
        if wire is not delta:
            self.cast(wire, delta)
        elif finite:
            return wire
        if not all_finite(wire):
            if all_finite(delta):
                big = float(np.max(np.abs(delta)))
                raise FloatingPointError(
                    f"push with a value of magnitude {big:.4g}, more than {_name(wire.dtype)} "
                    f"can carry (largest {_largest(wire.dtype):g}): the local model "
                    f"diverged or the wire's compression cannot send this update; no shard "
                    f"was sent any of it")
            raise FloatingPointError("push with NaN or inf: the local model diverged (no shard "
                                     "was sent any of it)")
        return wire

    def push_pull(self, wire: np.ndarray, out: np.ndarray, meanwhile=None,
                  applied=None, in_slots: bool = False) -> None:
        """Push ``wire`` (:meth:`checked_push`'s result) and read every shard's weights after
        applying it into ``out`` (contiguous, the store's dtype, apart from the push's
        memory): one round trip per shard (``PUSH_PULL``) where :meth:`push` and
        :meth:`pull` make two.  Only for a pull the state server need not grant (ASP, whose
        pulls read whatever is current) or is sure to grant (``SyncClient.pull_is_sure``):
        the pull reads each shard right after this worker's slice, without waiting for any
        count.  ``meanwhile()`` runs once the slices are on their way, ``applied()`` once
        every shard has applied its slice (the worker's messages to the state server).  A
        slice a shard refuses raises, as :meth:`push` does, and no weights are read from
        that shard.  ``in_slots``: as :meth:`push`'s (``wire`` then only gives the size)."""
        self.layout(out.size)
        self._check_lost("push and pull")
        back = self._on_wire_in(out)
        if np.shares_memory(wire, back):
            raise ValueError("push_pull needs the update and the weights in separate buffers")
        if self.window is not None and self._read_once:
            if meanwhile is not None:
                meanwhile()
            if self.window.inbox:
                self.window.push(wire, in_slots)
                if applied is not None:
                    applied()
                self.window.pull(out)
            else:   # each shard's weights read as the slice is added (ShardWindow.push_pull)
                self.window.push_pull(wire, out)
                if applied is not None:
                    applied()
            self.bytes_sent += wire.nbytes
            self.bytes_received += out.nbytes
            return
        if in_slots:
            raise ValueError("push_pull(in_slots=True) without the inbox's window")
        tag = PUSH_PULL + wire_code(wire.dtype)
        reads = [self.replies.Irecv([back[a:b], MPI.BYTE], source=h, tag=DATA)
                 for (a, b), h in zip(self.bounds, self.hosts)]
        acks = [self.replies.Irecv([self._acks[k], MPI.INT64_T], source=h, tag=ACK)
                for k, h in enumerate(self.hosts)]
        sends = [self.comm.Isend([wire[a:b], MPI.BYTE], dest=h, tag=tag)
                 for (a, b), h in zip(self.bounds, self.hosts)]
        if meanwhile is not None:
            meanwhile()
        shards = list(range(self.count))
        try:
            self._wait(acks + sends, "push and pull", shards * 2)
        except DeadlineExceeded:
            for k in self._lost:    # a late slice must not land in ``out`` after this
                reads[k].Cancel()
            raise
        self.bytes_sent += wire.nbytes
        refused = [k for k in shards if self._acks[k, 1] != OK]
        for k in refused:       # no weights come from a shard that refused the push
            reads[k].Cancel()
            reads[k].Wait()
        if refused:
            self._wait([reads[k] for k in shards if k not in refused], "push and pull",
                       [k for k in shards if k not in refused], moving_here=True)
            raise RuntimeError(f"push and pull refused by "
                               f"{', '.join(self.names[k] for k in refused)} (see its log "
                               f"line)")
        if applied is not None:
            applied()
        self._wait(reads, "push and pull", shards, moving_here=True)
        self.bytes_received += back.nbytes
        if back is not out:
            self.cast(out, back)

    def configure(self, settings: np.ndarray) -> None:
        """The server-side optimizer's settings (float64) to every shard; returns once each
        has taken them."""
        self._check_lost("optimizer settings")
        acks = [self.replies.Irecv([self._acks[k], MPI.INT64_T], source=h, tag=ACK)
                for k, h in enumerate(self.hosts)]
        sends = [self.comm.Isend([settings, MPI.DOUBLE], dest=h, tag=OPT) for h in self.hosts]
        self._wait(acks + sends, "optimizer settings", list(range(self.count)) * 2)
        refused = [self.names[k] for k in range(self.count) if self._acks[k, 1] != OK]
        if refused:
            raise RuntimeError(f"optimizer settings refused by {', '.join(refused)} (see its "
                               f"log line)")

    def optimizer_state(self, dtype) -> dict | None:
        """The shards' optimizer state over the whole flat model, for a checkpoint taken when
        every worker's pushes are in: ``{"kind", "steps", <buffer name>: flat array}``, or
        None where the shards have none (the workers run the optimizer, or nothing was
        pushed yet)."""
        self._check_lost("saving the optimizer state")
        dtype = np.dtype(dtype)
        bufs = [np.empty(8 * 4 + 3 * (b - a) * dtype.itemsize, dtype=np.uint8)
                for a, b in self.bounds]
        recvs = [self.replies.Irecv([buf, MPI.BYTE], source=h, tag=STATE)
                 for buf, h in zip(bufs, self.hosts)]
        sends = [self.comm.Isend([self._one, MPI.INT64_T], dest=h, tag=SAVE)
                 for h in self.hosts]
        self._wait(recvs + sends, "saving the optimizer state", list(range(self.count)) * 2,
                   moving_here=True)
        parts = [unpack_state(buf, dtype, b - a) for (a, b), buf in zip(self.bounds, bufs)]
        kinds = {(kind, steps, tuple(buffers)) for kind, steps, buffers in parts}
        if len(kinds) != 1:
            raise RuntimeError(f"the shards' optimizer states disagree (kind, steps, "
                               f"buffers): {sorted(kinds, key=str)}")
        kind, steps, names = kinds.pop()
        if kind is None:
            return None
        return {"kind": kind, "steps": steps,
                **{n: np.concatenate([p[2][n] for p in parts]) for n in names}}

    def restore_optimizer(self, state: dict) -> None:
        """Continue from a checkpoint's optimizer state (:meth:`optimizer_state`); before the
        first push of the run."""
        self._check_lost("restoring the optimizer state")
        names = [n for n in state if n not in ("kind", "steps")]
        dtype = np.asarray(state[names[0]]).dtype if names else np.dtype(np.float64)
        packed = [pack_state(state["kind"], state["steps"],
                             {n: np.asarray(state[n])[a:b] for n in names}, b - a, dtype)
                  for a, b in self.bounds]
        acks = [self.replies.Irecv([self._acks[k], MPI.INT64_T], source=h, tag=ACK)
                for k, h in enumerate(self.hosts)]
        sends = [self.comm.Isend([p, MPI.BYTE], dest=h, tag=RESTORE + wire_code(dtype))
                 for p, h in zip(packed, self.hosts)]
        self._wait(acks + sends, "restoring the optimizer state", list(range(self.count)) * 2)
        refused = [self.names[k] for k in range(self.count) if self._acks[k, 1] != OK]
        if refused:
            raise RuntimeError(f"the optimizer state was refused by {', '.join(refused)} "
                               f"(see its log line)")

    def _send_slices(self, kind: int, flat: np.ndarray, wire: np.ndarray, what: str,
                     empty: bool = False) -> None:
        """``wire``'s slice to each shard (``empty``: ``wire`` itself, of no elements, to
        every shard)."""
        if not empty:
            self.layout(flat.size)
        self._check_lost(what)
        tag = kind + wire_code(wire.dtype)
        acks = [self.replies.Irecv([self._acks[k], MPI.INT64_T], source=h, tag=ACK)
                for k, h in enumerate(self.hosts)]
        sends = [self.comm.Isend([wire if empty else wire[a:b], MPI.BYTE], dest=h, tag=tag)
                 for (a, b), h in zip(self.bounds, self.hosts)]
        self._wait(acks + sends, what, list(range(self.count)) * 2)
        self.bytes_sent += wire.nbytes
        refused = [self.names[k] for k in range(self.count) if self._acks[k, 1] != OK]
        if refused:
            raise RuntimeError(f"{what} refused by {', '.join(refused)} (see its log line)")

    def pull(self, out: np.ndarray, barrier: int = 0, round_: int = 0,
             excluded=(), granted: bool = False) -> None:
        """Every shard's slice into ``out`` (contiguous, the store's dtype).  ``barrier`` > 0:
        the pull at the ``barrier``-th barrier (ElasticBSP), which reads on every shard the
        weights that the barrier's first pull found there (``ShardServer._at_barrier``);
        ``ALL_PUSHES_IN``: every worker's pushes are in, a shard stepping once per round
        steps on every push it keeps.  ``round_`` > 0 (a shard stepping once per round): the
        pull of that round, which the state server granted leaving out the pushes of the
        ``excluded`` workers (``ServerUpdates``).  ``granted``: the state server granted
        this read under its staleness bound (``SyncClient.push_then_pull``); through an
        inbox it is then read from the window once every shard has stepped on what the
        bound requires (``ShardWindow.pull``)."""
        self.layout(out.size)
        self._check_lost("pull")
        # (With an inbox another pull alone is a message: the shard steps on all that is in
        # before it answers, as the run's last read needs.)
        window = self.window
        if window is not None and self._read_once and barrier == 0 and round_ == 0 and (
                not window.inbox or granted and window.read_gap is not None):
            self.window.pull(out)
            self.bytes_received += out.nbytes
            return
        wire = self._on_wire(out)
        tag = PULL + wire_code(wire.dtype)
        if round_ > 0:
            words = np.array([0, round_, *excluded], dtype=np.int64)
        else:
            words = self._pull_barrier
            words[0] = barrier
        recvs = [self.replies.Irecv([wire[a:b], MPI.BYTE], source=h, tag=DATA)
                 for (a, b), h in zip(self.bounds, self.hosts)]
        sends = [self.comm.Isend([words, MPI.INT64_T], dest=h, tag=tag)
                 for h in self.hosts]
        self._wait(recvs + sends, "pull", list(range(self.count)) * 2, moving_here=True)
        self.bytes_received += wire.nbytes
        if wire is not out:
            self.cast(out, wire)
        # A first pull waits on the shards for the initial weights; a window's read would not.
        self._read_once = True

    def silent_workers(self) -> list[tuple[int, float]]:
        """Ask every shard how long since it heard from each worker: ``(worker, seconds)``
        for each worker that no shard has heard from for longer than the deadline (never
        heard from: for longer than the start-up time) and that has not said goodbye.
        Every push goes to every shard, so a worker that trains is heard by all of them; one
        that waits for the others (``join``) asks this, and is heard that way."""
        n = len(self.worker_names)
        self._check_lost("a liveness check")
        heard = np.empty((self.count, 2, n))
        recvs = [self.replies.Irecv([heard[k], MPI.DOUBLE], source=h, tag=HEARD)
                 for k, h in enumerate(self.hosts)]
        sends = [self.comm.Isend([self._one, MPI.INT64_T], dest=h, tag=WATCH)
                 for h in self.hosts]
        self._wait(recvs + sends, "a liveness check", list(range(self.count)) * 2)
        quiet, state = heard[:, 0].min(axis=0), heard[:, 1].max(axis=0)
        limit = np.where(state == UNHEARD, self.startup, self.deadline)
        return [(int(w), float(quiet[w])) for w in range(n)
                if state[w] != GONE and quiet[w] > limit[w]]

    def check_workers(self, what: str) -> None:
        """Raise :class:`DeadlineExceeded` naming every worker that :meth:`silent_workers`
        finds: ``what`` (this worker's wait) cannot end without them."""
        silent = self.silent_workers()
        if silent:
            quiet = ", ".join(f"{self.worker_names[w]} for {s:.1f}s" for w, s in silent)
            raise DeadlineExceeded(
                f"{what}: no word from {quiet} (no PS shard heard from it for longer than the "
                f"{self.deadline:g}s deadline: it stopped before joining); ending the job",
                [self.worker_names[w] for w, _ in silent], what)

    def close(self) -> None:
        """This worker is done with every shard (each exits once all workers are); also
        one that missed a deadline, should it come back (a one-integer message: sent at
        once, whether the shard takes it or not)."""
        for h in self.hosts:
            self.comm.Send([self._one, MPI.INT64_T], dest=h, tag=BYE)

    def _check_lost(self, what: str) -> None:
        if self._lost:
            names = [self.names[k] for k in sorted(self._lost)]
            raise DeadlineExceeded(f"{what}: {', '.join(names)} missed an earlier deadline "
                                   f"and is not asked again", names, what)

    def _wait(self, requests, what: str, shard_of, moving_here: bool = False) -> None:
        """Wait for ``requests``; past the deadline, raise naming the shards that did not
        answer.

        A shard answers as soon as it has the request (a pull the policy may hold was granted
        by the state server before it reaches a shard), so every wait is on bytes in flight.
        Who moves them decides how the waiter waits (Open MPI's shared memory: the receiver
        copies, and only while it is inside MPI):

        * ``moving_here`` (the shards' weights coming in): this rank copies them, so the
          waiter tests and yields the core between tests, and never sleeps.  (It slept in
          1 ms naps once its first 2 ms had passed, stalling a large pull.)
        * else (a push, until every shard has taken its slice and answered): the shards copy
          and step, so after ``ELSEWHERE_SPIN_S`` of spinning the waiter pauses
          ``ELSEWHERE_PAUSE_S`` between tests and leaves the core to them (4 workers on 2
          cores spinning through their pushes as well trained at 0.97-0.99x the samples/s,
          bench/allreduce/README.md).

        The wait is ``waiter``'s: the worker's progress engine
        (``mpsync.torch.dataplane.progress``, set by the runtime), which counts what it did
        and keeps the heartbeat; or, in a client without one, :func:`spin_until`."""
        def done():
            return MPI.Request.Testall(requests)

        elsewhere = None if moving_here else (ELSEWHERE_SPIN_S, ELSEWHERE_PAUSE_S)
        try:
            (self.waiter or spin_until)(done, deadline=self.deadline, what=what,
                                        elsewhere=elsewhere)
            return
        except DeadlineExceeded:
            if MPI.Request.Testall(requests):   # it completed as the deadline passed
                return
        late = sorted({shard_of[i] for i, r in enumerate(requests) if not r.Test()})
        for i, r in enumerate(requests):
            if shard_of[i] in late and r:
                r.Cancel()
        self._lost.update(late)
        names = [self.names[k] for k in late]
        raise DeadlineExceeded(f"no answer from {', '.join(names)} to {what} within "
                               f"the {self.deadline:g}s deadline", names, what)


# Windows opened by ``ShardClient.open_window``: kept for the process's life (module doc of
# ``shard_window``).
_OPEN_WINDOWS: list = []

# A wait on the shards' work (a push's answers) spins this long, then pauses between tests.
ELSEWHERE_SPIN_S = 2e-3
ELSEWHERE_PAUSE_S = 1e-4


def spin_until(done, *, deadline: float, what: str,
               elsewhere: tuple[float, float] | None = None) -> None:
    """Call ``done()`` (an ``MPI.Request`` test: it moves the transfer) until it returns True,
    yielding the core between calls (this rank's shard thread and the ranks that share the
    cores run meanwhile); ``elsewhere=(spin_for, pause)``: after ``spin_for`` seconds, pause
    ``pause`` seconds between calls.  :class:`DeadlineExceeded` after ``deadline`` seconds.
    The progress engine's wait without its counters and heartbeat."""
    yield_ = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
    start = time.monotonic()
    spins = 0
    pausing = False
    while not done():
        spins += 1
        if pausing:
            time.sleep(elsewhere[1])
        elif spins & 31:
            yield_()
            continue
        waited = time.monotonic() - start
        if waited > deadline:
            raise DeadlineExceeded(f"{what}: past the {deadline:g}s deadline", (), what)
        pausing = elsewhere is not None and waited > elsewhere[0]
        if not pausing:
            yield_()


def _name(dtype) -> str:
    return "bfloat16" if dtype == BFLOAT16 else str(dtype)


def _largest(dtype) -> float:
    # bfloat16's largest finite value: float32's exponent range, 8 bits of mantissa.
    return 3.3895313892515355e38 if dtype == BFLOAT16 else float(np.finfo(dtype).max)


def start_shards(workers, config, world_ranks, *, log=None, cast=numpy_cast):
    """Collective over the workers' communicator ``workers``: plan the shards from the
    workers' host names (:func:`~mpsync.server.shard_plan.plan_layout`), start this rank's
    shard thread if it hosts one, and return ``(ShardClient, ShardThread | None, layout)``.
    ``world_ranks[w]``: worker w's rank in the job, for messages; ``cast``: how the client
    and the shard convert to and from a wire dtype (``weights.numpy_cast``)."""
    from mpsync import policies

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        # (policy='auto' never gets here: it switches on the ring only instead,
        # mpsync.torch._runtime.ring_only_without_threads)
        raise ConfigError("topology='ps' runs its shard servers as threads of worker ranks and "
                          "needs MPI_THREAD_MULTIPLE; this MPI provides level "
                          f"{MPI.Query_thread()}; run a ring policy, or initialise MPI with "
                          "MPI_THREAD_MULTIPLE")
    names = workers.allgather(MPI.Get_processor_name())
    layout: ShardLayout = plan_layout(config.ps_shards, names)
    requests, replies = workers.Dup(), workers.Dup()
    me, n = workers.Get_rank(), workers.Get_size()
    labels = [f"PS shard {k} (world rank {world_ranks[h]} on {names[h]})"
              for k, h in enumerate(layout.hosts)]
    worker_names = [f"worker {w} (world rank {world_ranks[w]} on {names[w]})"
                    for w in range(n)]
    thread = None
    one_sided_unavailable = unavailable_reason(config, workers)   # (collective)
    if me in layout.hosts:
        spec = policies.get(config.policy)
        # A round's step divides by the n workers, as the workers' own deltas are scaled
        # (ServerUpdates: Horovod's join semantics, whoever pushed in the round).
        updates = (ServerUpdates(per_round=spec.ps_average,
                                 scale=spec.ps_update_scale(config, n) if spec.ps_average
                                 else None)
                   if config.ps_optimizer == "server" else None)
        thread = ShardThread(ShardServer(requests, replies, layout.hosts.index(me), n,
                                         spec.ps_update_scale(config, n),
                                         deadline=config.deadline,
                                         startup=config.startup_timeout,
                                         worker_names=worker_names, log=log, updates=updates,
                                         cast=cast, compiled=config.server_fast_path,
                                         inbox_expected=updates is not None
                                         and not updates.per_round
                                         and one_sided_unavailable is None))
    if me == 0:
        (log or (lambda t: print(t, file=sys.stderr, flush=True)))(
            f"mpsync: parameter server in {layout.count} shard(s) over {layout.nodes} "
            f"node(s): {'; '.join(labels)}")
    client = ShardClient(requests, replies, layout.hosts, labels, config.deadline,
                         worker_names=worker_names, startup=config.startup_timeout, cast=cast)
    client.nodes = layout.nodes
    client.one_sided_unavailable = one_sided_unavailable
    client.server_optimizer = config.ps_optimizer == "server"
    if client.server_optimizer and config.policy != policies.AUTO:
        client.read_gap = policies.get(config.policy).read_gap(config)
    client._window_comm = workers.Dup()
    client._local_shard = thread.server if thread is not None else None
    return client, thread, layout
