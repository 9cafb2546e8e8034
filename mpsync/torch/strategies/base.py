"""The worker strategy's common plumbing: the server query, counters, the uneven-step header
and the final identical-model broadcast (:class:`Strategy`).  What each policy aggregates is
in :mod:`mpsync.torch.strategies` (the table there), :mod:`mpsync.torch.strategies.local_steps`,
:mod:`mpsync.torch.strategies.ps`, :mod:`mpsync.torch.strategies.two_stage`; a run whose policy changes
while it trains (``auto``) hands the same optimizer, buffers and counters from one strategy to
the next (:mod:`mpsync.torch.strategies.switching`).
"""

from __future__ import annotations

import time

import torch

from mpsync.server import LOCAL, Decision
from mpsync.torch.strategies.counters import LocalCounters
from mpsync.torch.dataplane.backends import Aggregator
from mpsync.torch.dataplane.compression import WireSum
from mpsync.torch.strategies.followers import Following  # more than one optimizer per process
from mpsync.torch.dataplane.fusion import FusionBuffer

__all__ = ["Strategy", "spec_of"]


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
    # Under ``auto``: this strategy's policy code (``mpsync.auto.SWITCHABLE``: 1 + index), which
    # the server's SYNC replies carry for the policy to run after that round; 0 otherwise.
    code = 0
    last_decision = None

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
        # One read of the whole header (on a GPU: one copy to the host, not one per value).
        counts = [int(round(v)) for v in header[:1 + self.n_workers].tolist()]
        active = [r for r in range(self.n_workers) if counts[1 + r] > 0]
        if active:
            self.last_active = active
        return counts[0], active

    def _divisor(self, header: torch.Tensor) -> float:
        # Horovod's join: a joined worker's zeros count in the average (sum / size), so a
        # worker left alone at the end moves the model by 1/size of its update, not all of it.
        return 1.0 if self.op_sum else float(self.n_workers)

    def _pace(self) -> float:
        """An idle iteration of a joined worker lasts as long as its mean iteration, within
        1-50 ms (a joined worker answers the others' rounds quickly)."""
        return min(0.05, max(1e-3, self._usual_compute()))

    def _usual_compute(self) -> float:
        """What an idle iteration reports as its compute time: the worker's mean iteration
        (not the pace it idles at), so the policy, and ``auto``'s measurements, keep seeing
        the worker at its usual speed: a 150 ms worker idling at 50 ms read as a worker 3x
        faster, a cluster change ``auto`` ranked again for."""
        c = self.counters
        mean = c.compute_s / c.iterations if c.iterations else 0.0
        return max(1e-3, mean)

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
            if self.leader.client is not None:
                # The server hears of this worker only through its leader's steps: a follower
                # stepping alone (its leader's model done with) must not look silent.
                self.leader.client.alive()
            return self.follow_decision()
        if self.client is None:
            return None
        t0 = time.perf_counter()
        if self.delayed_ack:
            # Report without waiting and keep training on the implicit NOT-READY; aggregate
            # once the READY sent for an earlier report has arrived.
            decision = self.client.step_async(iteration, compute_time).poll() or _NOT_READY
        elif self.code == 0 and spec_of(self.config).steps_unawaited:
            # Every step is SYNC (ASP, SSP, DSSP: their rules rule on the pull): report, and
            # collect the reply after the exchange.
            decision = self.client.step_unawaited(iteration, compute_time)
        else:
            decision = self.client.step(iteration, compute_time)
        self.last_decision = decision
        t1 = time.perf_counter()
        self.counters.wait_s += t1 - t0
        self.counters.event("wait_server", t0, t1)
        return decision

    def note_progress(self, epoch: int, loss: float) -> None:
        """The training loop's 1-based epoch and this iteration's loss, before ``step()``
        (OSP's Alg. 1 schedules by them); other strategies ignore it."""

    def switch_pending(self) -> bool:
        """The last SYNC told this worker to run another policy after its round (``auto``):
        a join loop stops there and the switching strategy carries on (``switching``)."""
        d = self.last_decision
        return self.code > 0 and d is not None and d.sync and 0 < d.extra != self.code

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

    def zero_grad(self, set_to_none: bool = True) -> bool:
        """Zero the gradients the strategy's way; False: let the wrapped optimizer do it."""
        return False

    def drain(self) -> None:
        """Finish what this strategy started for the current step without stepping (a step
        that is refused); nothing for strategies that start nothing before ``step()``."""


def spec_of(config):
    """The registry entry of ``config.policy``."""
    from mpsync import policies

    return policies.get(config.policy)
