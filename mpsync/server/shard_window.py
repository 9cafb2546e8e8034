"""One-sided pushes and pulls for shards on the workers' own node: the worker adds its slice
into each shard's weights itself, in compiled code under the shard's lock word, and copies
them out, through an MPI window on the shards' shared memory, and the shard's thread is not
involved at all.

Why: on one node an MPI window on shared memory (``MPI_Win_allocate_shared``) maps every
shard's memory into every worker, so a push is the worker's own add into the shard's range
and a read its own copy out.  The two-sided exchange needs the shard's thread to be
scheduled, receive the slice into a buffer, add it in a second pass, and send the result
back; on a node whose cores all train, that is where the time went (a push + pull of 8.7 MB
with 2 workers on 2 cores took 1.2-2.1x a plain program echoing the same slices,
bench/allreduce/README.md, where the one-sided numbers are).

How a push adds (:func:`add_into_shards`): per shard, take its lock word (an atomic
compare-and-swap on the int64 in the window), add the slice in one vectorized pass, let the
lock go; a shard whose lock another worker holds is passed over and come back to, and each
worker starts on another shard, so workers that push at once seldom wait.  A push and a pull
together (``push_pull``, ASP's and a sure SSP or DSSP pull) copy each range out in the same
pass as the add: the shard's memory is read once, while this worker's core holds it.  (The
earlier form, ``MPI_Accumulate`` into the shards, then a copy of every range after all of
them, read every range a second time, mostly after the other workers' adds had taken it into
their cores: with 2 workers at 8.7 MB, 1.9-2.8 ms an exchange against 1.5-1.7 ms now, on a
machine whose two cores were at times far apart in its cache hierarchy,
bench/allreduce/README.md.)

Which policies: those whose shards apply every push on arrival and never hold or freeze a
read (``PolicySpec.steps_unawaited`` without ``ps_average``: ASP, SSP, DSSP; the state server
decides when a pull may happen, the shards only store).  Their guarantees carry over:

* a push is complete on every shard (each lock let go after its add, then a memory barrier,
  ``MPI_Win_sync``) before the worker tells the state server of it, so a pull the server
  grants reads at least every push it counted (SSP's and DSSP's bound, "Dynamic Stale
  Synchronous Parallel Distributed Training for Deep Learning", §I.A and Alg. 1: a lower
  bound on what a read contains, as in the two-sided path);
* a refused push never reaches a shard: the worker checks it before anything is sent
  (``ShardClient.checked_push``), as it already did for the two-sided path.

What differs: a pull alone may see another worker's concurrent push applied to part of a
slice (never part of an element), and a push and pull together read each shard as this
worker's add leaves it, so another worker's push that takes a shard after this one shows in
the next read (the earlier form's copy after all the adds could hold it already).  ASP's reads
are unsynchronised by design (the same paper, §I.A: a worker reads whatever is current), and
the two-sided path already lets a pull see newer pushes on one shard than on another.  BSP,
ESync and ElasticBSP read a round's or a barrier's frozen weights, and the server-side
optimizer steps on the shard: those stay two-sided, as do a compressed wire, a job whose
workers span nodes, ``auto`` (a switch reloads the shards), and an MPI other than Open MPI
(:func:`unavailable_reason` names which; ``ShardClient.open_window`` adds a wire in another
dtype than the model's, and a dtype other than float32 and float64).

The window also carries, per shard, when each worker last pushed (``CLOCK_MONOTONIC``, one
clock on one node) and how many pushes were applied, so the shard's liveness answers and its
stats still count the pushes it no longer receives.

The server-side optimizer under ASP, SSP and DSSP has an inbox instead: ``SLOTS`` gradient slots
per worker in each shard's window (on shared memory, ``MPI_Win_allocate_shared``, each rank's
part apart, as every window here) that every worker reads and writes with plain loads and
stores.  A worker copies its gradient into its next slot (the training strategy straight from
each parameter's gradient, checking it for NaN and inf in the same pass:
``ShardWindow.next_slots``), then writes its count of pushes beside them, and copies the weights
out without waiting for the shard; the shard's compiled loop (``_shard_loop``), whenever it
runs, sums the slots written since it last looked, steps once on the sum in place, and writes
back the count it took.  So the step is off every worker's path: answered as a message, a push
waited 8.6-11.5 ms for a shard whose work was about 1.2 ms, as the shard threads took turns on
cores the trainers held (bench/psopt/README.md).  A worker writes a slot again only once the
shard took the push that was in it, so it waits only when its shard is ``SLOTS`` pushes behind.
Each count has one writer and a slot is complete before its count is written (a memory barrier
between, ``MPI_Win_sync``), so no push is read half-written or lost, and nothing locks.  (An
accumulate into one sum per shard, with MPI's atomics to take turns on it, took 14-17 ms a push:
Open MPI's ``osc/sm`` serializes both on the shard's one lock.  Through ``MPI_Put`` and
``MPI_Get`` the gradient was copied twice, into a buffer and from it into the slot.)  The first
step, which makes the optimizer's state, and a pull alone (the last one of a run, a message) are
the shard's Python loop's: it steps on what is in before it answers, so the final weights hold
every push.

Under SSP and DSSP a read must hold what the bound promises: every worker's pushes up to the
slowest count the state server compared with (the same paper, §I.A and Alg. 1).  A worker
writes its count before it tells the server of a push, so a read granted under a bound of g
(``PolicySpec.read_gap``: SSP's s, DSSP's s_U) at this worker's count c needs, on every
shard, each worker's first c - g pushes taken, or all that worker wrote where it wrote fewer
(one that pushed its last).  Before it reads, the worker reads the shards' counts (2 x
workers words per shard) and waits while a shard is behind
(:meth:`ShardWindow.await_steps`); as a shard runs at most ``SLOTS`` pushes behind each worker,
it seldom waits, and it skips the look where the counts it last read already suffice.

Departure [ps-server-inbox]: the papers' server steps once per push (DSSP, Alg. 1); through
the inbox a shard steps once on the sum of the pushes that came since its last step (k pushes,
one step: for SGD without momentum the same weights as k steps; with momentum or Adam, one step
on a larger batch), and a worker's pull may not yet hold its own last ``SLOTS`` pushes.  Both
are within ASP's reads, which are whatever is current (DSSP, §I.A).  Under SSP and DSSP a read
holds every worker's pushes up to the bound (above), not every push the state server counted
when it granted the read: the reader's own last pushes too may be missing, as an older
worker's within the bound may (the paper's bound counts iterations, §I.A, and says nothing of
a worker's own reads).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from mpsync.server._client import DeadlineExceeded

__all__ = ["ShardWindow", "ShardInbox", "unavailable_reason", "window_layout", "inbox_layout",
           "slot_bytes", "add_into_shards", "sum_slots", "SLOTS"]

# A worker whose shard has not taken the push its next slot holds looks again every
# INBOX_PAUSE_S, until the run's deadline (a shard takes within milliseconds).
INBOX_PAUSE_S = 50e-6
# Gradient slots per worker on each shard: a worker waits only when its shard is this many
# pushes behind it.
SLOTS = 2

# Rounds over the shards left that the compiled add spins through, every one locked by another
# worker, before it lets go of the core once (an add of a 4 MB range takes about 0.3 ms).
LOCK_TRIES = 2000


def unavailable_reason(config, workers) -> str | None:
    """Why this job's pushes and pulls cannot be one-sided, or None (collective over
    ``workers``: it asks which of them share a node)."""
    from mpsync import policies

    on_node = workers.Split_type(MPI.COMM_TYPE_SHARED, key=workers.Get_rank())
    one_node = on_node.Get_size() == workers.Get_size()
    on_node.Free()
    if not getattr(config, "ps_one_sided", True):
        return "ps_one_sided is off"
    if config.policy == policies.AUTO:
        return "under auto, a switch reloads the shards"
    spec = policies.get(config.policy)
    if not spec.steps_unawaited or spec.ps_average:
        return f"{config.policy}'s shards hold its rounds or barriers"
    if config.ps_optimizer == "server" and not (spec.ps_pull_ungated or spec.ps_read_gap):
        return (f"the shards run the optimizer and {config.policy}'s reads must hold every "
                f"push the state server counted (no staleness bound: ps_read_gap)")
    if not one_node:
        return "the workers span nodes"
    if "Open MPI" not in MPI.Get_library_version():
        return "the MPI is not Open MPI (its shared-memory window was the one measured)"
    return None


def window_layout(elements: int, dtype, n_workers: int) -> tuple[int, int, int, int]:
    """A shard's window in bytes: ``(heard_at, pushes_at, lock_at, size)``: its weights at 0,
    then (8-byte aligned) a float64 per worker (when it last pushed), then an int64 per worker
    (its pushes so far): each worker writes only its own, so no write there waits; then, on a
    cache line of its own, the int64 a worker holds while it adds into the weights (0: free,
    else the holder's index + 1; :func:`add_into_shards`)."""
    heard_at = -(-elements * np.dtype(dtype).itemsize // 8) * 8
    pushes_at = heard_at + 8 * n_workers
    lock_at = -(-(pushes_at + 8 * n_workers) // 64) * 64
    return heard_at, pushes_at, lock_at, lock_at + 64


def inbox_layout(elements: int, dtype, n_workers: int) -> tuple[int, int, int, int]:
    """The server-side optimizer's inbox after :func:`window_layout`'s bytes: ``(posted_at,
    taken_at, slots_at, size)``: an int64 per worker (the pushes it wrote), an int64 per worker
    (the pushes the shard took), then a gradient slot of the shard's range per worker, each
    64-byte aligned (``slot_bytes`` apart)."""
    posted_at = window_layout(elements, dtype, n_workers)[3]
    taken_at = posted_at + 8 * n_workers
    slots_at = -(-(taken_at + 8 * n_workers) // 64) * 64
    return posted_at, taken_at, slots_at, slots_at + SLOTS * n_workers * slot_bytes(elements,
                                                                                      dtype)


def slot_bytes(elements: int, dtype) -> int:
    """A gradient slot's bytes: the range's, padded to 64."""
    return -(-elements * np.dtype(dtype).itemsize // 64) * 64


class ShardWindow:
    """A worker's one-sided access to every shard (module doc).

    ``win``: the window over the workers' communicator on shared memory
    (``MPI_Win_allocate_shared``, disp_unit 1), each shard's host exposing
    :func:`window_layout`'s bytes for its range (with ``inbox``, :func:`inbox_layout`'s);
    ``bounds[k]`` and ``hosts[k]`` as in ``ShardClient``; ``worker``: this worker's index.  The
    window stays in one passive epoch (``Lock_all``) for the whole run: nothing waits on an MPI
    lock, and every operation completes in the worker's own calls.  A push waits only where
    another worker is adding into every shard it has left (their lock words, module doc), a
    shard named by ``names`` (the shards' labels) past ``deadline`` seconds.  ``inbox``:
    pushes are gradients written into the shards' inboxes (module doc); the one wait there is
    for a shard to take a slot, named the same way.
    """

    def __init__(self, win, bounds, hosts, dtype, n_workers: int, worker: int,
                 inbox: bool = False, names=None, deadline: float = 60.0,
                 read_gap: int | None = None):
        self.win = win
        self.inbox = bool(inbox)
        self.read_gap = None if read_gap is None or not inbox else int(read_gap)
        self.names = tuple(names) if names is not None else \
            tuple(f"PS shard {k}" for k in range(len(bounds)))
        self.deadline = float(deadline)
        self.bounds = tuple(bounds)
        self.hosts = tuple(hosts)
        self.dtype = np.dtype(dtype)
        self.worker = int(worker)
        # Each worker starts on another shard, so that workers pushing at once seldom find
        # a shard's lock taken (and one that does goes on to the next shard meanwhile).
        first = self.worker % len(self.bounds)
        self._visit = np.array([*range(first, len(self.bounds)), *range(first)], dtype=np.int64)
        self._pushes = np.zeros(1, dtype=np.int64)
        # Every shard's posted and taken counts, as a bounded read last found them, and the
        # fewest pushes of any worker that every shard had taken then (they only grow).
        self._counts = np.zeros((len(self.bounds), 2 * n_workers), dtype=np.int64)
        self._all_taken = 0
        # The push whose slots :meth:`next_slots` handed out (its data is in them), or -1.
        self._filled = -1
        win.Lock_all()
        self._shards = [_ShardMemory(win, host, b - a, self.dtype, n_workers, self.inbox)
                        for (a, b), host in zip(self.bounds, self.hosts)]
        # What the compiled add takes (add_into_shards): where the shards' weights and lock
        # words are, where each range starts, which it has done (the order is _visit).
        self._weights_at = np.array([shard.weights.ctypes.data for shard in self._shards],
                                    dtype=np.int64)
        self._sizes = np.array([b - a for a, b in self.bounds], dtype=np.int64)
        self._locks_at = np.array([shard.lock.ctypes.data for shard in self._shards],
                                  dtype=np.int64)
        self._starts = np.array([a for a, _ in self.bounds], dtype=np.int64)
        self._done = np.zeros(len(self.bounds), dtype=np.bool_)
        self._no_copy = np.empty(0, dtype=self.dtype)

    def push(self, wire: np.ndarray, in_slots: bool = False) -> None:
        """Add ``wire`` (the checked update, this dtype) into every shard's range (with an
        inbox: write it into this worker's next slot for the shard to step on; ``in_slots``:
        it is there already, :meth:`next_slots`); complete on every shard when this returns."""
        if self.inbox:
            self._into_inboxes(wire, in_slots)
            return
        self._add(wire, self._no_copy)

    def push_pull(self, wire: np.ndarray, out: np.ndarray) -> None:
        """:meth:`push`, and every shard's weights into ``out`` (as :meth:`pull`'s) in the
        same pass: each shard's range is copied out as this worker's slice is added into it,
        under its lock, so it holds every push that was in before this one (module doc).
        Not with an inbox, whose shards step on the pushes themselves: there a push, then a
        pull."""
        if self.inbox:
            raise ValueError("push_pull through an inbox: push, then pull (the shards step)")
        self._add(wire, out)

    def _add(self, wire: np.ndarray, out: np.ndarray) -> None:
        """``wire`` added into every shard's range, each under its lock, shards whose lock
        another worker holds visited after the others (``out``, unless empty: each range
        copied out as it is added); then when this worker pushed and how many times, all
        seen by any reader after this returns.  A lock held past the deadline (its holder
        stopped inside an add): ``DeadlineExceeded`` naming the shard and the holder."""
        # The compiled add trusts its arrays (no bounds checks): a wrong one is refused here.
        model = (self.bounds[-1][1],)
        if wire.dtype != self.dtype or wire.shape != model or not wire.flags.c_contiguous or \
                out.size and (out.dtype != self.dtype or out.shape != model
                              or not out.flags.c_contiguous):
            raise ValueError(f"a one-sided push takes contiguous {self.dtype} arrays of the "
                             f"model's {model[0]} elements, got {wire.dtype}{wire.shape}"
                             + (f" and {out.dtype}{out.shape}" if out.size else ""))
        self._done[:] = False
        give_up, holder = None, self.worker + 1
        while add_into_shards(self._weights_at, self._sizes, self._locks_at, self._visit,
                              self._starts, wire, out, holder, self._done, LOCK_TRIES):
            # Every shard left is being added into by another worker: let it run (on a node
            # with fewer cores than ranks, it may be waiting for this one's).
            give_up = give_up or time.monotonic() + self.deadline
            if time.monotonic() > give_up:
                held = [int(k) for k, done in zip(self._visit, self._done) if not done]
                names = [self.names[k] for k in held]
                by = sorted({int(self._shards[k].lock[0]) - 1 for k in held} - {-1})
                raise DeadlineExceeded(f"{', '.join(names)} stayed locked by worker(s) "
                                       f"{by} for the {self.deadline:g}s deadline (a worker "
                                       f"stopped while adding its push)", names, "push")
            time.sleep(0)
        now, me = time.monotonic(), self.worker
        self._pushes[0] += 1
        for shard in self._shards:
            shard.heard[me] = now
            shard.pushes[me] = self._pushes[0]
        self.win.Sync()

    def next_slots(self) -> list[tuple[int, int, np.ndarray]]:
        """With an inbox: ``(a, b, slot)`` per shard, the slot this worker's next push goes
        into for the range ``[a, b)`` (shared memory), once every shard has taken the push
        that was in it.  Whatever is written there is the next :meth:`push` with
        ``in_slots``; a push without it writes them again."""
        pushed = int(self._pushes[0])
        me, give_up = self.worker, None
        while any(shard.taken[me] < pushed - SLOTS + 1 for shard in self._shards):
            give_up = give_up or time.monotonic() + self.deadline
            if time.monotonic() > give_up:
                late = [name for name, shard in zip(self.names, self._shards)
                        if shard.taken[me] < pushed - SLOTS + 1]
                raise DeadlineExceeded(f"{', '.join(late)} did not take this worker's "
                                       f"gradients within the {self.deadline:g}s deadline "
                                       f"(its inbox is full)", late, "push")
            time.sleep(INBOX_PAUSE_S)
        self._filled = pushed
        row = SLOTS * me + pushed % SLOTS
        return [(a, b, shard.rows[row, :b - a])
                for (a, b), shard in zip(self.bounds, self._shards)]

    def _into_inboxes(self, wire: np.ndarray, in_slots: bool) -> None:
        """This push's slots written (from ``wire`` unless ``in_slots``), then its count on
        every shard (module doc), when it pushed and how many times."""
        pushed = int(self._pushes[0])
        if not in_slots:
            for a, b, slot in self.next_slots():
                np.copyto(slot, wire[a:b])
        elif self._filled != pushed:
            raise RuntimeError("push(in_slots=True) of slots not handed out for this push "
                               "(ShardWindow.next_slots)")
        self._filled = -1
        self.win.Sync()   # the slots complete before any count says they are there
        me, now = self.worker, time.monotonic()
        self._pushes[0] = pushed + 1
        for shard in self._shards:
            shard.posted[me] = pushed + 1
            shard.heard[me] = now
            shard.pushes[me] = pushed + 1
        self.win.Sync()

    def pull(self, out: np.ndarray) -> None:
        """Every shard's weights into ``out`` (contiguous, this dtype), copied out of the
        shared memory.  Through an inbox under a staleness bound (``read_gap``), once every
        shard has stepped on what the bound requires (:meth:`await_steps`)."""
        if self.inbox and self.read_gap is not None:
            self.await_steps(int(self._pushes[0]) - self.read_gap)
        # Our own copy, not ``MPI_Get``: Open MPI's slows 2-3x where the destination lies a
        # few bytes past the source modulo 4 KiB (AMD EPYC, 2 workers: a 4.35 MB slice
        # 0.92-1.30 ms at 16 and 20 bytes past, 0.42-0.50 ms elsewhere; numpy's copy
        # 0.44-0.59 ms at every offset), and where that falls depends on where each array
        # happened to be allocated (bench/allreduce/README.md).
        self.win.Sync()   # the pushes flushed before this read are seen
        for k in self._visit:
            a, b = self.bounds[k]
            np.copyto(out[a:b], self._shards[k].weights)

    def await_steps(self, floor: int) -> None:
        """Wait until every shard has stepped on each worker's first ``floor`` pushes, or
        on all that worker wrote where it wrote fewer (one that pushed its last).  A pull
        that the state server granted under a bound of g reads after this with ``floor`` =
        this worker's pushes - g: every worker it counted then had at least that many
        pushes written (a worker writes its count before it tells the server), so the read
        holds what the bound promises (module doc).  Past the run's deadline:
        ``DeadlineExceeded`` naming the shards behind."""
        if floor <= self._all_taken:
            return   # every shard had taken that many of everyone's when last read
        n = self._counts.shape[1] // 2
        give_up = None
        while True:
            self.win.Sync()
            for k, shard in enumerate(self._shards):
                self._counts[k, :n] = shard.posted   # (first: a take between only raises taken)
                self._counts[k, n:] = shard.taken
            posted, taken = self._counts[:, :n], self._counts[:, n:]
            behind = np.any(taken < np.minimum(posted, floor), axis=1)
            if not behind.any():
                self._all_taken = int(taken.min())
                return
            give_up = give_up or time.monotonic() + self.deadline
            if time.monotonic() > give_up:
                late = [self.names[k] for k in np.flatnonzero(behind)]
                raise DeadlineExceeded(f"{', '.join(late)} did not step on the gradients "
                                       f"this worker's read needs within the "
                                       f"{self.deadline:g}s deadline", late, "pull")
            time.sleep(INBOX_PAUSE_S)


class _ShardMemory:
    """One shard's part of a shared window, as this process sees it (``MPI_Win_shared_query``):
    its weights, when each worker last pushed and how often, and, with ``inbox``, its inbox
    (the counts and the slots, :func:`inbox_layout`)."""

    def __init__(self, win, host: int, elements: int, dtype, n_workers: int, inbox: bool):
        memory = np.frombuffer(win.Shared_query(host)[0], dtype=np.uint8)
        heard_at, pushes_at, lock_at, _ = window_layout(elements, dtype, n_workers)
        self.weights = memory[:elements * dtype.itemsize].view(dtype)
        self.heard = memory[heard_at:pushes_at].view(np.float64)
        self.pushes = memory[pushes_at:pushes_at + 8 * n_workers].view(np.int64)
        self.lock = memory[lock_at:lock_at + 8].view(np.int64)
        if not inbox:
            return
        posted_at, taken_at, slots_at, size = inbox_layout(elements, dtype, n_workers)
        self.posted = memory[posted_at:taken_at].view(np.int64)
        self.taken = memory[taken_at:taken_at + 8 * n_workers].view(np.int64)
        self.rows = memory[slots_at:size].view(dtype).reshape(SLOTS * n_workers, -1)


class ShardInbox:
    """The shard's side of its inbox (module doc): ``posted`` and ``taken`` (an int64 per
    worker) and ``slots`` (``SLOTS`` rows per worker, each padded to ``slot_bytes``) are views
    of its own window memory, of which a slot's first ``elements`` are the range's.  ``ready``
    once this rank's window is in its epoch (``ShardWindow`` opened it): before that no sum is
    taken."""

    def __init__(self, posted: np.ndarray, taken: np.ndarray, slots: np.ndarray,
                 elements: int):
        self.posted, self.taken, self.rows = posted, taken, slots
        self.slots = slots[:, :elements]
        self.ready = False
        self._sum = np.empty(elements, slots.dtype)

    def compiled_form(self) -> tuple:
        """What the shard's compiled loop takes (``_shard_loop._take_inbox``): the counts,
        the slots as whole (padded, contiguous) rows, and a buffer for their sum."""
        return self.posted, self.taken, self.rows, self._sum

    def waiting(self) -> bool:
        """Has a worker written a push the shard has not taken (plain reads of single-writer
        words: one on its way is seen at the next look)?"""
        return self.ready and bool(np.any(self.posted != self.taken))

    def take(self):
        """``(gradient, pushes, counts)``: the sum of the slots written since the last take
        (or the one slot, where one was), how many pushes it holds, and the counts read
        (:meth:`done` with them once the gradient is used)."""
        counts = self.posted.copy()   # read before the slots: each slot is complete by then
        pushes, one = sum_slots(counts, self.taken, self.rows, self._sum)
        gradient = self._sum if one < 0 else self.slots[one]
        return gradient, pushes, counts

    def done(self, counts: np.ndarray) -> None:
        """The slots read at ``counts`` are used: their workers may write them again."""
        self.taken[:] = counts


import numba  # noqa: E402
from numba import types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402


@intrinsic
def _compare_and_swap(typingctx, address, expected, desired):
    """The int64 at ``address``'s value before an atomic compare-and-swap (sequentially
    consistent) that stores ``desired`` where it held ``expected``: the lock words' one
    primitive, the same instruction whichever process maps the memory."""
    signature = types.int64(types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        at, old, new = args
        pointer = builder.inttoptr(at, context.get_value_type(types.CPointer(types.int64)))
        pair = builder.cmpxchg(pointer, old, new, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return signature, codegen


@intrinsic
def _pointer_like(typingctx, address, like):
    """An integer address as a pointer to ``like``'s element type (for ``numba.carray``)."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(like.dtype)(types.int64, like), codegen


@numba.njit(cache=True, nogil=True)
def add_into_shards(weights_at, sizes, locks_at, visit, starts, delta, out, holder, done,
                    tries):
    """Add ``delta`` into each shard's range: ``sizes[k]`` elements of ``delta``'s dtype at
    address ``weights_at[k]``, starting at ``starts[k]`` of the model; shards in the order
    ``visit``, each while holding its lock word, the int64 at ``locks_at[k]`` (0 free, taken
    by storing ``holder``); a shard whose lock is taken is passed over and come back to.
    ``out`` (unless empty): each range copied out in the same pass, its sum as this add left
    it.  ``done[j]``: ``visit[j]`` added (kept across calls).  Returns how many shards are
    left after at most ``tries`` rounds over them (0: all added).  Addresses, not arrays: a
    list of arrays would cost every process a compile at its start."""
    left = 0
    for j in range(visit.size):
        left += not done[j]
    for _ in range(tries):
        for j in range(visit.size):
            if done[j]:
                continue
            k = visit[j]
            if _compare_and_swap(locks_at[k], 0, holder) != 0:
                continue
            a, b = starts[k], starts[k] + sizes[k]
            shard = numba.carray(_pointer_like(weights_at[k], delta), sizes[k])
            if out.size:
                _add_and_copy(shard, delta[a:b], out[a:b])
            else:
                _add(shard, delta[a:b])
            _compare_and_swap(locks_at[k], holder, 0)   # a full barrier: the sums before it
            done[j] = True
            left -= 1
        if left == 0:
            break
    return left


@numba.njit(cache=True, nogil=True)
def _add(weights, delta):
    for i in range(weights.size):
        weights[i] += delta[i]


@numba.njit(cache=True, nogil=True)
def _add_and_copy(weights, delta, out):
    for i in range(weights.size):
        total = weights[i] + delta[i]
        weights[i] = total
        out[i] = total


@numba.njit(cache=True, nogil=True)
def sum_slots(counts, taken, rows, total):
    """The slots of the pushes ``taken[w]`` to ``counts[w]`` of every worker w (push j of
    worker w in row ``SLOTS * w + j % SLOTS``; a row's first ``total.size`` elements):
    ``(pushes, row)``: with one push, its row, and ``total`` is not written (the step reads
    the slot itself: its worker writes it again only after the take); else -1, and their sum
    in ``total``."""
    size = total.size
    pushes, first = 0, -1
    for w in range(counts.size):
        for j in range(taken[w], counts[w]):
            row = SLOTS * w + j % SLOTS
            if pushes == 0:
                first = row
            elif pushes == 1:
                for i in range(size):
                    total[i] = rows[first, i] + rows[row, i]
            else:
                for i in range(size):
                    total[i] += rows[row, i]
            pushes += 1
    return pushes, first if pushes == 1 else -1
