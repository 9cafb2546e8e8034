"""Strategies with local steps: a local optimizer step every iteration, an aggregation when the
server says SYNC (ESync on the ring and, through ``strategies.ps``, on the parameter server;
ElasticBSP on the ring).  The table of all strategies is :mod:`mpsync.torch.strategies`'.
"""

from __future__ import annotations

import time

import torch

from mpsync.torch.strategies.base import Strategy, spec_of

__all__ = ["LocalStepsThenAggregate", "DeltaAveraging"]


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
        if self.is_sync(self.ask(self._usual_compute(), self.iteration)):
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
                if self.is_sync(self.ask(self._usual_compute(), self.iteration)):
                    _, active = self._aggregate(contributing=pending)
                    pending, self.local_steps = False, 0
                    self.followers_round()
                    if not active or self.switch_pending():
                        return
                else:
                    time.sleep(pace)
        finally:
            self.joined = False
