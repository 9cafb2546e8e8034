"""Consistent-cut checkpoints of ``mpsync train``, written by worker 0 alone.

When each topology takes its cut, and what a resumed run re-learns, is in the
``mpsync.apps.train`` module doc.  A checkpoint holds only data (``mpsync.commits``): the
numpy RNG key and the shards' optimizer state, numpy arrays where they are made, are written as
tensors and turned back into arrays where they are restored.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

from mpsync.config import SyncConfig

__all__ = ["worker_state", "rng_states", "restore_rng_states", "shards_state_as_data",
           "write_checkpoint", "ps_checkpoint", "warn_if_slow", "flush_checkpoints", "reshard",
           "remap_position", "check_model_fits", "check_resume_before_launch"]

COUNTERS = ("iterations", "rounds", "compute_s", "wait_s", "aggregation_s", "bytes_sent",
            "data_sent", "data_received", "control_sent", "control_received", "data_min",
            "shard_sent", "shard_received")


def worker_state(mps, inner, epoch, index, samples, before: dict, slept_s: float) -> dict:
    """What one worker contributes to a checkpoint: data position, optimizer state, RNG states
    and its counters so far (``before``: those of the run it resumed)."""
    local = mps.stats(server=False)["local"]
    return {"epoch": epoch, "index": index, "samples": samples,
            "optimizer": inner.state_dict(), **rng_states(),
            "counters": {**{k: local[k] + before.get(k, 0) for k in COUNTERS},
                         "slept_s": slept_s + before.get("slept_s", 0.0)}}


def rng_states() -> dict:
    """This process's torch, numpy and Python RNG states, as data (numpy's key a tensor).

    The key's 32-bit words go in an int64 tensor: a uint32 tensor does not survive the plain
    pickle that gathers every worker's state to worker 0 (torch 2.13 rebuilds its storage
    without a dtype)."""
    import torch

    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {"rng_torch": torch.get_rng_state(),
            "rng_numpy": (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss),
            "rng_python": random.getstate()}


def restore_rng_states(saved: dict) -> None:
    """Continue the RNGs of :func:`rng_states` (numpy's key as a tensor, or as the array that
    checkpoints of earlier versions held)."""
    import torch

    name, key, pos, has_gauss, gauss = saved["rng_numpy"]
    torch.set_rng_state(saved["rng_torch"])
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(saved["rng_python"])


def shards_state_as_data(state: dict | None) -> dict | None:
    """The shards' optimizer state (``ShardClient.optimizer_state``: kind, steps, numpy
    buffers) with tensors for buffers, bit for bit; restoring takes either (``np.asarray``)."""
    import torch

    if state is None:
        return None
    return {k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for k, v in state.items()}


def write_checkpoint(out, model, gathered: list, n, wall_s, evals, round_, step, config,
                     server: dict | None = None) -> None:
    """Worker 0: one file, written atomically, with the model every worker holds (ring) or the
    global weights (ps) and every worker's state."""
    state = {"model": model.state_dict(), "per_worker": gathered, "workers": n,
             "round": round_, "step": step, "wall_s": wall_s, "evals": list(evals),
             "policy": config.to_dict(),
             # For the record: a resumed server starts from the model above and zero clocks
             # (module doc: what is needed for correctness and what is re-learned).
             "server": {"topology": config.topology, **(server or {})}}
    t0 = time.perf_counter()
    _writer(out).save(round_, state)   # a copy now; the file in the background
    warn_if_slow(time.perf_counter() - t0, "a checkpoint copy", config)


_writers: dict = {}


def _writer(out):
    from mpsync.apps.checkpoint import CheckpointWriter  # torch

    key = str(out)
    if key not in _writers:
        _writers[key] = CheckpointWriter(out / "checkpoints")
    return _writers[key]


def flush_checkpoints() -> None:
    """Worker 0, before the run's results: every checkpoint asked for is on disk."""
    for writer in _writers.values():
        writer.flush()


def reshard(resume: dict, workers: int) -> dict:
    """A checkpoint written by ``resume["workers"]`` workers, for ``workers`` of them.

    Worker i keeps old worker i's optimizer state, RNG states and counters (a worker added
    beyond the old count starts from old worker ``i mod n``'s, with no counters); the samples
    seen are spread evenly so their sum, which the epoch budget counts, is unchanged.  Each
    entry keeps its old epoch and index; :func:`remap_position` maps the index onto the new
    shard.  The same checkpoint and worker count always give the same result, so a restart
    and a resume by hand compute the same run."""
    old = resume["per_worker"]
    n = len(old)
    if workers == n:
        return resume
    total = sum(int(w["samples"]) for w in old)
    per_worker = []
    for i in range(workers):
        entry = dict(old[i % n])
        if i >= n:
            entry["counters"] = {}
        entry["samples"] = total // workers + (1 if i < total % workers else 0)
        entry["resharded_from"] = (n, i % n)
        per_worker.append(entry)
    return {**resume, "per_worker": per_worker, "workers": workers, "resharded_from": n}


def remap_position(index: int, old_per_epoch: int, new_per_epoch: int) -> int:
    """The batch index on a new shard at the same fraction of the epoch as ``index`` was on
    the old one (a shard of fewer workers is longer)."""
    if old_per_epoch <= 0:
        return 0
    return min(max(new_per_epoch - 1, 0), index * new_per_epoch // old_per_epoch)


def ps_checkpoint(mps, opt, out, model, me, n, mine: dict, time_up: bool, target_samples, wall,
                  evals, round_, step, config) -> tuple[bool, int]:
    """PS checkpoint round (every worker has just made its ``round_``-th push and pull):
    agree whether to stop and, if not, write the global model at this cut.

    1. gather every worker's state to worker 0: once it returns, every worker has made
       ``round_`` pushes and the server has applied them all;
    2. worker 0 pulls the global weights, which then hold exactly those pushes, and writes;
    3. a sum-allreduce carries worker 0's decision to all: no worker pushes again before
       worker 0's pull, so no later update leaks into the saved weights.
    Returns (stop, samples of all workers)."""
    import torch

    gathered = mps.gather_object({**mine, "time_up": time_up}, root_rank=0,
                                 name="checkpoint state")
    decision = torch.zeros(2, dtype=torch.int64)
    if me == 0:
        total = sum(g["samples"] for g in gathered)
        time_up = [g.pop("time_up") for g in gathered]
        stop = any(time_up) or (target_samples is not None and total >= target_samples)
        if not stop:
            version = opt.strategy.pull_global()
            # ps_version: the updates this server applied, counted from the start of this run
            # (a resumed run's server counts from zero again); optimizer: the shards' own
            # (ps_optimizer='server'), which a resumed run continues.
            server = {"ps_version": version}
            shards_state = shards_state_as_data(opt.strategy.server_optimizer_state())
            if shards_state is not None:
                server["optimizer"] = shards_state
            write_checkpoint(out, model, gathered, n, wall(), evals, round_, step, config,
                             server=server)
        decision = torch.tensor([total, int(stop)], dtype=torch.int64)
    agreed = mps.allreduce(decision, average=False, name="checkpoint decision")
    return bool(agreed[1] > 0), int(agreed[0])


_slow_warned: set = set()


def warn_if_slow(seconds: float, what: str, config: SyncConfig) -> None:
    """Worker 0 evaluates and writes checkpoints while the other workers wait for it (in the
    next collective) and the state server hears nothing from it: past ``deadline`` or
    ``silent_timeout`` that wait fails the job.  Warn once when it gets within half of them."""
    limit = min(config.deadline, config.silent_timeout)
    if seconds > limit / 2 and what not in _slow_warned:
        _slow_warned.add(what)
        print(f"mpsync train: warning: {what} on worker 0 took {seconds:.1f}s while the other "
              f"workers waited; the job fails if it exceeds {limit:g}s (--deadline "
              f"{config.deadline:g}, --silent-timeout {config.silent_timeout:g}): raise both",
              file=sys.stderr, flush=True)


def check_model_fits(model, state: dict, path, args) -> None:
    """The checkpoint's model (``state``: its ``state_dict``) is the one this run builds, or
    :class:`CheckpointError`, one line naming the file and what differs (instead of
    ``load_state_dict``'s traceback on every worker)."""
    from mpsync.apps.checkpoint import CheckpointError  # torch

    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in state.items()}
    differ = [f"{k} is {list(theirs[k])} there, {list(mine[k])} here" for k in mine
              if k in theirs and theirs[k] != mine[k]]
    missing, extra = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
    if missing:
        differ.append(f"it lacks {', '.join(missing[:3])}{' ...' * (len(missing) > 3)}")
    if extra:
        differ.append(f"it has {', '.join(extra[:3])}{' ...' * (len(extra) > 3)} besides")
    if differ:
        raise CheckpointError(
            f"--resume {path}: the checkpoint holds another model than --model {args.model} "
            f"on --dataset {args.dataset} builds ({'; '.join(differ[:3])}); resume with the "
            f"--model and --dataset of the run that wrote it")


def check_resume_before_launch(args) -> None:
    """``--resume``: the newest usable checkpoint, and that its model is the one the ranks
    will build, checked once before any rank starts (CheckpointError, one line).  Costs
    torch's import and one read of the data set, here, only when resuming."""
    from mpsync.apps.checkpoint import latest_good  # torch
    from mpsync.apps.datasets import load_dataset
    from mpsync.apps.models import build_model

    path, state = latest_good(args.resume, warn=lambda msg: print(f"mpsync train: {msg}",
                                                                  file=sys.stderr))
    ds = load_dataset(args.dataset, seed=args.seed, synthetic_samples=args.synthetic_samples,
                      synthetic_features=args.synthetic_features,
                      synthetic_classes=args.synthetic_classes,
                      synthetic_noise=args.synthetic_noise)
    check_model_fits(build_model(ds.input_shape, ds.n_classes, args.seed, args.model),
                     state["model"], path, args)
