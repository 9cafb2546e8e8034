"""``DistributedOptimizer``: wraps a torch optimizer; its ``step()`` runs the policy.

It is a ``torch.optim.Optimizer`` that *shares* ``param_groups`` and ``state`` with the wrapped
optimizer (so learning-rate schedulers and ``isinstance`` checks work) and delegates the update
itself; no class is created at run time (Horovod builds a dynamic subclass of the wrapped
optimizer's class, which breaks under further subclassing).

Per-iteration compute time, reported to the state server, is the time since the previous
``step()`` returned: forward, backward, data loading and any emulated slowdown.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
import weakref

import torch

from mpsync.torch._moves import start_allreduce, sum_half_
from mpsync.torch.dataplane.compression import WireSum
from mpsync.torch.dataplane.fusion import group_by_dtype
from mpsync.torch.dataplane.staging import stage_if_needed
from mpsync.torch.strategies import GradientAveraging, Strategy, make_strategy

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(torch.optim.Optimizer):
    """``mps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())``.

    ``step()`` does what the policy says for this iteration (gradient averaging, a local step,
    a delta aggregation, a push/pull, OSP's two-stage sync).

    Horovod's keywords:

    * ``compression``: ``Compression.none`` / ``Compression.fp16`` on the ring's aggregations
      (gradients, model deltas, OSP's syncs) and on the parameter server's pushes and pulls
      (float16 on the wire, the shards keep the model's dtype).
    * ``op``: ``Average`` (default) or ``Sum`` of the gradients (bsp, osp); the model-delta
      policies (esync, ebsp) and the parameter server average by definition and refuse Sum;
      Adasum is refused.
    * ``gradient_predivide_factor``: scale by 1/f before the sum and f/size after (op=Average
      only, as Horovod); refused on the parameter server.
    * ``backward_passes_per_step=k``: gradients of k backward passes accumulate locally and
      ``step()`` follows the k-th; one ``step()`` is one iteration of the policy (one report
      to the server), so a policy's own local steps count these accumulated steps.  More
      than k passes before ``step()`` is an error, as in Horovod.
    * ``sparse_as_dense``: sparse gradients are made dense before the aggregation (without
      it a sparse gradient is refused with this advice).

    ``report_loss(loss, epoch=None)``: this iteration's training loss, before ``step()``
    (mpsync's own API, not Horovod's).  ``policy="auto"`` watches it, and leaves a policy it
    switched to that undoes the run's progress (the parameter server's full updates can
    diverge at a learning rate the ring converges at); OSP schedules its syncs by the loss and
    the epoch.  A script that never calls it trains the same, without that watch.

    ``probe_gradient_noise(closure)``: after backward, before ``step()`` (mpsync's own API):
    under ``policy="auto"``, about once a second, runs ``closure`` (another batch's forward
    and ``backward()`` at the same weights) to measure the job's gradient noise scale, which
    tells auto how much the parameter server's full updates gain over the ring's average
    (``mpsync.auto.noise``); this step's gradients are put back and the closure's batch is not
    trained on.  Where the closure returns its loss and the optimizer is SGD, it runs once
    more on the same batch at the weights n of this worker's steps ahead (the step test,
    ``mpsync.auto.curvature``: may the parameter server's full updates gain more than the
    fitted constant?); the weights are restored exactly.  Returns whether it ran the closure.
    Without it auto ranks with its fitted constant.

    ``synchronize()``: right after backward (gradients not yet stepped on: Horovod's gradient
    clipping idiom) it makes the gradients final: under BSP it averages them now and the
    ``step()`` inside ``skip_synchronize()`` does not average again; local-step policies step
    on local gradients, so there is nothing to do.  After ``step()`` (the end of training or
    of an epoch) it joins the others and ends with every worker holding the same model, even
    when workers took different numbers of steps (see ``strategies``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, *,
                 compression=None, backward_passes_per_step: int = 1, op=None,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 num_groups: int = 0, groups=None, process_set=None, _context=None):
        # Deliberately not calling Optimizer.__init__: the wrapped optimizer owns the groups.
        from mpsync.torch import _runtime

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        _check_passes(backward_passes_per_step)
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        named = name_parameters(optimizer, named_parameters)
        # Horovod's attribute: some scripts and tools read the names from it.
        self._parameter_names = {p: n for n, p in named}
        self._synchronized = False
        self.backward_passes_per_step = backward_passes_per_step
        self.sparse_as_dense = bool(sparse_as_dense)
        self._passes = 0               # backward passes since the last step()
        self._counted: set[int] = set()
        self._model_in_sync = False
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self._count_pass))
                       for _, p in named if p.requires_grad]
        self._last_step_end = time.perf_counter()
        self._epoch = 1                # the last epoch report_loss was told (1-based)
        self._strategy: Strategy | None = None
        self._leader = None  # the DistributedOptimizer whose rounds this one follows
        self._sparse_only = isinstance(optimizer, torch.optim.SparseAdam)
        self._set_ops = None  # a process set's collectives, when it aggregates over one
        self._coordinator = None  # member 0's negotiation of the script's collectives
        # Horovod lets a script build its optimizer before init(): the policy's strategy is
        # then made at the first use (every worker gets there in the same order).
        self._pending = dict(named=named, compression=compression, op=op,
                             predivide=gradient_predivide_factor, process_set=process_set,
                             internal=_context is not None)
        if _context is not None or _runtime.is_initialized():
            self._attach(_context if _context is not None
                         else _runtime.worker_context("DistributedOptimizer"))

    def _attach(self, ctx) -> None:
        from mpsync.torch.mpi_ops import Average, Sum
        from mpsync.torch.process_sets import is_whole_world

        args, self._pending = self._pending, None
        set_ops = None if is_whole_world(args["process_set"]) else \
            _set_ops(ctx, args["process_set"])
        op = _check_horovod_keywords(ctx.config, args["compression"],
                                     self.backward_passes_per_step, args["op"],
                                     args["predivide"])
        if set_ops is _OUTSIDE:
            # Horovod: an optimizer over a set this worker is not in registers no hooks and
            # steps on the local gradients.
            self._counters = ctx.counters
            self._strategy = _OutsideSet(self.optimizer)
            return
        self._buffers = group_by_dtype(args["named"])
        self._counters = ctx.counters
        backend = ctx.data_backend or ctx.backend
        if backend is not None:
            # Buffers on a GPU over a transport of host memory: pinned mirrors per bucket
            # (dataplane.staging); on the CPU the aggregator itself, nothing in between.
            backend = stage_if_needed(backend, self._buffers[0].device,
                                      cuda_aware_mpi=ctx.cuda_aware_mpi,
                                      horovod_nccl=_horovod_nccl(ctx))
        client, rank = ctx.client, ctx.worker_rank
        if set_ops is not None:
            backend, client, rank = set_ops.aggregator, None, set_ops.rank
        self._set_ops = set_ops
        self._coordinator = getattr(ctx.user_ops, "coordinator", None) if set_ops is None \
            else None
        self._strategy = make_strategy(
            ctx.config, self.optimizer, self._buffers, backend, client, ctx.counters,
            worker_rank=rank)
        if op != Average and not self._strategy.aggregates_gradients:
            raise ValueError(f"op=Sum has no meaning under policy={ctx.config.policy!r} on "
                             f"topology={ctx.config.topology!r}: it aggregates model updates, "
                             f"which are averaged by definition; use op=Average")
        if set_ops is None:
            self._follow_leader(ctx)
        peers = None if args["internal"] else (set_ops or ctx.peers)
        self._strategy.peers = peers
        self._strategy.op_sum = op == Sum
        self._sparse_ops = peers if peers is not None else ctx.user_ops
        if self._sparse_only and self._strategy.aggregates_gradients:
            # Backward adds a sparse gradient to an existing dense one densely: keep the
            # gradients out of the fusion buffer so SparseAdam's stay sparse.
            for buf in self._buffers:
                buf.grads_bound = False
            for _, p in args["named"]:
                p.grad = None
        if backend is not None:
            f = args["predivide"]
            mpi_peers = peers is not None and ctx.config.backend == "mpi"
            self._strategy.wire = WireSum(
                backend, args["compression"], prescale=1.0 / f, postscale=f,
                half_sum=functools.partial(sum_half_, peers) if mpi_peers else None)
        if ctx.config.overlap and self._leader is None and not self._sparse_only and \
                isinstance(self._strategy, GradientAveraging):
            self._strategy.start_buckets(int(ctx.config.bucket_mb * 2**20),
                                         self._last_pass_of_step)
        ctx.optimizers.append(self, hold=self._strategy.client is not None)

    def _last_pass_of_step(self) -> bool:
        # Asked at a backward pass's first gradient, after _count_pass counted that pass.
        return self._passes == self.backward_passes_per_step

    def _follow_leader(self, ctx) -> None:
        """A second optimizer in the process follows the first one's rounds (``followers``)."""
        from mpsync.torch.strategies import DeltaAveraging

        if self._sparse_only and self._strategy.aggregates_gradients:
            return  # steps through the sparse allreduce, never through the strategy
        leaders = [o for o in ctx.optimizers.live()
                   if o._strategy is not None and o._strategy.leader is None and
                   o._set_ops is None and
                   not (o._sparse_only and o._strategy.aggregates_gradients)]
        if not leaders:
            return
        kinds = (GradientAveraging, DeltaAveraging)
        if not (isinstance(leaders[0]._strategy, kinds) and isinstance(self._strategy, kinds)):
            raise ValueError(f"a second DistributedOptimizer under policy="
                             f"{ctx.config.policy!r} on topology={ctx.config.topology!r}: its "
                             f"server keeps one model per worker; wrap every parameter in one "
                             f"optimizer (param groups) instead")
        # Two optimizers' buckets started from hooks of one backward could interleave in a
        # different order on different workers: a leader with followers averages at step().
        if isinstance(leaders[0]._strategy, GradientAveraging):
            leaders[0]._strategy.stop_buckets()
        self._strategy.follow(leaders[0]._strategy)
        self._leader = leaders[0]

    def _ready(self) -> Strategy:
        if self._strategy is None:
            from mpsync.torch import _runtime

            self._attach(_runtime.worker_context("DistributedOptimizer"))
        return self._strategy

    # The wrapped optimizer's own objects, read through (its load_state_dict replaces them).
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    @property
    def strategy(self) -> Strategy:
        return self._ready()

    def _count_pass(self, param) -> None:
        # A parameter seen again means a new backward pass has started.
        if id(param) in self._counted or not self._counted:
            self._counted = {id(param)}
            self._passes += 1
        else:
            self._counted.add(id(param))

    def set_backward_passes_per_step(self, passes: int) -> None:
        _check_passes(passes)
        self.backward_passes_per_step = passes

    def step(self, closure=None):
        if self._passes > self.backward_passes_per_step:
            passes, self._passes, self._counted = self._passes, 0, set()
            if self._strategy is not None:
                self._strategy.drain()
            raise RuntimeError(f"gradients were computed {passes} times before step(), more "
                               f"than backward_passes_per_step={self.backward_passes_per_step}; "
                               f"increase backward_passes_per_step to accumulate gradients "
                               f"locally")
        strategy = self._ready()
        if self._synchronized and not strategy.skip_aggregation:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "context after optimizer.synchronize(). This can cause training "
                          "slowdown. You may want to consider using "
                          "optimizer.skip_synchronize() context if you use "
                          "optimizer.synchronize() in your code.")
        self._synchronized = False
        self._densify()
        now = time.perf_counter()
        compute_time = now - self._last_step_end
        self._counters.compute_s += compute_time
        self._counters.event("compute", self._last_step_end, now)
        result = self._step_sparse(compute_time, closure) if self._all_sparse() \
            else strategy.step(compute_time, closure)
        self._passes, self._counted = 0, set()
        self._model_in_sync = False
        if self._coordinator is not None:
            # Member 0 reads the others' requests at every step (1.2 us with none waiting), not
            # only inside a collective of its own: join() names the worker that joined last as
            # member 0 read the joins, so they must be read about when they are made.
            self._coordinator.step()
        if self._leader is not None:
            # The final join runs through the leader: it has something to finish now.
            self._leader._model_in_sync = False
            self._leader.strategy.settled = False
        self._last_step_end = time.perf_counter()
        return result

    def _densify(self) -> None:
        """``sparse_as_dense``: sparse gradients become dense before the aggregation.  Without
        it they stay sparse: local-step policies step on them as they are; gradient
        averaging (:meth:`_step_sparse`) takes an optimizer whose gradients are all sparse
        (``nn.Embedding(sparse=True)`` with ``SparseAdam``, as in Horovod's examples)."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not any(g.is_sparse for g in grads):
            return
        if self.sparse_as_dense and not self._sparse_only:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and p.grad.is_sparse:
                        p.grad = p.grad.to_dense()
        elif self.strategy.aggregates_gradients and not all(g.is_sparse for g in grads):
            raise ValueError("an optimizer with both sparse and dense gradients under gradient "
                             "averaging: pass sparse_as_dense=True, or wrap the sparse "
                             "parameters (nn.Embedding(sparse=True)) in an optimizer of their "
                             "own (SparseAdam)")

    def _all_sparse(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return bool(grads) and self.strategy.aggregates_gradients and \
            all(g.is_sparse for g in grads)

    def _step_sparse(self, compute_time: float, closure):
        """Horovod's sparse allreduce: each sparse gradient's indices and values are
        allgathered (averaged for op=Average) and stay sparse; then the wrapped optimizer
        steps.  Every worker's step takes part (the policy aggregates every step)."""
        from mpsync.torch.mpi_ops import Average, Sum, start_sparse_allreduce

        loss = closure() if closure is not None else None
        strategy = self.strategy
        op = Sum if strategy.op_sum else Average
        if not strategy.skip_aggregation:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if self.sparse_as_dense:  # Horovod: a dense allreduce, sparse again
                        dense = start_allreduce(self._sparse_ops, p.grad.to_dense(), op, 1.0,
                                                1.0, None, None).wait()
                        p.grad = dense.to_sparse()
                    else:
                        p.grad = start_sparse_allreduce(self._sparse_ops, p.grad, op,
                                                        None).wait()
        self.optimizer.step()
        strategy.iteration += 1
        self._counters.iterations += 1
        return loss

    def probe_gradient_noise(self, closure) -> bool:
        """See the class doc: True if ``closure`` ran (a probe was due under ``auto``)."""
        probe = getattr(self._ready(), "probe_noise", None)
        if probe is None:
            return False
        # The closure's backward is no pass of this step's (backward_passes_per_step).
        passes, counted = self._passes, set(self._counted)
        try:
            return probe(closure)
        finally:
            self._passes, self._counted = passes, counted

    def report_loss(self, loss, epoch: int | None = None) -> None:
        """This iteration's training loss (a number or a one-element tensor) and, if given,
        its 1-based epoch (kept for later calls), before ``step()`` (class doc)."""
        if torch.is_tensor(loss):
            if loss.numel() != 1:
                raise ValueError(f"report_loss: the loss must be one number, got a tensor of "
                                 f"shape {tuple(loss.shape)}")
            loss = loss.detach().item()
        if epoch is not None:
            if int(epoch) < 1:
                raise ValueError(f"report_loss: epoch is 1-based, got {epoch}")
            self._epoch = int(epoch)
        self._ready().note_progress(self._epoch, float(loss))

    def exclude_from_compute(self, seconds: float) -> None:
        """``seconds`` the training loop spent since the last step on something other than
        this step's work (an evaluation, a checkpoint): not counted as the next step's compute,
        which the state server reads as this worker's speed."""
        self._last_step_end += max(0.0, seconds)

    def synchronize(self) -> None:
        """See the class doc: gradients before ``step()``, the model after it."""
        if self._passes > 0:
            self._densify()
            self._ready().synchronize_gradients()
            self._synchronized = True
        else:
            self.synchronize_model()
        self._last_step_end = time.perf_counter()

    def synchronize_model(self) -> None:
        """Join the others and end with every worker holding the same model (all workers call
        it: ``synchronize()`` after ``step()``, ``mps.join()``, ``mps.shutdown()``)."""
        if not self._model_in_sync and not (self._sparse_only and
                                            self.strategy.aggregates_gradients):
            # (A sparse optimizer under gradient averaging steps on identical averaged
            # gradients every time: its replicas never drift apart.)
            self._ready().finish()
            self._model_in_sync = True
        self._last_step_end = time.perf_counter()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's ``synchronize(); clip; with skip_synchronize(): step()``: the step uses
        the gradients ``synchronize()`` made final, without a second aggregation.  Under BSP
        a step here without ``synchronize()`` uses the local gradients, as in Horovod."""
        self._ready().skip_aggregation = True
        try:
            yield
        finally:
            self._strategy.skip_aggregation = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """BSP keeps the gradients inside the fusion buffer: ``set_to_none=False`` zeroes them
        there, ``True`` (torch's default) leaves them None until backward makes them anew,
        when they go back into the buffer; other policies defer to the wrapped optimizer."""
        if self._sparse_only or not self._ready().zero_grad(set_to_none):
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise RuntimeError("DistributedOptimizer: add parameter groups to the wrapped optimizer "
                           "before wrapping it (the fusion buffer is laid out once)")

    def close(self) -> None:
        if self._strategy is not None:
            self._strategy.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, strategy={type(self._strategy).__name__})"


def _weak_hook(method):
    """A gradient hook that calls ``method`` while its object lives.  A tensor's hooks are
    not seen by the cycle collector, so a hook holding the optimizer's bound method would
    keep the optimizer, and through it the model, alive for ever (see LiveOptimizers)."""
    ref = weakref.WeakMethod(method)

    def hook(param):
        bound = ref()
        if bound is not None:
            bound(param)

    return hook


def _set_ops(ctx, process_set):
    """The collectives of ``process_set`` for a DistributedOptimizer over it.  Gradient
    averaging (BSP on the ring) synchronizes every step by definition, so the set's members
    average over their own communicator without asking the state server; every other policy
    decides its rounds at the server for all the workers together (local steps, staleness
    bounds, model deltas or a parameter server), which a subset cannot follow."""
    from mpsync.torch.process_sets import ops_of
    from mpsync.torch.strategies import GradientAveraging, spec_of

    cls = spec_of(ctx.config).strategy_class(ctx.config.topology)
    if not (isinstance(cls, type) and issubclass(cls, GradientAveraging)):
        raise ValueError(f"DistributedOptimizer(process_set={process_set}): "
                         f"policy={ctx.config.policy!r} on topology={ctx.config.topology!r} "
                         f"decides its rounds at the state server for every worker, so "
                         f"aggregating over a subset would leave the others' rounds "
                         f"unmatched; use policy='bsp' on the ring, or the global process set "
                         f"(process sets work for the script's own collectives)")
    if process_set.process_set_id is not None and not process_set.included():
        return _OUTSIDE
    return ops_of(process_set, "DistributedOptimizer")


_OUTSIDE = object()  # _set_ops: this worker is not a member of the set


class _OutsideSet:
    """The strategy of a DistributedOptimizer over a process set this worker is not in:
    the wrapped optimizer steps on the local gradients and no collective is taken part in
    (Horovod's behaviour: the optimizer of a non-member is a plain one)."""

    aggregates_gradients = False
    skip_aggregation = False
    op_sum = False
    leader = None
    settled = True

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.iteration = 0

    def step(self, compute_time: float, closure=None):
        self.iteration += 1
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> bool:
        return False  # the wrapped optimizer's own

    def synchronize_gradients(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def idle_step(self) -> bool:
        return False

    def note_progress(self, epoch: int, loss: float) -> None:
        pass


def _check_passes(passes) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")


def _check_horovod_keywords(config, compression, backward_passes_per_step, op,
                            predivide) -> int:
    """Horovod's argument checks, plus the ones a policy adds; returns the reduce op."""
    from mpsync.torch.dataplane.compression import as_compressor
    from mpsync.torch.mpi_ops import Average, Sum, reduce_op

    _check_passes(backward_passes_per_step)
    op = reduce_op(None, op)
    where = f"policy={config.policy!r} on topology={config.topology!r}"
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be Average or Sum for gradients, got "
                         f"{op!r}")
    if predivide != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not predivide > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide!r}")
    if config.topology == "ps":
        # Compression on the PS: the dtype pushes and pulls travel in (ParameterServer).
        as_compressor(compression)
        if predivide != 1.0:
            raise ValueError(f"gradient_predivide_factor has no meaning under {where}: the "
                             f"server applies each worker's update, no gradient sum to split")
    return op


def name_parameters(optimizer, named_parameters) -> list[tuple[str, torch.Tensor]]:
    """(name, param) for every parameter of the optimizer, in optimizer order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len({id(p) for p in params}) != len(params):
        raise ValueError("the optimizer holds the same parameter twice")
    if named_parameters is None:
        return [(f"param_{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, e.g. "
                         "model.named_parameters()")
    names = [n for n, _ in named]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"named_parameters has duplicate names: {dup}")
    name_of = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in name_of]
    if missing:
        raise ValueError(f"{len(missing)} optimizer parameter(s) are not in named_parameters "
                         f"(first index {missing[0]}); pass model.named_parameters() of the "
                         f"model the optimizer trains")
    return [(name_of[id(p)], p) for p in params]


def _horovod_nccl(ctx) -> bool:
    """Whether Horovod was built with NCCL (its allreduce then takes device tensors)."""
    if ctx.hvd is None:
        return False
    try:
        return bool(ctx.hvd.nccl_built())
    except Exception:   # an older Horovod without the query: stage, which is always correct
        return False
