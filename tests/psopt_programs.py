"""Rank programs for tests/test_ps_server_optimizer.py and tests/test_ps_first_pull.py: BSP
rounds on the parameter server, the optimizer run by the shards (``ps_optimizer='server'``) or
by the workers (``'worker'``), every worker's starting weights, and constant gradients through
the shards' inbox, on real ranks.  Each prints one ``RESULT {...}`` line per worker rank (run
through ``run_mpi("psopt_programs:NAME", ...)``)."""

from __future__ import annotations

import json
import sys
import time

import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402
from torch_programs import _args, _data, _digest, _flat, _model  # noqa: E402

BATCH, STEPS, LR, LR_LATER, DECAY = 4, 20, 0.02, 0.005, 1e-3


def _adam(params):
    return torch.optim.Adam(params, lr=LR, betas=(0.9, 0.99), weight_decay=DECAY)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=DECAY)


_OPTIMIZERS = {"adam": _adam, "sgd": _sgd}


def _reference(make_optimizer, workers: int) -> torch.Tensor:
    """Single-process training with ``make_optimizer`` (Adam, SGD with momentum) on the
    concatenated batch of every worker, with the same learning-rate change half-way."""
    model = _model()
    opt = make_optimizer(model.parameters())
    for step in range(STEPS):
        if step == STEPS // 2:
            opt.param_groups[0]["lr"] = LR_LATER
        x, y = _data(workers * BATCH, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return _flat(model)


def _after_a_push(limit_s: float = 2.0) -> bool:
    """Wait until the state server has counted a push (it counts one once every shard has
    taken its slice), or ``limit_s``; whether one came.  Bounded and never raising: the
    workers wait for each other's first pull before anyone pushes, so the push this waits
    for comes only if that wait is missing."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if any(w["pushes"] for w in mps.stats()["server"]["workers"].values()):
            return True
        time.sleep(0.01)
    return False


def _record_first_pull(strategy) -> dict:
    """``{"digest": ...}`` of the weights this worker's first pull read (its starting
    weights), filled in when that pull returns."""
    seen: dict = {}
    pull = strategy._pull

    def recorded(*args, **kw):
        out = pull(*args, **kw)
        seen.setdefault("digest", _digest(torch.from_numpy(strategy._base.copy())))
        return out

    strategy._pull = recorded
    return seen


def _save_cut(opt, model, path: str) -> None:
    """Between two rounds, with every worker held: worker 0 saves what a checkpoint keeps of
    the PS (the global model, the shards' optimizer state)."""
    mps.worker_comm().Barrier()
    if mps.rank() == 0:
        opt.strategy.pull_global()
        torch.save({"model": model.state_dict(),
                    "shards": opt.strategy.server_optimizer_state()}, path)
    mps.worker_comm().Barrier()


def ps_rounds() -> None:
    """``policy`` (default bsp) on the PS with ``optimizer`` (adam or sgd: with momentum and
    weight decay; float64) and workers of unequal, jittery speeds, the learning rate lowered
    half-way (with the server's optimizer the new settings reach the shards with the next
    push).  Under BSP the model after 20 rounds is single-process training on the
    concatenated batch -- with the server's optimizer for both, with the workers' own only for
    SGD (for Adam it is the mean of per-worker Adam steps).
    ``start_late=1``: every worker but worker 0 takes its first step (which pulls the
    starting weights) only after worker 0's first push is on every shard, or 2 s if that push
    never comes (it must not: no worker pushes before every worker has pulled).
    ``save=PATH``: after round 10 worker 0 writes the global model and the shards' optimizer
    state to PATH, as a checkpoint does; ``resume=PATH``: start from such a file at round 10
    (the shards continue its optimizer state) and run the remaining rounds."""
    a = _args()
    policy = a.get("policy", "bsp")
    mps.init(policy=policy, topology="ps", backend="mpi", server="dedicated", deadline=60,
             ps_shards=int(a.get("ps_shards", 3)), ps_optimizer=a["ps_optimizer"])
    make_optimizer = _OPTIMIZERS[a.get("optimizer", "adam")]
    model = _model()
    start = _digest(_flat(model))
    opt = mps.DistributedOptimizer(make_optimizer(model.parameters()),
                                   named_parameters=model.named_parameters())
    first_pull = _record_first_pull(opt.strategy)
    n, me = mps.size(), mps.rank()
    jitter = torch.Generator().manual_seed(7 + me)
    start_late = a.get("start_late") == "1"
    pushed_before_start = None
    first = 0
    if a.get("resume"):
        saved = torch.load(a["resume"], weights_only=False)
        model.load_state_dict(saved["model"])
        start = _digest(_flat(model))
        opt.param_groups[0]["lr"] = LR_LATER
        first = STEPS // 2
        if me == 0:
            opt.strategy.restore_server_optimizer(saved["shards"])
    for step in range(first, STEPS):
        if step == STEPS // 2 and a.get("save"):
            _save_cut(opt, model, a["save"])
        if step == STEPS // 2:
            opt.param_groups[0]["lr"] = LR_LATER
        x, y = _data(n * BATCH, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[me * BATCH:(me + 1) * BATCH]),
                                          y[me * BATCH:(me + 1) * BATCH]).backward()
        # a fast worker's next push races a slow worker's pull of the round
        time.sleep(0.002 * me + 0.01 * float(torch.rand(1, generator=jitter)))
        if step == first and me > 0 and start_late:
            pushed_before_start = _after_a_push()
        opt.step()
    if policy != "bsp":
        opt.synchronize()   # workers end at different iterations between barriers or rounds
    local = mps.stats()["local"]
    state = sum(len(s) for s in opt.state.values())   # the worker's own optimizer state
    mps.shutdown()
    final = _flat(model)
    ref = _reference(make_optimizer, n)
    print("RESULT " + json.dumps({
        "rank": me, "rounds": local["rounds"], "iterations": local["iterations"],
        "digest": _digest(final), "worker_state": state, "final": final.tolist(),
        "start": start, "first_pull": first_pull.get("digest"),
        "pushed_before_start": pushed_before_start,
        "vs_reference": float((final - ref).abs().max() / ref.abs().max())}),
        flush=True)


def constant_gradients() -> None:
    """``policy`` (asp or ssp) on the PS, plain SGD run by the shards through their inbox, and
    a loss whose gradient is a constant ``c`` per parameter: however a shard merges the pushes
    it takes, the weights after every worker's last push are the starting ones less lr x the
    pushes x c, exactly (float32, values in eighths).  The shards' ranges cut across the
    parameters; one is frozen and one gets no gradient (zeros in each push).  Prints how many
    pushes went straight from the gradients into the inbox's slots."""
    a = _args()
    mps.init(policy=a["policy"], topology="ps", backend="mpi", server="dedicated",
             deadline=60, ps_shards=3, ps_optimizer="server")
    params = [torch.nn.Parameter(torch.zeros(k)) for k in (5, 7, 3, 6)]
    params[2].requires_grad_(False)
    slopes = [torch.ones(5), torch.arange(7.0) / 4]   # params[3]: in no loss, no gradient
    opt = mps.DistributedOptimizer(torch.optim.SGD(params, lr=0.5),
                                   named_parameters=[(f"p{i}", p) for i, p in
                                                     enumerate(params)])
    into_slots, straight = [0], opt.strategy._grads_into_slots

    def counted():
        went = straight()
        into_slots[0] += went
        return went

    opt.strategy._grads_into_slots = counted
    for _ in range(STEPS):
        opt.zero_grad()
        sum((p * c).sum() for p, c in zip(params, slopes)).backward()
        opt.step()
    opt.synchronize()
    local = mps.stats()["local"]
    mps.shutdown()
    print("RESULT " + json.dumps({
        "rank": mps.rank(), "workers": mps.size(), "iterations": local["iterations"],
        "into_slots": into_slots[0], "final": [p.detach().tolist() for p in params]}),
        flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
