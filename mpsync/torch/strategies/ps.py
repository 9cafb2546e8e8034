"""The parameter-server topology's worker strategies: push the local delta, pull the global
weights under the policy's staleness rule (``ParameterServer``), and ElasticBSP's superstep
(``ElasticSuperstep``).  The common plumbing is :mod:`mpsync.torch.strategies.base`.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from mpsync.server.shard_optimizer import settings_of
from mpsync.server.shard_server import ALL_PUSHES_IN
from mpsync.server.weights import BFLOAT16, copy_checked, subtract_checked
from mpsync.torch.strategies.base import spec_of
from mpsync.torch.strategies.local_steps import LocalStepsThenAggregate

__all__ = ["ParameterServer", "ElasticSuperstep"]


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
_WATCH_EVERY_S = 1.0   # how often a worker in join() asks the shards who is silent


def _stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype the parameter server stores it in (numpy has no bfloat16)."""
    return t if t.dtype in _NUMPY_FLOATS else t.to(torch.float32)


class ParameterServer(LocalStepsThenAggregate):
    """PS topology: the global weights live on the server (rank 0).

    The worker keeps ``_base``, the weights of its last pull; on SYNC it pushes
    Δ = w_local - base (its updates since that pull; the server applies w += Δ on arrival) and
    pulls the current weights, blocking as long as the policy's staleness rule says (SSP, DSSP
    Alg. 1).  Each worker's updates therefore reach the global model exactly once.

    The weights live on the shard servers (``mpsync.server.shards``), in the parameters'
    dtype; push and pull go to every shard at once, and the state server decides when a pull
    may read (its staleness rule over whole-model push counts).  On the wire: that dtype, or
    float16 under ``Compression.fp16`` (any compressor whose output is a float16/32/64 or
    bfloat16 tensor sets the wire dtype; the shards cannot run a compressor's own
    decompress).  A bfloat16 model (a dtype numpy lacks) is stored as float32; where the
    shards span nodes it travels as bfloat16 (``weights.BFLOAT16``, ``bfloat16_wire``): half
    the bytes, nothing the worker keeps is lost on the pull (its parameters are bfloat16),
    and the push's Δ is rounded to bfloat16 as a bfloat16 ring's gradients are.  On one node
    the bytes are copies, which the conversions cost more than they save: float32 there
    (``bench/allreduce/README.md``: 0.53x the float32 exchange's time across nodes at 1 Gbit/s,
    1.5x on one host, 8.7 MB).

    Memory (at most one extra copy of the parameters): ``_base`` is the only one besides the
    fusion buffer (and a float16 wire buffer under compression).  Δ is computed into
    ``_base`` itself and pushed from there: the push returns once every shard has applied
    it, and the pull that follows overwrites ``_base`` with the current weights, so the base
    is not needed between the two.  (With the shards' optimizer the base carries gradients
    only: a one-exchange pull lands in the parameters and is not copied to it.)

    Parameters in host memory, in a dtype the shards store as it is (``_weights``): each
    parameter becomes a view of one flat tensor, so Δ is read from the parameters where the
    optimizer left them and a pull lands in them directly, without the pack and unpack
    copies of the fusion buffer (two passes over the model per push: 1.3 ms each of a
    worker's 26 ms of CPU per iteration, the wide MLP on 4 workers of 2 cores).  The
    parameters stay those objects (``param.data`` is rebound; the optimizer's state and the
    gradients' hooks are kept); one rebound behind its back (``model.to``, a ``.data``
    assignment of the script's) is found at the next push and bound again.

    Parameters on a GPU (``staged``): the base stays on the device beside them, Δ is
    computed there, and each push and pull crosses once, whole, through one pinned host
    buffer (``_base`` is then that buffer: the push's Δ, the pull's weights) instead of
    packing each parameter to the host.  ``staged`` may be forced on host parameters: the
    same steps then run on the CPU (its tests' twin of the GPU path).

    Departure [ps-worker-optimizer]: the papers' server runs the optimizer on the pushed
    gradients (DSSP Alg. 1; MXNet's kvstore), which ``ps_optimizer='server'`` does; this
    strategy (the default, ``'worker'``) runs the script's optimizer on each worker and pushes
    the delta of its step: the same model for SGD under BSP, not for Adam-like optimizers nor,
    for any optimizer with state, under ASP, SSP and DSSP.
    """

    staged: bool | None = None   # None: where the parameters are off the CPU (class doc)
    bfloat16_wire: bool | None = None   # None: where the shards span nodes (class doc)

    def __init__(self, *args, worker_rank: int = 0, **kw):
        super().__init__(*args, **kw)
        if len(self.buffers) != 1:
            raise ValueError("topology='ps' needs all parameters in one dtype, got "
                             f"{[str(b.dtype) for b in self.buffers]}")
        self.buf = self.buffers[0]
        self.worker_rank = worker_rank
        self._base: np.ndarray | None = None  # the store's dtype (_stored)
        if self.staged is None:
            self.staged = self.buf.device.type != "cpu"
        self._base_dev: torch.Tensor | None = None   # staged: the base, on the device
        self._host: torch.Tensor | None = None       # staged: ``_base``'s pinned tensor
        self._recv: np.ndarray | None = None         # staged: a one-exchange pull lands here
        self._weights: torch.Tensor | None = None    # host: the parameters' storage (doc)
        self.version = 0
        # ps_optimizer='server': push gradients; the shards run the optimizer (_server_update)
        self.server_optimizer = getattr(self.config, "ps_optimizer", "worker") == "server"
        self._fresh_gradient = False
        self._sent_settings: np.ndarray | None = None
        self._shards_state: dict | None = None   # a checkpoint's, for the shards at start
        # A pull no server rule holds (ASP): push and pull in one exchange per shard, the
        # push counted meanwhile; one the server is sure to grant (SSP, DSSP while their
        # bound cannot bind): the same, the push counted once every shard applied it.  Not
        # under auto (``code``): around a switch another worker may still run a policy whose
        # pulls wait for this worker's counts, and a switch starts the counts again.
        self._shards_direct = getattr(self.client, "shards", None) is not None
        self._one_exchange = spec_of(self.config).ps_pull_ungated and self._shards_direct

    @classmethod
    def from_config(cls, config, *args, worker_rank: int = 0):
        return cls(*args, config, worker_rank=worker_rank)

    def _start(self) -> None:
        if self._base is not None:
            return
        self._take_base()
        shards = getattr(self.client, "shards", None)
        if shards is not None:
            shards.layout(self._base.size)   # every worker: too many shards fails here
            shards.wire = self._wire_dtype()
            two_sided = shards.open_window(self._base.dtype)   # collective
            if self.worker_rank == 0:
                how = ("one-sided (each gradient copied into the shards' shared memory and "
                       "the weights out of it; the shards step on the gradients written since "
                       "their last step)" if self.server_optimizer else
                       "one-sided (each delta added into the shards' shared memory under their "
                       "locks, the weights copied out as it is added)")
                print("mpsync: PS pushes and pulls " +
                      (how if two_sided is None else f"as messages ({two_sided})"),
                      file=sys.stderr, flush=True)
        if self.worker_rank == 0:
            if self._shards_state is not None:
                # Before the weights: every other worker pushes only after ps_init.
                shards.restore_optimizer(self._shards_state)
                self._shards_state = None
            self.client.ps_init(self._base)
        self._pull()
        # No worker pushes before every worker has pulled the starting weights.  The state
        # server orders each round's pushes after the round before's pulls, but a first pull
        # has no round before it: a worker that starts late would read weights that already
        # hold a faster worker's first push, and start from another model than the others
        # (BSP then no longer equals single-process training; ElasticBSP's first superstep
        # and ESync's first round would not start from one model, ZipLine §6.2.5, ESync
        # Alg. 1).  Bounded like the broadcasts that start a run: at start-up ranks may
        # drift apart by more than the per-step deadline.
        self.backend.barrier("every worker pulled the starting weights",
                             deadline=max(self.config.deadline, self.config.startup_timeout))

    def adopt_replicas(self) -> None:
        """Start from the weights every worker holds (``auto`` switching from the ring after
        a round every worker took part in, so they are bitwise equal): worker 0 loads them
        onto the shards, and every worker waits for that before its first push (a push must
        not reach a shard before the weights it applies to).  Nothing is pulled: the shards
        now hold exactly what each worker holds."""
        self._take_base()
        shards = self.client.shards
        shards.layout(self._base.size)
        shards.wire = self._wire_dtype()
        if self.worker_rank == 0:
            self.client.ps_init(self._base, replace=True)
        # A liveness check is a message: every shard hears from this worker now, not from
        # before the ring ran (others' waits would take it for silent).
        shards.silent_workers()
        self.backend.barrier("the parameter server loaded at a switch from the ring")
        self.version = 0

    def _take_base(self) -> None:
        """The base (and, staged, the host buffer) from the parameters as they are now."""
        if not self.staged and self.buf.dtype in _NUMPY_FLOATS and all(
                p.is_contiguous() for p in self.buf.params):
            self._weights = self._bind_params()
            self._base = self._weights.numpy().copy()
            return
        params = _stored(self.buf.pack_params())
        if not self.staged:
            self._base = params.numpy().copy()
            return
        self._base_dev = params.clone()
        pin = torch.cuda.is_available()
        self._host = torch.empty(params.numel(), dtype=params.dtype, pin_memory=pin)
        self._host.copy_(params)
        self._base = self._host.numpy()
        self._recv = torch.empty_like(self._host, pin_memory=pin).numpy()

    def _bind_params(self) -> torch.Tensor:
        """One flat tensor holding the parameters' values, each parameter rebound to its view
        of it (class doc), laid out as the fusion buffer."""
        weights = torch.empty(self.buf.numel, dtype=self.buf.dtype)
        with torch.no_grad():
            for param, view in zip(self.buf.params, self.buf.views(weights)):
                view.copy_(param)
                param.data = view
        self._bound_views = [(param, view.data_ptr()) for param, view in
                             zip(self.buf.params, self.buf.views(weights))]
        return weights

    def _params_bound(self) -> bool:
        """The parameters are still the views of ``_weights`` (class doc); rebound if one
        was moved (its values kept: Δ is then read from them as they are)."""
        if self._weights is None:
            return False
        if any(p.data_ptr() != ptr for p, ptr in self._bound_views):
            if not all(p.is_contiguous() and p.dtype == self.buf.dtype
                       and p.device == self._weights.device for p in self.buf.params):
                self._weights = None     # no longer a host model of one dtype: copies again
                return False
            self._weights = self._bind_params()
        return True

    def _land(self, weights: np.ndarray) -> None:
        """Pulled ``weights`` (host) into the parameters: straight in where they are views
        of ``_weights``, else through the fusion buffer (staged: into the base on the
        device, one host-to-device copy).  Blocking: the host buffer is written again by the
        next pull or push."""
        if self._params_bound():
            if weights.ctypes.data != self._weights.data_ptr():
                self._weights.copy_(torch.from_numpy(weights))
            return
        if not self.staged:
            self.buf.flat.copy_(torch.from_numpy(weights))
        else:
            self._base_dev.copy_(torch.from_numpy(weights))
            self.buf.flat.copy_(self._base_dev)
        self.buf.unpack_to_params()

    def _pull(self, final: bool = False, all_in: bool = False) -> None:
        """``all_in``: every worker's pushes are in (no round is still being merged)."""
        t0 = time.perf_counter()
        self.version = self.client.pull(self._base, self.iteration, final=final,
                                        barrier=ALL_PUSHES_IN if all_in else 0)
        self._land(self._base)
        self.counters.aggregation_s += time.perf_counter() - t0

    _prepare = _start

    def header_length(self) -> int:
        return 0   # the join ends on a barrier of the workers, not on a header

    def _count_wire(self, nbytes: int) -> None:
        # The bytes themselves are counted by the shard client, message by message; the
        # least a push and a pull of the model can move is the model each way.
        self.counters.data_min += int(2 * nbytes * self._wire_ratio())

    def _idle_ready(self) -> bool:
        return self._base is not None

    def pull_global(self) -> int:
        """Pull the current global weights into the model now and return their version.

        For a checkpoint: the caller makes sure every worker's pushes so far are in (and that
        none pushes before this returns), so the pulled weights are the global model at that
        cut.  The pull skips the staleness rule (the ``final`` flag): with every push in, no
        rule has anything left to wait for, and a checkpoint must not depend on one."""
        self._start()
        self._pull(final=True, all_in=True)
        return self.version

    def server_optimizer_state(self) -> dict | None:
        """ps_optimizer='server': the shards' optimizer state over the whole model (kind,
        steps, moments), for a checkpoint taken right after :meth:`pull_global` (every push
        in); None where the workers run the optimizer or nothing was pushed yet."""
        if not self.server_optimizer or self.client.shards is None:
            return None
        self._start()
        return self.client.shards.optimizer_state(self._base.dtype)

    def restore_server_optimizer(self, state: dict) -> None:
        """Continue the shards' optimizer from a checkpoint's :meth:`server_optimizer_state`
        (worker 0, before the first step; the shards get it with the initial weights)."""
        if not self.server_optimizer:
            raise ValueError("a server-side optimizer state to restore, but this run has "
                             "ps_optimizer='worker'")
        kind = settings_of(type(self.optimizer).__name__, self.optimizer.param_groups).kind
        if state["kind"] != kind:
            raise ValueError(f"the checkpoint's server-side optimizer is {state['kind']}, this "
                             f"run's is {kind}: resume with the optimizer it was written with")
        if self._base is not None:
            raise RuntimeError("restore_server_optimizer after the first step")
        self._shards_state = state

    def _wire_dtype(self):
        """The dtype pushes and pulls travel in: what the optimizer's compressor makes of
        the store's dtype; without one, the parameters' own (None: the store's; bfloat16,
        whose store is float32: ``BFLOAT16`` where ``bfloat16_wire``, class doc)."""
        compression = self.wire.compression if self.wire is not None else None
        stored = _stored(self.buf.flat).dtype
        across = self.bfloat16_wire
        if across is None:
            across = getattr(getattr(self.client, "shards", None), "nodes", 1) > 1
        own = BFLOAT16 if self.buf.flat.dtype == torch.bfloat16 and across else None
        if compression is None:
            return own
        probe, _ = compression.compress(torch.zeros(1, dtype=stored))
        if probe.dtype == stored:
            return own
        if probe.dtype == torch.bfloat16:
            return BFLOAT16
        if probe.dtype not in _NUMPY_FLOATS:
            raise ValueError(f"compression {compression!r} sends {probe.dtype} on "
                             f"topology='ps'; the shard servers take float16, bfloat16, "
                             f"float32 or float64 (use Compression.fp16 or Compression.none)")
        return probe.numpy().dtype

    def _wire_ratio(self) -> float:
        """Bytes on the wire per byte of the store (``_base``): 0.5 for a float16 wire of a
        float32 model, or a bfloat16 model's wire (its store is float32)."""
        if getattr(self, "_ratio", None) is None:
            wire = self._wire_dtype()
            stored = torch.zeros(0, dtype=_stored(self.buf.flat).dtype).element_size()
            self._ratio = 1.0 if wire is None else np.dtype(wire).itemsize / stored
        return self._ratio

    def _local_update(self) -> None:
        if self.server_optimizer:
            self._fresh_gradient = True     # pushed as it is; the shards step on it
        else:
            self.optimizer.step()

    def _delta_into_base(self, into_slots: bool = False) -> np.ndarray:
        """Δ = w_local - base, written over ``_base``, in the store's dtype (with the server's
        optimizer: the gradient, :meth:`_gradient_into_base`).  ``_delta_finite``: every value
        of Δ was found finite in the pass that computed it (the push need not read it again:
        ``ShardClient.checked_push``).  ``into_slots``: the gradient may go straight into the
        inbox's slots instead (``_in_slots`` says whether it did)."""
        self._delta_finite = self._in_slots = False
        if self.server_optimizer:
            return self._gradient_into_base(into_slots)
        if self.staged:   # on the device, then one copy to the host
            self._host.copy_(torch.sub(_stored(self.buf.pack_params()), self._base_dev))
            return self._base
        local = self._weights if self._params_bound() else _stored(self.buf.pack_params())
        self._delta_finite = subtract_checked(local.numpy(), self._base)
        return self._base

    def _gradient_into_base(self, into_slots: bool = False) -> np.ndarray:
        """ps_optimizer='server': this iteration's gradient, written over ``_base``, after the
        optimizer's settings if they changed (the first push, a learning-rate schedule); empty
        when no gradient is new since the last push (the last push of ``join``), which the
        shards then have nothing of to apply.  ``into_slots``: where the shards have an inbox
        in shared memory, written straight into this worker's next slots instead
        (:meth:`_grads_into_slots`); ``_base`` then only gives the push its size."""
        if not self._fresh_gradient:
            return self._base[:0]
        self._fresh_gradient = False
        settings = settings_of(type(self.optimizer).__name__,
                               self.optimizer.param_groups).to_array()
        if self._sent_settings is None or not np.array_equal(settings, self._sent_settings):
            self.client.shards.configure(settings)
            self._sent_settings = settings
        flat = self.buf.flat
        if into_slots and not self.staged and self._grads_into_slots():
            self._in_slots = True
        elif self.staged:
            self._host.copy_(_stored(self.buf.pack_grads()))
        elif flat.dtype in _NUMPY_FLOATS:
            self._delta_finite = self._pack_grads_checked()
        else:
            np.copyto(self._base, _stored(self.buf.pack_grads(torch.empty_like(flat))).numpy())
        return self._base

    def _grads_into_slots(self) -> bool:
        """Every gradient straight into this worker's next slot on each shard (its range of
        the flat layout), checked as it is copied (:meth:`_grads_into`): one pass over the
        gradients, where a copy into ``_base`` and then into the slots made two.  False, with
        nothing written, where the shards have no such inbox (the caller packs into
        ``_base``); a value not finite raises, and the slots are not posted."""
        shards = self.client.shards
        targets = None if shards is None or self.buf.flat.dtype not in _NUMPY_FLOATS \
            else shards.next_slots()
        if targets is None:
            return False
        if not self._grads_into(targets):   # (the next push writes the slots again)
            raise FloatingPointError("push with NaN or inf: the local model diverged (no "
                                     "shard was sent any of it)")
        self._delta_finite = True
        return True

    def _pack_grads_checked(self) -> bool:
        """Every gradient into its range of ``_base``, and whether all are finite, in the
        pass that copies them (:meth:`_grads_into`): the push need not read them again."""
        return self._grads_into([(0, self._base.size, self._base)])

    def _grads_into(self, targets) -> bool:
        """Every gradient into its range of the flat layout, cut over ``targets`` (``(a, b,
        array)``: the layout's elements [a, b) go into ``array``), a missing one as zeros (as
        ``FusionBuffer.pack_grads``), and whether all are finite, found in the pass that
        copies them (``weights.copy_checked``).  A sparse or strided gradient, or one on
        another device or of another dtype, is made a contiguous host array first."""
        finite, dtype = True, torch.from_numpy(targets[0][2][:0]).dtype
        for slot in self.buf.slots:
            start, end, grad = slot.offset, slot.offset + slot.numel, slot.param.grad
            if grad is not None:
                grad = grad.detach()
                if not (grad.layout == torch.strided and grad.is_contiguous()
                        and grad.device.type == "cpu" and grad.dtype == dtype):
                    grad = (grad.to_dense() if grad.is_sparse else grad).to(
                        "cpu", dtype).contiguous()
                grad = grad.view(-1).numpy()
            for a, b, into in targets:
                lo, hi = max(a, start), min(b, end)
                if lo >= hi:
                    continue
                if grad is None:
                    into[lo - a:hi - a] = 0
                else:
                    finite = copy_checked(grad[lo - start:hi - start], into[lo - a:hi - a]) \
                        and finite
        return finite

    def _push_pull(self, barrier: int = 0) -> None:
        """Push Δ since the last pull, pull the current weights (as the policy allows;
        ``barrier`` > 0: the weights of that barrier, ``ShardClient.pull``).  Where the
        server never holds a pull (ASP), or is sure to grant this one (SSP and DSSP while
        their bound cannot bind: ``SyncClient.pull_is_sure``), both are one exchange
        (``SyncClient.push_pull``), its weights received straight into the parameters (or
        the fusion buffer) and copied to the base; else, sharded, the push is counted and
        the pull granted in one exchange with the state server
        (``SyncClient.push_then_pull``)."""
        direct = not barrier and self._shards_direct and not self.code
        flat, delta = self.buf.flat, self._delta_into_base(into_slots=direct)
        finite, in_slots = self._delta_finite, self._in_slots
        one = (not barrier and self._shards_direct and not self.code and delta.size
               and flat.dtype in _NUMPY_FLOATS)
        gated = one and not self._one_exchange
        if one and (not gated or self.client.pull_is_sure()):
            if self.staged:   # Δ is being sent from the host buffer: the weights land apart
                self.version = self.client.push_pull(delta, self._recv, self.iteration,
                                                     gated=gated)
                self._land(self._recv)
                return self._delay()
            # Δ was read from the parameters (``_delta_into_base``), so the pull may land in
            # them while the push is on its way.
            bound = self._params_bound()
            into = (self._weights if bound else flat).numpy()
            self.version = self.client.push_pull(delta, into, self.iteration, gated=gated,
                                                 finite=finite, in_slots=in_slots)
            if not self.server_optimizer:   # the shards' optimizer: the base holds gradients
                np.copyto(self._base, into)
            if not bound:
                self.buf.unpack_to_params()
        elif barrier or self.client.shards is None:
            self.client.push(delta, self.iteration, finite=finite)
            self.version = self.client.pull(self._base, self.iteration, barrier=barrier)
            self._land(self._base)
        else:   # a pull the bound may hold: push, the grant, the pull in three round trips
            self.version = self.client.push_then_pull(delta, self._base, self.iteration,
                                                      finite=finite, in_slots=in_slots)
            self._land(self._base)
        self._delay()

    def _delay(self) -> None:
        if self.config.comm_delay > 0:
            # Emulated network latency of the push+pull (the ring applies it in EmulatedLink):
            # inside the aggregation's time, so it is booked as aggregation, not compute.
            time.sleep(self.config.comm_delay)

    def _aggregate(self) -> None:
        t0 = time.perf_counter()
        self._push_pull()
        self.reset(self._aggregated(t0, self._base.nbytes))

    def join(self) -> None:
        """Push what is left as this worker's last update (staleness rules stop counting it),
        then wait for a non-blocking barrier of all workers (every worker has joined).

        Meanwhile it keeps the server informed without taking steps (which the server would
        count as iterations): a reset at its pace, which also completes an ElasticBSP
        barrier that would otherwise wait for it.  Under a policy whose rounds are decided
        from every worker's reports (ESync's QUERY-STATE: a READY waits for every worker's
        pull of the last round) it reports idle iterations instead and, on SYNC, pushes and
        pulls like the others: its first such push carries what is left of its own update,
        inside a round like every other (ESync Alg. 1: every replica restarts each round from
        the same w_{t+1}; a push outside the rounds would reach some workers' pulls of a round
        and not others').

        The wait has the run's deadline in the only form that fits a wait for workers that
        may still be training: every ``_WATCH_EVERY_S`` it asks the shards whom they have
        not heard from for longer than the deadline (a worker that trains pushes to every
        shard; one that joined asks too), and names them in a :class:`DeadlineExceeded`.
        Under SSP a stopped worker is taken out and the others train on, so without this
        they would wait here for it for ever."""
        if self.peers is None:
            raise RuntimeError("ParameterServer.join needs the workers' communicator (peers)")
        self._start()
        self.joined = True
        pace = self._pace()
        reports = spec_of(self.config).fast_path == "query_state"
        shards = getattr(self.client, "shards", None)
        if not reports:
            self.client.push(self._delta_into_base(), self.iteration, final=True)
            self._pull(final=True)
        everyone = self.peers.comm.Ibarrier()
        watch_at = time.monotonic() + _WATCH_EVERY_S
        try:
            while not everyone.Test():
                if reports:
                    self.iteration += 1
                    if self.is_sync(self.ask(self._usual_compute(), self.iteration)):
                        self._aggregate()
                else:
                    self.reset(0.0)
                if shards is not None and time.monotonic() > watch_at:
                    shards.check_workers(f"worker {self.worker_rank} waiting in join() for "
                                         f"the others")
                    watch_at = time.monotonic() + _WATCH_EVERY_S
                _rest(pace, getattr(self.backend, "while_waiting", None))
            self.reset(0.0)
        finally:
            self.joined = False

    def synchronize(self) -> None:
        """Join, push what is left, wait until every worker has pushed, pull the final
        weights."""
        self.join()
        self.settle_joined()

    def settle_joined(self) -> None:
        """The end of :meth:`synchronize` after the join: the last push, the wait until
        every worker's is in, the final pull.  (``auto`` calls it alone when a switch from
        the ring reached this worker inside its join there: that join was the PS's.)"""
        t0 = time.perf_counter()
        self.client.push(self._delta_into_base(), self.iteration, final=True)
        self.backend.barrier("final push")
        self._pull(final=True, all_in=True)  # every push is in: no staleness rule to wait for
        self._broadcast_model()
        self._aggregated(t0, self._base.nbytes)
        self.settled = True


def _rest(seconds: float, answer) -> None:
    """Sleep ``seconds``; under ``hvd.join()`` (``answer`` set) answer the script's
    collectives meanwhile, as a joined worker on the ring does inside its aggregations: the
    others may call one while this worker waits here for their last pushes."""
    if answer is None:
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds
    while True:
        answer()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 1e-3))


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
        self.settled = False
        self._local_update()
        self.iteration += 1
        self.local_steps += 1
        self.counters.iterations += 1
        barrier = self.is_sync(self.ask(compute_time, self.iteration))
        t0 = time.perf_counter()
        # Every worker at a barrier has passed the same barriers before it (each barrier is
        # every running worker's), so round + 1 names this barrier alike on all of them.
        self._push_pull(barrier=self.round + 1 if barrier else 0)
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
            self._count_wire(self._base.nbytes)
            self.counters.event("aggregate", t0, t1)
        return loss
