"""What a worker aggregates, per policy, and when.

Which strategy a policy uses on each topology is its entry in the registry
(:mod:`mpsync.policies`); the table below is mpsync's own policies.

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
TwoStageSync        osp         OSP §3-4: Routine Sync of the important layers (blocking), In-
(``two_stage``)                 Computation Sync of the rest overlapped with the next
                                iteration, LGP correction (Eq. 6-7) when it lands
==================  ==========  ============================================================

Every strategy works on :class:`~mpsync.torch.fusion.FusionBuffer` s and an
:class:`~mpsync.torch.backends.Aggregator`; ``client`` is the control plane's ``SyncClient``
(``None``: no state server, every step synchronizes, which only makes sense for BSP).
``synchronize()`` is the final aggregation after which every worker holds the same model.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from mpsync.server import LOCAL, Decision
from mpsync.torch._counters import LocalCounters
from mpsync.torch.backends import Aggregator
from mpsync.torch.fusion import FusionBuffer

__all__ = ["Strategy", "average_gradients", "GradientAveraging", "DeltaAveraging", "ParameterServer",
           "ElasticSuperstep", "make_strategy"]


_NOT_READY = Decision(LOCAL, 0, 0)


class Strategy:
    """Common plumbing: the server query, counters, the final identical-model broadcast."""

    # True: every step aggregates (no local steps between rounds).
    aggregates_every_step = False
    # What this strategy promises to hold beyond the fusion buffer (``mpsync bench memory``
    # checks it); None: no promise.
    memory_target: str | None = None

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
            _spec(config).reads("esync_delayed_ack")

    @classmethod
    def from_config(cls, config, optimizer, buffers, backend, client, counters, *,
                    worker_rank: int = 0) -> "Strategy":
        """Built by :func:`make_strategy`; a subclass with settings of its own overrides it."""
        return cls(optimizer, buffers, backend, client, counters, config)

    # -- control plane ------------------------------------------------------------------------
    def ask(self, compute_time: float, iteration: int):
        """Report that local iteration ``iteration`` (1-based) finished and get the decision
        (SyncClient.step, one round trip); None without a control plane."""
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
        self.counters.event("aggregate", t0, t1)
        return t1 - t0

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
        raise NotImplementedError

    def close(self) -> None:
        """Finish anything in flight (no communication is left pending at shutdown)."""

    def finish(self) -> None:
        """The final aggregation at shutdown, after which every worker holds the same model."""
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
        if not self._averaged:
            self._average(compute_time)
        self._averaged = False
        self.optimizer.step()
        self.iteration += 1
        self.counters.iterations += 1
        return loss

    def _average(self, compute_time: float) -> None:
        decision = self.ask(compute_time, self.iteration + 1)
        if not self.is_sync(decision):
            raise RuntimeError(f"policy {self.config.policy}: the server answered {decision!r}; "
                               f"gradient averaging synchronizes every iteration (is the server "
                               f"running another policy?)")
        t0 = time.perf_counter()
        nbytes = average_gradients(self.buffers, self.backend)
        self.reset(self._aggregated(t0, nbytes))

    def synchronize(self) -> None:
        """Horovod's meaning: average the current gradients now; the next ``step()`` uses them
        without another allreduce (so gradient clipping can sit between the two)."""
        if not self._averaged:
            self._average(0.0)
            self._averaged = True

    def finish(self) -> None:
        """Nothing to do: every step aggregated, so the replicas are already equal."""


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
    Departure: the test batch is the first training batch (it is then trained on, not thrown
    away), and the abort is checked between backward and the optimizer step, not as soon as
    READY lands (a worker sees replies between iterations only).
    """

    local_steps = 0       # since the last aggregation (ESync's k)
    aborted = 0           # §4.2: iterations discarded because READY arrived during them

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.capability_test = self.client is not None and \
            _spec(self.config).fast_path == "query_state"

    def _prepare(self) -> None:
        """Before the first local step (after the user's broadcast_parameters)."""

    def _aggregate(self) -> None:
        raise NotImplementedError

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
        if self.capability_test:
            self._test_capability(compute_time)
        if self.delayed_ack and self.local_steps > 0 and self.client.ready_arrived():
            # ESync §4.2: READY for an earlier report came in while this iteration ran.
            self.aborted += 1
            self.counters.event("abort", time.perf_counter(), time.perf_counter())
            self._aggregate()
            self.local_steps = 0
            return loss
        self.optimizer.step()  # ESync Eq. 5: the local update of the replica
        self.iteration += 1
        self.local_steps += 1
        self.counters.iterations += 1
        if self.is_sync(self.ask(compute_time, self.iteration)):
            self._aggregate()
            self.local_steps = 0
        return loss


class DeltaAveraging(LocalStepsThenAggregate):
    """ESync and ElasticBSP on the ring: local SGD steps, then model-delta averaging.

    ESync Eq. 6-8: Δw^i = w^i - w_t, Δw = mean_i Δw^i, w_{t+1} = w_t + ε·Δw, and every replica
    restarts from w_{t+1} (Alg. 1 lines 17-22).  ElasticBSP uses the same aggregation with ε = 1
    once the server's ZipLine barrier is reached.  Memory: one global model copy per buffer
    (``_global``), reusing the fusion buffer for the delta.

    Departure (ElasticBSP on the ring): the paper's superstep pushes every iteration to a
    parameter server (ASP within it, ZipLine §6.2.5); a ring has no server copy of the
    weights, so the iterations between ZipLine barriers are local SGD and the barrier
    averages the model deltas: ElasticBSP barriers with local SGD between them.
    """

    memory_target = "at most one parameter copy beyond the fusion buffer"

    def __init__(self, *args, epsilon: float = 1.0, **kw):
        super().__init__(*args, **kw)
        self.epsilon = float(epsilon)
        self._global: list[torch.Tensor] | None = None

    @classmethod
    def from_config(cls, config, *args, worker_rank: int = 0):
        # ε of Eq. 8 for a policy that reads ``epsilon`` (ESync); plain averaging otherwise.
        return cls(*args, config, epsilon=_spec(config).global_step(config))

    def _snapshot(self) -> None:
        if self._global is None:  # first step: after the user's broadcast_parameters
            self._global = [buf.pack_params().clone() for buf in self.buffers]

    _prepare = _snapshot

    def _aggregate(self) -> None:
        t0 = time.perf_counter()
        nbytes = 0
        for buf, w_global in zip(self.buffers, self._global):
            delta = buf.pack_params()
            delta.sub_(w_global)                                    # Eq. 6
            self.backend.allreduce_average_(delta, "model deltas")  # Eq. 7
            w_global.add_(delta, alpha=self.epsilon)                # Eq. 8
            buf.unpack_to_params(w_global)
            nbytes += buf.nbytes
        self.reset(self._aggregated(t0, nbytes))

    def synchronize(self) -> None:
        """Final aggregation of whatever local progress is left; all workers must call it."""
        self._snapshot()
        self._aggregate()
        self._broadcast_model()


class ParameterServer(LocalStepsThenAggregate):
    """PS topology: the global weights live on the server (rank 0).

    The worker keeps ``_base``, the weights of its last pull; on SYNC it pushes
    Δ = w_local - base (its updates since that pull; the server applies w += Δ on arrival) and
    pulls the current weights, blocking as long as the policy's staleness rule says (SSP, DSSP
    Alg. 1).  Each worker's updates therefore reach the global model exactly once.

    Memory (at most one extra copy of the parameters): ``_base`` is the only one besides the
    fusion buffer.  Δ is computed into ``_base`` itself and pushed from there: the
    push is a blocking send, and the pull that follows overwrites ``_base`` with the current
    weights, so the base is not needed between the two.
    """

    def __init__(self, *args, worker_rank: int = 0, **kw):
        super().__init__(*args, **kw)
        if len(self.buffers) != 1:
            raise ValueError("topology='ps' needs all parameters in one dtype, got "
                             f"{[str(b.dtype) for b in self.buffers]}")
        self.buf = self.buffers[0]
        self.worker_rank = worker_rank
        self._base: np.ndarray | None = None  # float64: the wire format of push and pull
        self.version = 0

    @classmethod
    def from_config(cls, config, *args, worker_rank: int = 0):
        return cls(*args, config, worker_rank=worker_rank)

    def _start(self) -> None:
        if self._base is not None:
            return
        self._base = self.buf.pack_params().to(torch.float64).numpy().copy()
        if self.worker_rank == 0:
            self.client.ps_init(self._base)
        self._pull()

    def _pull(self, final: bool = False) -> None:
        t0 = time.perf_counter()
        self.version = self.client.pull(self._base, self.iteration, final=final)
        self.buf.flat.copy_(torch.from_numpy(self._base))
        self.buf.unpack_to_params()
        self.counters.aggregation_s += time.perf_counter() - t0

    _prepare = _start

    def pull_global(self) -> int:
        """Pull the current global weights into the model now and return their version.

        For a checkpoint: the caller makes sure every worker's pushes so far are in (and that
        none pushes before this returns), so the pulled weights are the global model at that
        cut.  The pull skips the staleness rule (the ``final`` flag): with every push in, no
        rule has anything left to wait for, and a checkpoint must not depend on one."""
        self._start()
        self._pull(final=True)
        return self.version

    def _delta_into_base(self) -> np.ndarray:
        """Δ = w_local - base, written over ``_base`` (numpy casts a float32 model up to
        float64 element by element, without a temporary copy)."""
        local = self.buf.pack_params()
        if local.dtype not in (torch.float64, torch.float32, torch.float16):
            local = local.to(torch.float64)  # numpy has no bfloat16: a transient copy
        np.subtract(local.numpy(), self._base, out=self._base)
        return self._base

    def _push_pull(self) -> None:
        """Push Δ since the last pull, pull the current weights (as the policy allows)."""
        self.client.push(self._delta_into_base(), self.iteration)
        self.version = self.client.pull(self._base, self.iteration)
        self.buf.flat.copy_(torch.from_numpy(self._base))
        self.buf.unpack_to_params()
        if self.config.comm_delay > 0:
            # Emulated network latency of the push+pull (the ring applies it in EmulatedLink):
            # inside the aggregation's time, so it is booked as aggregation, not compute.
            time.sleep(self.config.comm_delay)

    def _aggregate(self) -> None:
        t0 = time.perf_counter()
        self._push_pull()
        self.reset(self._aggregated(t0, self._base.nbytes))

    def synchronize(self) -> None:
        """Push what is left, wait until every worker has pushed, pull the final weights."""
        self._start()
        t0 = time.perf_counter()
        self.client.push(self._delta_into_base(), self.iteration, final=True)
        self.backend.barrier("final push")
        self._pull(final=True)  # every push is in: no staleness rule left to wait for
        self._broadcast_model()
        self._aggregated(t0, self._base.nbytes)


class ElasticSuperstep(ParameterServer):
    """ElasticBSP on the PS (ZipLine paper §3, §6.2.5): every iteration pushes its update and
    pulls the current weights (ASP within the superstep; the server answers such a pull at
    once); the step the server answers SYNC is the ZipLine barrier, whose pull the server
    holds until every active worker's barrier push is in (BSP), after which the worker resets
    and the next superstep's monitoring phase begins.  ``supersteps`` records, per superstep,
    this worker's pushes and barrier iteration."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.pushes_in_superstep = 0
        self.supersteps: list[dict] = []

    def step(self, compute_time, closure=None):
        loss = closure() if closure is not None else None
        self._prepare()
        self.optimizer.step()
        self.iteration += 1
        self.local_steps += 1
        self.counters.iterations += 1
        barrier = self.is_sync(self.ask(compute_time, self.iteration))
        t0 = time.perf_counter()
        self._push_pull()
        self.pushes_in_superstep += 1
        if barrier:
            self.supersteps.append({"superstep": len(self.supersteps),
                                    "barrier_iteration": self.iteration,
                                    "pushes": self.pushes_in_superstep})
            self.pushes_in_superstep = 0
            self.local_steps = 0
            self.reset(self._aggregated(t0, self._base.nbytes))
        else:
            t1 = time.perf_counter()
            self.counters.aggregation_s += t1 - t0
            self.counters.bytes_sent += self._base.nbytes
            self.counters.event("aggregate", t0, t1)
        return loss


def make_strategy(config, optimizer, buffers, backend, client, counters, *, worker_rank=0):
    """The strategy the registry names for ``config.policy`` on ``config.topology``."""
    cls = _spec(config).strategy_class(config.topology)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"policy {config.policy!r}: {cls!r} is not a Strategy subclass")
    return cls.from_config(config, optimizer, buffers, backend, client, counters,
                           worker_rank=worker_rank)


def _spec(config):
    from mpsync import policies

    return policies.get(config.policy)
