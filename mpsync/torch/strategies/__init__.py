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

from mpsync.torch.dataplane.backends import Aggregator
from mpsync.torch.dataplane.buckets import GradientBuckets
from mpsync.torch.dataplane.fusion import FusionBuffer
from mpsync.torch.strategies.base import Strategy, spec_of
from mpsync.torch.strategies.local_steps import DeltaAveraging, LocalStepsThenAggregate

__all__ = ["Strategy", "average_gradients", "GradientAveraging", "LocalStepsThenAggregate",
           "DeltaAveraging", "make_strategy", "spec_of"]


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
        self.buckets: GradientBuckets | None = None

    # -- buckets started during backward (mpsync.torch.dataplane.buckets) ---------------------
    def start_buckets(self, cap_bytes: int, should_launch) -> bool:
        """Average each bucket of gradients from the moment backward has made it final, not
        at ``step()``.  ``should_launch()``, asked at each backward pass's first gradient, says
        whether this pass is the step's last (``backward_passes_per_step``).  False where the
        gradients cannot live in the buffer (parameters off the CPU: host staging copies)."""
        if self.wire is None or not all(buf.grads_bound for buf in self.buffers):
            return False
        self.stop_buckets()
        self.buckets = GradientBuckets(self.buffers, cap_bytes, self._start_bucket,
                                       should_launch)
        return True

    def stop_buckets(self) -> None:
        """Back to the whole model at ``step()`` (what is in flight finishes first)."""
        if self.buckets is not None:
            self.drain()
            self.buckets.close()
            self.buckets = None

    def drain(self) -> None:
        """Wait for the buckets in flight without stepping (a step that is refused, a step
        under ``skip_synchronize()`` without ``synchronize()``): no collective is left open
        for the next step to trip over."""
        if self.buckets is not None and self.buckets.in_flight:
            self.buckets.wait_all()

    def _start_bucket(self, bucket):
        if bucket.has_header:
            self._fill_header(bucket.buffer.header, not self.joined)
        return self.wire.start_sum(bucket.wire, f"gradients (bucket {bucket.index})",
                                   payload=bucket.payload, divisor=self._divisor)

    def zero_grad(self, set_to_none: bool = True) -> bool:
        for buf in self.buffers:
            if set_to_none:
                # The next backward makes new gradients; they go back into the buffer (a
                # copy per parameter) at the unpack, or in the bucket hooks.
                for slot in buf.slots:
                    slot.param.grad = None
            else:
                buf.zero_bound_grads()
        return True

    def step(self, compute_time, closure=None):
        loss = closure() if closure is not None else None
        self.settled = False
        if not self._averaged and not self.skip_aggregation:
            self._average(compute_time)
        elif not self._averaged:
            # Under skip_synchronize() without synchronize(), Horovod steps on the gradients
            # as they are; buckets already started are finished first (averaged, then).
            self.drain()
        self._averaged = False
        self.optimizer.step()
        self.iteration += 1
        self.counters.iterations += 1
        return loss

    def _average(self, compute_time: float) -> tuple[int, list[int]]:
        if self.buckets is not None:
            return self._average_buckets(compute_time)
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

    def _average_buckets(self, compute_time: float) -> tuple[int, list[int]]:
        """The buckets backward started, or all of them now (no backward ran through the
        hooks: a joined worker's zeros, gradients set by hand); every gradient is then its
        view of the buffer, averaged.  The server is asked once they are in: under BSP its
        answer is SYNC whatever the timing, and its round trip (which may wait for the other
        workers' reports) then never waits with a collective in flight."""
        t0 = time.perf_counter()
        buckets = self.buckets
        started_now = not buckets.in_flight
        if started_now:
            for buf in self.buffers:
                if self.joined:
                    buf.flat.zero_()
                else:
                    buf.pack_grads()
            buckets.start_all()
        buckets.wait_all()
        decision = self.ask(compute_time, self.iteration + 1)
        if not self.is_sync(decision):
            raise RuntimeError(f"policy {self.config.policy}: the server answered {decision!r}; "
                               f"gradient averaging synchronizes every iteration (is the server "
                               f"running another policy?)")
        if started_now:
            for buf in self.buffers:
                buf.unpack_to_grads()
        self.reset(self._aggregated(t0, sum(buf.nbytes for buf in self.buffers)))
        return self._read_header(self.buffers[0].header)

    def close(self) -> None:
        self.stop_buckets()

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
                if not active or self.switch_pending():
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


def make_strategy(config, optimizer, buffers, backend, client, counters, *, worker_rank=0):
    """The strategy the registry names for ``config.policy`` on ``config.topology``."""
    cls = spec_of(config).strategy_class(config.topology)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"policy {config.policy!r}: {cls!r} is not a Strategy subclass")
    return cls.from_config(config, optimizer, buffers, backend, client, counters,
                           worker_rank=worker_rank)
