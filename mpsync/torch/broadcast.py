"""Broadcast helpers with Horovod's names: make every worker start from the same model; and
gather_object, bounded by a deadline (Horovod's other collectives: ``mpi_ops``).

Tensors are fused by dtype into one flat buffer per dtype (one broadcast each, not one per
tensor) and sent over the workers' communicator.  Broadcasts wait up to the larger of
``deadline`` and ``startup_timeout``: in a Horovod-style script they follow model construction,
checkpoint loading or data preparation, where ranks legitimately drift apart by more than the
per-step deadline.
"""

from __future__ import annotations

import io
import pickle

import torch

from mpsync.torch import _runtime

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "gather_object"]


def _broadcast_deadline(ctx) -> float:
    return max(ctx.config.deadline, ctx.config.startup_timeout)


def _named_tensors(params) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, dict):
        items = sorted(params.items())  # same order on every rank
    else:
        items = list(params)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in items):
            raise ValueError("broadcast_parameters takes a state_dict or (name, tensor) pairs, "
                             "e.g. model.named_parameters()")
    bad = [n for n, t in items if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"broadcast_parameters: not tensors: {bad[:5]}")
    return items


def broadcast_parameters(params, root_rank: int = 0, process_set=None) -> None:
    """Copy ``root_rank``'s tensors into every worker's (in place), like Horovod's;
    ``process_set``: only among its members (``root_rank`` is a worker rank)."""
    from mpsync.torch.mpi_ops import broadcast_
    from mpsync.torch.process_sets import is_whole_world

    ctx = _runtime.worker_context("broadcast_parameters")
    _check_root(root_rank, ctx.size)
    send = (lambda flat: ctx.backend.broadcast_(flat, root_rank, "parameters",
                                                _broadcast_deadline(ctx))) \
        if is_whole_world(process_set) else \
        (lambda flat: broadcast_(flat, root_rank, "parameters", process_set))
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, t in _named_tensors(params):
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, tensors in by_dtype.items():
        wire = torch.uint8 if dtype == torch.bool else dtype
        # Staged in host memory: the backends send CPU buffers, whatever device the model is on
        # (the copies back below move each slice to its tensor's device).
        flat = (torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=wire) for t in tensors])
                if tensors else None)
        if flat is None or flat.numel() == 0:
            continue
        send(flat)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view(t.shape).to(dtype))
                offset += n


def broadcast_object(obj, root_rank: int = 0, name: str | None = None, process_set=None,
                     map_location=None):
    """``root_rank``'s picklable object on every worker (torch.save, so tensors travel).
    ``name`` is accepted for Horovod's signature; only the global process set exists.

    ``map_location`` (``torch.load``'s): where the root's tensors land; by default a tensor
    the root had on a GPU lands on this worker's current GPU (the root's ``cuda:3`` is
    another worker's GPU, or none at all here), on the host where this worker has no CUDA,
    and a host tensor stays on the host."""
    from mpsync.torch.mpi_ops import broadcast_
    from mpsync.torch.process_sets import is_whole_world

    ctx = _runtime.worker_context("broadcast_object")
    _check_root(root_rank, ctx.size)
    data = None
    if ctx.worker_rank == root_rank:
        b = io.BytesIO()
        torch.save(obj, b)
        data = b.getvalue()
    if is_whole_world(process_set):
        data = ctx.backend.broadcast_bytes(data, root_rank, "object", _broadcast_deadline(ctx))
    else:
        n = torch.tensor([len(data) if data is not None else 0])
        broadcast_(n, root_rank, process_set=process_set)
        buf = torch.zeros(int(n), dtype=torch.uint8)
        if data is not None:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        data = broadcast_(buf, root_rank, process_set=process_set).numpy().tobytes()
    if ctx.worker_rank == root_rank:
        return obj
    if map_location is None:
        map_location = local_cuda_location()
    return torch.load(io.BytesIO(data), weights_only=False, map_location=map_location)


def local_cuda_location(device_count: int | None = None) -> dict:
    """``torch.load``'s ``map_location`` sending every CUDA location to this process's
    current GPU, or to the host without CUDA (host locations stay as they are)."""
    here = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    n = max(64, torch.cuda.device_count() if device_count is None else device_count)
    return {"cuda": here, **{f"cuda:{i}": here for i in range(n)}}


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None) -> None:
    """Load ``root_rank``'s optimizer state (and hyper-parameters) on every worker.

    As in Horovod, an optimizer without state yet (no step taken) first takes one local step
    of the wrapped optimizer on zero gradients (set where a gradient is None), so its state
    exists and has the same structure everywhere; the gradients are then zeros, not None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state needs an optimizer, got {type(optimizer).__name__}")
    if not inner.state:
        for group in inner.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        inner.step()
    # Onto the host first: load_state_dict then puts each state tensor on its parameter's
    # device, whatever device the root's was on.
    state = broadcast_object(inner.state_dict(), root_rank, map_location="cpu")
    if _runtime.context().worker_rank != root_rank:
        inner.load_state_dict(state)


def gather_object(obj, root_rank: int = 0, name: str | None = None):
    """Every worker's picklable ``obj`` on ``root_rank``, as a list in worker order; ``None``
    on the other workers.

    Unlike a blocking ``comm.gather`` it cannot hang on a worker that stopped: every wait has
    the run's ``deadline``, after which :class:`~mpsync.torch.CollectiveTimeout` names the
    workers that never sent (on the root) or the root (elsewhere).  A barrier follows, so a
    worker whose small message was sent eagerly still learns within the deadline that the root
    has stopped, and the root that a worker stopped after sending.
    """
    from mpsync.torch.dataplane.backends import gather_bytes

    ctx = _runtime.worker_context("gather_object")
    _check_root(root_rank, ctx.size)
    what = name or "gather_object"
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    parts = gather_bytes(ctx.objects, data, root_rank, deadline=ctx.config.deadline,
                         what=f"{what} (to worker {root_rank})", world_ranks=ctx.world_ranks)
    ctx.backend.barrier(f"{what} done")
    if parts is None:
        return None
    return [obj if r == root_rank else pickle.loads(p) for r, p in enumerate(parts)]


def _check_root(root_rank: int, size: int) -> None:
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be a worker rank in 0..{size - 1}, got {root_rank!r}")
