"""What a worker aggregates, per policy, and when.

A policy's strategy per topology is its registry entry (:mod:`mpsync.policies`):

==================  ==========  ============================================================
strategy            policies    per ``optimizer.step()``
==================  ==========  ============================================================
GradientAveraging   bsp         ask the server, average gradients (one fused allreduce), step
DeltaAveraging      esync,      local step; ask; on SYNC average the model deltas since the
                    ebsp (ring) last aggregation and apply them to the global model (ESync
                                Eq. 6-8: w_{t+1} = w_t + ε·mean_i(w^i - w_t))
ParameterServer     asp, ssp,   local step; ask; on SYNC push the delta since the last pull
                    dssp,       (the server applies it on arrival) and pull the current
                    esync (ps)  weights under the policy's staleness rule (ESync: a pull waits
                                for every worker's delta of the round)
ElasticSuperstep    ebsp (ps)   local step; ask; push and pull every iteration (ASP within
                                the superstep); at the ZipLine barrier (SYNC) the pull waits
                                for every worker's barrier push (BSP)
TwoStageSync        osp         OSP §3-4: Routine Sync of the important layers (blocking), ICS
(``two_stage``)                 of the rest overlapping the next iteration, LGP (Eq. 6-7) after
==================  ==========  ============================================================

``synchronize()``: the final aggregation, after which every worker holds the same model.

Uneven step counts (Horovod's ``join()`` is the model).  ``synchronize()`` first runs
``join()``: a worker with no more steps keeps taking part in the others' aggregations until
every worker has joined, contributing nothing (zeros, weight 0).  On the ring every
aggregation carries a header in the same collective (``FusionBuffer.wire``): ``[contributors,
active_0 .. active_{N-1}]`` summed over the workers; averages divide by the number of workers
as Horovod's do (a joined worker's zeros count), and the round whose active set is empty is
the last, on every worker at once.  A joined worker keeps asking the server at its mean
iteration pace (1-50 ms), so the policy sees a fast worker and never waits for it.  On the
parameter server it pushes what is left as its last update (staleness rules and ElasticBSP's
plans stop counting it) and waits for a non-blocking barrier of all workers, sending resets
at that pace; under ESync's QUERY-STATE it reports idle iterations instead and takes part in
the rounds with an empty update.  Then the model is broadcast from a worker of the last
aggregation.  More than one optimizer per process: ``followers``.
"""

from __future__ import annotations

import time

import torch

from mpsync.server import LOCAL, Decision
from mpsync.torch._counters import LocalCounters
from mpsync.torch.backends import Aggregator
from mpsync.torch.compression import WireSum
from mpsync.torch.followers import Following  # more than one optimizer per process
from mpsync.torch.fusion import FusionBuffer

__all__ = ["Strategy", "average_gradients", "GradientAveraging", "LocalStepsThenAggregate",
           "DeltaAveraging", "make_strategy", "spec_of"]


_NOT_READY = Decision(LOCAL, 0, 0)


class Strategy(Following):
    """Common plumbing: the server query, counters, the final identical-model broadcast."""

    # True: every step aggregates (no local steps between rounds).
    aggregates_every_step = False
    # What this strategy promises to hold beyond the fusion buffer (``mpsync bench memory``
    # checks it); None: no promise.
    memory_target: str | None = None
    # True: op=Sum (a sum of gradients) means something.
    aggregates_gradients = False

    def __init__(self, optimizer: torch.optim.Optimizer, buffers: list[FusionBuffer],
                 backend: Aggregator | None, client, counters: LocalCounters, config):
        self.optimizer = optimizer
        self.buffers = buffers
        self.backend = backend
        self.client = client
        self.counters = counters
        self.config = config
        self.iteration = 0   # steps taken by this worker
        self.round = 0       # aggregations completed
        # ESync §4.2 delayed ACK, for a policy that offers it (registry options).
        self.delayed_ack = bool(getattr(config, "esync_delayed_ack", False)) and \
            spec_of(config).reads("esync_delayed_ack")
        # Set by DistributedOptimizer: compression / scaling of the aggregation, op=Sum, and
        # the script's collectives (the parameter server's join barrier).
        self.wire = WireSum(backend) if backend is not None else None
        self.op_sum = False
        self.peers = None
        self.skip_aggregation = False
        self.joined = False
        # Every worker holds the same model and no aggregation is open (after synchronize(),
        # until the next step): an idle iteration could only open a round nobody finishes.
        self.settled = False
        self.n_workers = backend.size if backend is not None else 1
        self.me = backend.rank if backend is not None else 0
        self.last_active = list(range(self.n_workers))
        header = self.header_length()
        if header:
            buffers[0].add_header(header)

    @classmethod
    def from_config(cls, config, optimizer, buffers, backend, client, counters, *,
                    worker_rank: int = 0) -> "Strategy":
        """Built by :func:`make_strategy`; a subclass with settings of its own overrides it."""
        return cls(optimizer, buffers, backend, client, counters, config)

    # -- uneven step counts (module doc) --------------------------------------------------------
    def header_length(self) -> int:
        """Elements this strategy sends with its aggregation (ring: contributors + active)."""
        return 1 + self.n_workers

    def _fill_header(self, header: torch.Tensor, contributing: bool) -> None:
        header.zero_()
        if contributing:
            header[0] = 1
        if not self.joined:
            header[1 + self.me] = 1

    def _read_header(self, header: torch.Tensor) -> tuple[int, list[int]]:
        """(contributors, active workers) from a summed header; remembers the last non-empty
        active set (the root of the final broadcast)."""
        counts = [int(round(float(v))) for v in header[:1 + self.n_workers]]
        active = [r for r in range(self.n_workers) if counts[1 + r] > 0]
        if active:
            self.last_active = active
        return counts[0], active

    def _divisor(self, header: torch.Tensor) -> float:
        # Horovod's join: a joined worker's zeros count in the average (sum / size), so a
        # worker left alone at the end moves the model by 1/size of its update, not all of it.
        return 1.0 if self.op_sum else float(self.n_workers)

    def _pace(self) -> float:
        """An idle iteration of a joined worker lasts as long as its mean iteration (1-50 ms),
        so the policy keeps seeing a worker at its usual speed."""
        c = self.counters
        mean = c.compute_s / c.iterations if c.iterations else 0.0
        return min(0.05, max(1e-3, mean))

    def join(self) -> None:
        """Take part in the others' aggregations until every worker has joined."""
        raise NotImplementedError

    def idle_step(self) -> bool:
        """One idle iteration while this worker waits in a collective of the script's own
        (mpi_ops); True if it did one.  Only policies with local steps need it: their
        workers can be told SYNC at different iterations, so one may wait in the script's
        collective while another waits for it in an aggregation."""
        return False

    def synchronize_gradients(self) -> None:
        """Horovod's ``optimizer.synchronize()`` before ``step()``: make the gradients the
        step will use final.  Local-step policies step on local gradients: nothing to do."""

    # -- control plane ------------------------------------------------------------------------
    def ask(self, compute_time: float, iteration: int):
        """Report that local iteration ``iteration`` (1-based) finished and get the decision
        (SyncClient.step, one round trip); None without a control plane."""
        if self.leader is not None:
            return self.follow_decision()
        if self.client is None:
            return None
        t0 = time.perf_counter()
        if self.delayed_ack:
            # Report without waiting and keep training on the implicit NOT-READY; aggregate
            # once the READY sent for an earlier report has arrived.
            decision = self.client.step_async(iteration, compute_time).poll() or _NOT_READY
        else:
            decision = self.client.step(iteration, compute_time)
        t1 = time.perf_counter()
        self.counters.wait_s += t1 - t0
        self.counters.event("wait_server", t0, t1)
        return decision

    def note_progress(self, epoch: int, loss: float) -> None:
        """The training loop's 1-based epoch and this iteration's loss, before ``step()``
        (OSP's Alg. 1 schedules by them); other strategies ignore it."""

    @staticmethod
    def is_sync(decision) -> bool:
        return decision is None or decision.sync

    def reset(self, aggregation_time: float) -> None:
        if self.client is not None:
            t0 = time.perf_counter()
            self.client.reset(self.round, aggregation_time)
            self.counters.wait_s += time.perf_counter() - t0

    def _aggregated(self, t0: float, nbytes: int) -> float:
        t1 = time.perf_counter()
        self.round += 1
        self.counters.rounds += 1
        self.counters.aggregation_s += t1 - t0
        self.counters.bytes_sent += nbytes
        self._count_wire(nbytes)
        self.counters.event("aggregate", t0, t1)
        return t1 - t0

    def _wire_ratio(self) -> float:
        """Bytes on the wire per byte of the model: 0.5 when the optimizer's compression
        sends a float32 model as float16."""
        ratio = getattr(self, "_ratio", None)
        if ratio is None:
            compression = self.wire.compression if self.wire is not None else None
            probe = torch.zeros(1, dtype=self.buffers[0].flat.dtype)
            sent = compression.compress(probe)[0] if compression is not None else probe
            ratio = self._ratio = sent.element_size() / probe.element_size()
        return ratio

    def _count_wire(self, nbytes: int) -> None:
        """The data bytes of one ring allreduce of ``nbytes`` on this worker's link: a ring
        sends and receives 2(n-1)/n of the buffer, which is also the least any allreduce
        can (``data_min``: bytes moved, counted at the sender)."""
        n = self.n_workers
        each_way = int(2 * (n - 1) * nbytes * self._wire_ratio() // n)
        c = self.counters
        c.data_sent += each_way
        c.data_received += each_way
        c.data_min += each_way

    def _broadcast_model(self, root: int = 0) -> None:
        """Make every worker's parameters bitwise equal to worker ``root``'s."""
        for buf in self.buffers:
            buf.pack_params()
            self.backend.broadcast_(buf.flat, root, "final model")
            buf.unpack_to_params()

    # -- interface ----------------------------------------------------------------------------
    def step(self, compute_time: float, closure=None):
        raise NotImplementedError

    def synchronize(self) -> None:
        """Horovod's ``synchronize()`` after ``step()``: join, then make every worker's model
        bitwise equal (all workers call it).  A follower's rounds ran in its leader's join."""
        self.join_as_leader()
        self._broadcast_model(min(self.last_active))
        self.last_active = list(range(self.n_workers))
        self.settled = True

    def close(self) -> None:
        """Finish anything in flight (no communication is left pending at shutdown)."""

    def finish(self) -> None:
        """The end of training (the trainer, ``mps.shutdown()``): ``synchronize()`` unless
        no step was taken since the last one, after which every worker holds the same
        model."""
        if not self.settled:
            self.synchronize()

    def zero_grad(self) -> bool:
        """Zero the gradients the strategy's way; False: let the wrapped optimizer do it."""
        return False


class GradientAveraging(Strategy):
    """BSP: the gradients are averaged over the workers every iteration, then the wrapped
    optimizer steps; equal to Horovod's DistributedOptimizer and to single-process SGD on the
    concatenated batch."""

    memory_target = "none beyond the fusion buffer"
    aggregates_every_step = True
    aggregates_gradients = True
    _averaged = False

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        for buf in self.buffers:
            buf.bind_grads()

    def zero_grad(self) -> bool:
        for buf in self.buffers:
            buf.zero_bound_grads()
        return True

    def step(self, compute_time, closure=None):
        loss = closure() if closure is not None else None
        self.settled = False
        if not self._averaged and not self.skip_aggregation:
            self._average(compute_time)
        # Under skip_synchronize() without synchronize(), Horovod steps on local gradients.
        self._averaged = False
        self.optimizer.step()
        self.iteration += 1
        self.counters.iterations += 1
        return loss

    def _average(self, compute_time: float) -> tuple[int, list[int]]:
        decision = self.ask(compute_time, self.iteration + 1)
        if not self.is_sync(decision):
            raise RuntimeError(f"policy {self.config.policy}: the server answered {decision!r}; "
                               f"gradient averaging synchronizes every iteration (is the server "
                               f"running another policy?)")
        t0 = time.perf_counter()
        nbytes = 0
        contributing = not self.joined
        first = self.buffers[0]
        self._fill_header(first.header, contributing)
        divisor = None
        for buf in self.buffers:
            if contributing:
                buf.pack_grads()
            else:
                buf.flat.zero_()
            self.wire.sum_(buf.wire, "gradients", payload=buf.numel,
                           divisor=divisor or self._divisor)
            if divisor is None:
                divisor = lambda _h, d=self._divisor(first.header): d  # noqa: E731
            buf.unpack_to_grads()
            nbytes += buf.nbytes
        self.reset(self._aggregated(t0, nbytes))
        return self._read_header(first.header)

    def synchronize_gradients(self) -> None:
        """Horovod's meaning: average the current gradients now; the next ``step()`` uses them
        without another allreduce (so gradient clipping can sit between the two)."""
        if not self._averaged:
            self._average(0.0)
            self._averaged = True

    def join(self) -> None:
        """Zero gradients into every round the others run; the averaged gradients are applied
        here too, so this replica (and its optimizer state) stays equal to theirs."""
        self.joined = True
        try:
            while True:
                self.iteration += 1
                contributors, active = self._average(0.0)
                if contributors:
                    self.optimizer.step()
                self.followers_round()
                if not active:
                    return
        finally:
            self.joined = False


def average_gradients(buffers: list[FusionBuffer], backend: Aggregator) -> int:
    """BSP's data path: pack every gradient into the fusion buffer, one averaging collective,
    unpack.  Returns the bytes contributed.  (``mpsync bench allreduce`` times this.)"""
    nbytes = 0
    for buf in buffers:
        buf.pack_grads()
        backend.allreduce_average_(buf.flat, "gradients")
        buf.unpack_to_grads()
        nbytes += buf.nbytes
    return nbytes


class LocalStepsThenAggregate(Strategy):
    """A local optimizer step every iteration; aggregate when the server says SYNC.

    Under ESync's QUERY-STATE (the registry's ``query_state`` family) two more steps of ESync
    Alg. 1: before the first local step the worker reports iteration 0 with the time of its
    first batch as capability (line 3, RUN-BATCH-DATA-TEST, and line 8's query with k = 0,
    held by the server until every capability is known); and in delayed-ACK mode (§4.2) a
    READY that has arrived by the time an iteration's gradients are computed aborts that
    iteration (k + δ): its update is discarded and iterations 1..k + δ - 1 are aggregated.
    Departure [esync-test-batch]: the test batch is the first training batch, then trained on.
    Departure [esync-abort-between-steps]: the abort is checked between backward and the
    optimizer step, not as soon as READY lands (a worker sees replies between iterations).
    """

    local_steps = 0       # since the last aggregation (ESync's k)
    aborted = 0           # §4.2: iterations discarded because READY arrived during them

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.capability_test = self.client is not None and \
            spec_of(self.config).fast_path == "query_state"

    def _prepare(self) -> None:
        """Before the first local step (after the user's broadcast_parameters)."""

    def _aggregate(self) -> None:
        raise NotImplementedError

    def _local_update(self) -> None:
        """This iteration's step of the worker's own optimizer."""
        self.optimizer.step()

    def _test_capability(self, compute_time: float) -> None:
        """ESync Alg. 1 lines 3-8, once: blocking even in delayed-ACK mode."""
        self.capability_test = False
        t0 = time.perf_counter()
        self.client.step(0, compute_time)
        t1 = time.perf_counter()
        self.counters.wait_s += t1 - t0
        self.counters.event("wait_server", t0, t1)

    def step(self, compute_time, closure=None):
        loss = closure() if closure is not None else None
        self._prepare()
        self.settled = False
        if self.capability_test:
            self._test_capability(compute_time)
        if self.delayed_ack and self.local_steps > 0 and self.client.ready_arrived():
            # ESync §4.2: READY for an earlier report came in while this iteration ran.
            self.aborted += 1
            self.counters.event("abort", time.perf_counter(), time.perf_counter())
            self._aggregate()
            self.local_steps = 0
            return loss
        self._local_update()  # ESync Eq. 5: the local update of the replica
        self.iteration += 1
        self.local_steps += 1
        self.counters.iterations += 1
        if self.is_sync(self.ask(compute_time, self.iteration)):
            self._aggregate()
            self.local_steps = 0
        return loss

    def _idle_ready(self) -> bool:
        raise NotImplementedError

    def idle_step(self) -> bool:
        if self.joined or self.settled or self.leader is not None or not self._idle_ready():
            return False
        pace = self._pace()
        self.iteration += 1
        if self.is_sync(self.ask(pace, self.iteration)):
            self._aggregate()
            self.local_steps = 0
            self.followers_round(joined=False)  # the others run theirs at their next step
        time.sleep(pace)
        return True


class DeltaAveraging(LocalStepsThenAggregate):
    """ESync and ElasticBSP on the ring: local SGD steps, then model-delta averaging.

    ESync Eq. 6-8: Δw^i = w^i - w_t, Δw = mean_i Δw^i, w_{t+1} = w_t + ε·Δw, and every replica
    restarts from w_{t+1} (Alg. 1 lines 17-22).  ElasticBSP uses the same aggregation with ε = 1
    once the server's ZipLine barrier is reached.  Memory: one global model copy per buffer
    (``_global``), reusing the fusion buffer for the delta.

    Departure [ebsp-ring-local-sgd]: ElasticBSP's superstep pushes every iteration to a
    parameter server (ASP within it, ZipLine §6.2.5); a ring has no server copy of the weights,
    so between ZipLine barriers it runs local SGD and the barrier averages the model deltas.
    """

    memory_target = "at most one parameter copy beyond the fusion buffer"

    def __init__(self, *args, epsilon: float = 1.0, **kw):
        super().__init__(*args, **kw)
        self.epsilon = float(epsilon)
        self._global: list[torch.Tensor] | None = None

    @classmethod
    def from_config(cls, config, *args, worker_rank: int = 0):
        # ε of Eq. 8 for a policy that reads ``epsilon`` (ESync); plain averaging otherwise.
        return cls(*args, config, epsilon=spec_of(config).global_step(config))

    def _snapshot(self) -> None:
        if self._global is None:  # first step: after the user's broadcast_parameters
            self._global = [buf.pack_params().clone() for buf in self.buffers]

    _prepare = _snapshot

    def _idle_ready(self) -> bool:
        return self._global is not None

    def _aggregate(self, contributing: bool = True) -> tuple[int, list[int]]:
        t0 = time.perf_counter()
        nbytes = 0
        first = self.buffers[0]
        self._fill_header(first.header, contributing)
        divisor = None
        for buf, w_global in zip(self.buffers, self._global):
            delta = buf.pack_params()
            delta.sub_(w_global)                                    # Eq. 6
            if not contributing:
                delta.zero_()
            self.wire.sum_(buf.wire, "model deltas", payload=buf.numel,
                           divisor=divisor or self._divisor)        # Eq. 7
            if divisor is None:
                divisor = lambda _h, d=self._divisor(first.header): d  # noqa: E731
            w_global.add_(delta, alpha=self.epsilon)                # Eq. 8
            buf.unpack_to_params(w_global)
            nbytes += buf.nbytes
        header = self._read_header(first.header)
        if self.round == 0:
            # Every replica restarts from the same w_{t+1} (ESync Alg. 1 lines 17-22, ZipLine
            # §3's barrier): the same mean delta goes onto the same w_t, which the first round
            # (reached by all together) makes equal, with or without broadcast_parameters.
            for buf, w_global in zip(self.buffers, self._global):
                self.backend.broadcast_(w_global, min(header[1] or self.last_active), "w_1")
                buf.unpack_to_params(w_global)
        self.reset(self._aggregated(t0, nbytes))
        return header

    def join(self) -> None:
        """Idle iterations at this worker's pace; on SYNC, the local progress left (first
        time) or nothing; every replica is set to the new global model each round."""
        self._snapshot()
        self.joined = True
        pending = self.local_steps > 0
        pace = self._pace()
        try:
            while True:
                self.iteration += 1
                if self.is_sync(self.ask(pace, self.iteration)):
                    _, active = self._aggregate(contributing=pending)
                    pending, self.local_steps = False, 0
                    self.followers_round()
                    if not active:
                        return
                else:
                    time.sleep(pace)
        finally:
            self.joined = False


def make_strategy(config, optimizer, buffers, backend, client, counters, *, worker_rank=0):
    """The strategy the registry names for ``config.policy`` on ``config.topology``."""
    cls = spec_of(config).strategy_class(config.topology)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"policy {config.policy!r}: {cls!r} is not a Strategy subclass")
    return cls.from_config(config, optimizer, buffers, backend, client, counters,
                           worker_rank=worker_rank)


def spec_of(config):
    """The registry entry of ``config.policy``."""
    from mpsync import policies

    return policies.get(config.policy)
