"""OSP's worker strategy (OSP paper §3-4): Routine Sync of the important layers, In-Computation
Sync of the rest overlapped with the next iteration, and the local-gradient correction."""

from __future__ import annotations

import time

import numpy as np
import torch

from mpsync.torch.dataplane.backends import Pending
from mpsync.torch.strategies.base import Strategy

__all__ = ["TwoStageSync", "osp_u_max", "times_rate"]

# Rounds whose Routine Sync is timed for Eq. 5's bandwidth: the first RATE_WARMUP, then one in
# RATE_EVERY (each costs one barrier; the rate of a link changes slowly).
RATE_WARMUP, RATE_EVERY = 3, 8


def times_rate(k: int) -> bool:
    """Whether round ``k`` (1-based; the same on every worker) times its Routine Sync."""
    return k <= RATE_WARMUP or k % RATE_EVERY == 0


def osp_u_max(rate_bytes_s: float, t_compute: float, itemsize: int, n_workers: int = 1) -> float:
    """OSP Eq. 5's U_max = b(1 + lr)·T_c / N in model elements (``sched.osp_ics_budget``),
    from a measured aggregation rate.  An allreduce of S bytes that took T seconds over N
    workers moved the equivalent of N·S bytes through a parameter server's link: b = N·S/T,
    so U_max = (S/T)·T_c whatever N; the loss rate lr is 0 (retransmissions are already in the
    measured time).  The 0.8 cap of Alg. 1 line 2 is the server's (it knows the model size)."""
    from mpsync.sched import osp_ics_budget

    if not (rate_bytes_s > 0 and t_compute > 0):
        return 0.0
    n = max(int(n_workers), 1)
    return float(osp_ics_budget(n * rate_bytes_s / itemsize, 0.0, t_compute, n, np.inf))


class TwoStageSync(Strategy):
    """OSP (OSP paper §3-4) on the ring.

    Iteration i, after backward (local gradients G^l):

    1. If the In-Computation Sync of iteration i-1 is in flight, finish it and apply the
       Local-Gradient-based Parameter correction, Eq. 7: P -= lr·(G^g - G^l) on its layers
       (the local gradient used in step 3 of i-1 is replaced by the global one).  The worker
       now holds G^g of iteration i-1 on every layer.
    2. The Gradient Importance Bitmap (GIB) of iteration i is the server's answer to the
       importance report this worker sent at the end of step i-1 (below), which travelled
       and was answered while the worker computed iteration i: it is waited for here only if
       it has not arrived yet (§3.2, §4.5: the GIB is calculated asynchronously, "in advance
       with the worker's computation"; Eq. 5 counts T_Calc.GIB and T_PushGIB inside T_c).
    3. Routine Sync: the layers the bitmap for i marks important are averaged (blocking); the
       others start a non-blocking allreduce (ICS) that runs during the next forward/backward;
       the optimizer steps with global gradients on RS layers and local ones on ICS layers
       (LGP, Eq. 6).
    4. After the optimizer step, the importance I_l = Σ|G·P| per layer (Eq. 4) of this
       iteration's gradients and the parameters just updated goes to the server without
       waiting, with this iteration's loss and epoch (``note_progress``) and the U_max this
       worker measured (Eq. 5, :func:`osp_u_max`: ``link_rate`` times ``compute_time``); the
       server answers with the GIB of iteration i+1 (one iteration of lag, §3.2; sized by
       Alg. 1; the first report of an iteration decides it for every worker).

    Departure [osp-ics-local-importance]: on the layers in In-Computation Sync the importance
    in step 4 is of the local gradient, the estimate of the global one that LGP (Eq. 6) also
    steps with, because their global gradient lands during the next computation; the paper's
    PS computes the GIB from what it holds when it computes it.  The first iteration, and rounds after a join or a
    ``synchronize()``, have no report in flight: they report the global gradients of the
    previous iteration and wait for the answer.
    Eq. 5's b is the rate of the network, not of the slowest worker: a Routine Sync is a
    blocking allreduce, so on a worker that finished its computation early it also lasts until
    the slowest worker arrives, and its duration would give a fast worker a bound as small as
    its waiting is long.  So the rounds that time it (:func:`times_rate`) first meet in a
    barrier, where that waiting ends, and ``link_rate`` is the Routine Sync's bytes over the
    allreduce's own duration after it.  T_c is the worker's own time between steps
    (``compute_time``, forward + backward + data), so U_max differs between workers by the
    ratio of their compute times, and the server takes the smallest.

    Without ``note_progress`` (a training loop that does not report its epoch) every
    iteration counts as epoch 1, where Alg. 1 keeps S(G^u) = 0: all Routine Sync, i.e. BSP.

    Uneven step counts (``strategies`` module doc): the Routine Sync carries the header of
    contributors and active workers; a joined worker reports like the others (the importance
    of the global gradients it also holds, no loss), so it gets the same bitmap from the
    server and runs the same collectives with zero gradients.

    No gradient is dropped: every ICS allreduce is finished and corrected at the next step or
    in ``synchronize()``.  Departure [osp-lgp-plain-sgd]: Eq. 7 is exact for SGD, with or
    without momentum (the momentum buffer is corrected too, ``_correct``); with other
    optimizers (Adam) the correction is the same SGD-shaped term and the optimizer's state
    keeps the local gradient.
    With the ``mpi`` backend Open MPI progresses a non-blocking collective only inside MPI
    calls, so gradient hooks call ``test()`` during backward; Horovod progresses on its own
    thread.
    """

    aggregates_every_step = True
    aggregates_gradients = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        if len(self.buffers) != 1:
            raise ValueError(f"policy={self.config.policy!r} needs all parameters in one dtype, got "
                             f"{[str(b.dtype) for b in self.buffers]}")
        self.buf = self.buffers[0]
        self.n_layers = len(self.buf.layer_names)
        self.bitmap = np.zeros(self.n_layers, dtype=bool)  # iteration 1: all Routine Sync
        self._pending: Pending | None = None
        self._ics_ranges: list | None = None
        self._ics_local: torch.Tensor | None = None
        self._ics_global: torch.Tensor | None = None
        self.ics_layers_total = 0
        self._prev_global: torch.Tensor | None = None   # G^g of the previous iteration
        self._epoch, self._loss = 0, None
        self._rate = 0.0       # bytes/s of the timed Routine Syncs (moving average)
        self._t_compute = 0.0  # seconds of computation per iteration (moving average)
        self._hooks = [p.register_hook(self._progress) for p in self.buf.params
                       if p.requires_grad]
        self._next_gib = None  # the importance report in flight for the next iteration's GIB
        # The layer of each parameter: Eq. 4 sums over a layer's parameters.
        self._slot_layer = [int(np.searchsorted(self.buf.layer_bounds[:, 1], s.offset,
                                                side="right")) for s in self.buf.slots]

    def note_progress(self, epoch: int, loss: float) -> None:
        self._epoch, self._loss = int(epoch), float(loss)

    def _note_rate(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            rate = nbytes / seconds
            self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate

    @property
    def link_rate(self) -> float:
        """Bytes per second of the Routine Sync allreduce, timed after a barrier (0 before
        the first timed round)."""
        return self._rate

    @property
    def compute_time(self) -> float:
        """Seconds of computation per iteration, T_c of Eq. 5 (moving average)."""
        return self._t_compute

    @property
    def u_max(self) -> float:
        """This worker's U_max (Eq. 5) in model elements, from its measurements so far."""
        return osp_u_max(self._rate, self._t_compute, self.buf.flat.element_size(),
                         self.backend.size if self.backend is not None else 1)

    def _group_of_params(self) -> dict[int, dict]:
        """Each parameter's group, read every time: schedulers change the learning rate."""
        return {id(p): group for group in self.optimizer.param_groups for p in group["params"]}

    def _correct(self, param: torch.Tensor, diff: torch.Tensor, group: dict) -> None:
        """Eq. 7 on one parameter: replace the local gradient its last step used by the global
        one (``diff`` = G^g - G^l).  With SGD's momentum the local gradient also went into
        the momentum buffer, which every later step applies again: it is corrected too, so the
        step is the one the global gradient would have made and the replicas stay equal."""
        lr = group["lr"]
        momentum = group.get("momentum", 0.0) if isinstance(self.optimizer, torch.optim.SGD) \
            else 0.0
        buf = self.optimizer.state.get(param, {}).get("momentum_buffer") if momentum else None
        if buf is None:
            param.add_(diff, alpha=-lr)
            return
        damped = 1.0 - group.get("dampening", 0.0)
        buf.add_(diff, alpha=damped)
        scale = 1.0 + momentum * damped if group.get("nesterov") else damped
        param.add_(diff, alpha=-lr * scale)

    def _progress(self, grad):
        if self._pending is not None:
            self._pending.test()
        return grad

    def _finish_ics(self) -> None:
        """Wait for the in-flight ICS and apply the LGP correction (Eq. 7) on its layers."""
        if self._pending is None:
            return
        t0 = time.perf_counter()
        self._pending.wait()
        self.buf.scatter(self._ics_global, self._prev_global, self._ics_ranges)
        correction = self._ics_global.sub_(self._ics_local)  # G^g - G^l, in place
        group_of = self._group_of_params()
        with torch.no_grad():
            for slot, pos in self.buf.slots_in(self._ics_ranges):
                piece = correction[pos:pos + slot.numel].view(slot.param.shape)
                self._correct(slot.param, piece, group_of[id(slot.param)])
        self._pending = None
        self._ics_local = self._ics_global = self._ics_ranges = None
        t1 = time.perf_counter()
        self.counters.aggregation_s += t1 - t0
        self.counters.event("ics_wait", t0, t1)

    def step(self, compute_time, closure=None):
        loss = closure() if closure is not None else None
        self.settled = False
        self._finish_ics()
        self._t_compute = compute_time if self._t_compute == 0 else \
            0.8 * self._t_compute + 0.2 * compute_time
        bitmap_now = self._bitmap_of_iteration(compute_time)
        grads = self.buf.pack_grads()
        self._exchange(grads, bitmap_now, self.iteration + 1)
        self.buf.unpack_to_grads()
        self.optimizer.step()
        self.iteration += 1
        self.counters.iterations += 1
        self._report_for_next(grads)
        return loss

    def _report_for_next(self, grads: torch.Tensor) -> None:
        """Step 4 (class doc): the importance report for the next iteration's GIB, in flight
        while the worker computes it."""
        if self.client is None:
            return
        t0 = time.perf_counter()
        self._next_gib = self.client.start_report_importance(
            self.iteration + 1, self._importance(grads), self.buf.layer_sizes, loss=self._loss,
            epoch=self._epoch, u_max=self.u_max)
        self.counters.wait_s += time.perf_counter() - t0

    def _importance(self, grads: torch.Tensor) -> np.ndarray:
        """Eq. 4 per layer, I_l = Σ|g·P| = Σ|g|·|P| over its parameters, of ``grads`` (the
        fusion layout) and the parameters as they are now; one dot product per parameter.

        The dot products run where ``grads`` is (the parameters' device, or a host copy) and
        come back in one transfer: a GPU is waited for once per call, not once per parameter."""
        out = np.zeros(self.n_layers)
        with torch.no_grad():
            dots = [torch.dot(grads[slot.offset:slot.offset + slot.numel].abs(),
                              slot.param.reshape(-1).abs().to(grads.device, grads.dtype))
                    for slot in self.buf.slots]
        # float64 on the host, added in slot order: the same sums as one float() at a time.
        np.add.at(out, self._slot_layer, torch.stack(dots).to("cpu", torch.float64).numpy())
        return out

    def _bitmap_of_iteration(self, compute_time: float) -> np.ndarray:
        """Ask the server (every iteration synchronizes) and get the GIB of this iteration."""
        decision = self.ask(compute_time, self.iteration + 1)
        if not self.is_sync(decision):
            raise RuntimeError(f"policy {self.config.policy}: the server answered {decision!r}; "
                               f"two-stage sync synchronizes every iteration")
        if self.client is None:
            return self.bitmap
        t0 = time.perf_counter()
        k = self.iteration + 1
        in_flight, self._next_gib = self._next_gib, None
        if in_flight is not None and in_flight.iteration == k:
            bitmap_now = in_flight.wait()
        else:
            if in_flight is not None:
                in_flight.wait()   # answered for a round this worker does not run
            importance = (np.zeros(self.n_layers) if self._prev_global is None
                          else self._importance(self._prev_global))
            # A joined worker reports no loss: the epoch's mean loss (Alg. 1) is the trainers'.
            bitmap_now = self.client.report_importance(
                importance, self.buf.layer_sizes, loss=None if self.joined else self._loss,
                epoch=self._epoch, u_max=self.u_max)
        bitmap_now = np.asarray(bitmap_now, dtype=bool)
        t1 = time.perf_counter()
        self.counters.wait_s += t1 - t0
        self.counters.event("wait_server", t0, t1)
        if bitmap_now.shape != (self.n_layers,):
            raise RuntimeError(f"OSP bitmap from the server has shape {bitmap_now.shape}, "
                               f"the model has {self.n_layers} layers")
        return bitmap_now

    def _exchange(self, grads: torch.Tensor, bitmap_now: np.ndarray, k: int) -> list[int]:
        """Routine Sync (blocking, with the header) and the start of In-Computation Sync of
        round ``k``'s bitmap; returns the active workers."""
        t0 = time.perf_counter()
        nbytes = self.buf.nbytes
        contributing = not self.joined
        rs_ranges = self.buf.layer_ranges(~bitmap_now) if bitmap_now.any() else None
        if rs_ranges is None and grads.data_ptr() == self.buf.flat.data_ptr():
            # All Routine Sync: the fusion buffer's wire (gradients + header), no copy.
            payload, rs, header = grads, self.buf.wire, self.buf.header
        else:
            payload = grads if rs_ranges is None else \
                self.buf.gather(grads, rs_ranges) if rs_ranges else grads[:0]
            rs = torch.cat([payload, torch.zeros(self.header_length(), dtype=grads.dtype,
                                              device=grads.device)])
            header = rs[payload.numel():]
        self._fill_header(header, contributing)
        # Routine Sync first, blocking (§3.1)
        timed = payload.numel() > 0 and self.n_workers > 1 and times_rate(k)
        if timed:
            self.backend.barrier("osp rate")   # the wait for the slowest worker ends here
        t_rs = time.perf_counter()
        self.wire.sum_(rs, "routine sync", payload=payload.numel(), divisor=self._divisor)
        if timed:
            self._note_rate(payload.numel() * payload.element_size(),
                            time.perf_counter() - t_rs)
        divisor = self._divisor(header)
        if rs_ranges is None:
            if rs is not self.buf.wire:
                grads.copy_(rs[:payload.numel()])
        elif rs_ranges:
            self.buf.scatter(rs[:payload.numel()], grads, rs_ranges)
        if bitmap_now.any():
            ics_ranges = self.buf.layer_ranges(bitmap_now)
            # In-Computation Sync: in flight until the next step (or synchronize()); the
            # optimizer meanwhile uses the local gradient of these layers (LGP, Eq. 6).
            self._ics_local = self.buf.gather(grads, ics_ranges)
            self._ics_global = self._ics_local.clone()
            self._ics_ranges = ics_ranges
            self._pending = self.wire.start_sum(self._ics_global, "ics",
                                                divisor=lambda _h: divisor)
            self.ics_layers_total += int(bitmap_now.sum())
        # G^g of this iteration (ICS layers: local until their allreduce lands, _finish_ics).
        if self._prev_global is None:
            self._prev_global = grads.clone()
        else:
            self._prev_global.copy_(grads)
        _, active = self._read_header(header)
        self.bitmap = bitmap_now
        self._aggregated(t0, nbytes)
        return active

    def join(self) -> None:
        """Zero gradients into every round the others run, with the server's bitmap of each
        iteration; the model is broadcast afterwards (``synchronize``)."""
        self.joined = True
        try:
            while True:
                self._finish_ics()
                bitmap_now = self._bitmap_of_iteration(0.0)
                self.iteration += 1
                if not self._exchange(self.buf.flat.zero_(), bitmap_now, self.iteration):
                    self._finish_ics()
                    return
        finally:
            self.joined = False

    def close(self) -> None:
        self._finish_ics()
        if self._next_gib is not None:   # no reply may be left to a freed communicator
            self._next_gib.wait()
            self._next_gib = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

