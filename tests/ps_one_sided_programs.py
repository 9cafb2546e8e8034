"""Rank programs for tests/test_ps_one_sided.py: pushes and pulls through the shards' RMA
window (``mpsync.server.shard_window``) on real ranks.  Each prints ``RESULT {...}`` per
worker and raises on a wrong answer."""

from __future__ import annotations

import json

import numpy as np
import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402
from mpsync.server.shard_window import SLOTS  # noqa: E402
from ps_programs import BASE, _args, _decode, counting_model  # noqa: E402


def pushes_land_once() -> None:
    """``policy`` on 2 shards, float64 model at 0, every push of worker j adds BASE**j to
    every coordinate (``ps_programs``): each pull holds all of this worker's own pushes on
    every coordinate, and after shutdown (ASP) every push of every worker is in exactly once.
    Reports whether the window carried them, what the shards counted, and the liveness
    answers while training (nobody silent, nobody unheard).  ``optimizer=server``: the shards
    run SGD at lr 1 on the pushed gradients (-BASE**j), through their inbox under ASP: a pull
    may not yet hold this worker's last ``SLOTS`` pushes, never more, and never fewer than
    the pull before.  Under SSP (``staleness``, 2 unless given) the k-th pull holds at least
    every worker's first k - staleness pushes: what the bound promises, through the inbox as
    through messages."""
    from mpsync.torch import _runtime

    a = _args()
    policy, steps = a.get("policy", "asp"), int(a.get("steps", 20))
    server = a.get("optimizer", "worker") == "server"
    bound = int(a.get("staleness", 2))
    mps.init(policy=policy, topology="ps", backend="mpi", server="dedicated", deadline=60,
             ps_shards=2, staleness=bound, ps_one_sided=a.get("one_sided", "1") == "1",
             ps_optimizer="server" if server else "worker")
    me, n = mps.rank(), mps.size()
    model, opt = counting_model()
    ctx = _runtime.context()
    silent, before = None, 0
    for k in range(1, steps + 1):
        for p in model.parameters():
            p.grad = torch.full_like(p, -float(BASE ** me))
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        counts = _decode(flat, n)
        own = counts[:, me]
        lag = SLOTS if server and ctx.shards.window is not None else 0
        if np.any(own > k) or np.any(own < max(k - lag, before)):
            raise AssertionError(f"pull {k}: this worker's own pushes {own} (from "
                                 f"{max(k - lag, before)} to {k})")
        before = int(own.min())
        if policy == "ssp" and np.any(counts < k - bound):
            raise AssertionError(f"pull {k} under SSP with bound {bound} holds "
                                 f"{counts.min(axis=0)} pushes of the workers, fewer than "
                                 f"{k - bound}")
        if k == steps // 2:
            silent = ctx.shards.silent_workers()
    window = ctx.shards.window is not None
    mps.shutdown()
    final = _decode(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
                    n)
    if policy == "asp" and np.any(final != steps):
        raise AssertionError(f"after shutdown the model holds {final.min(axis=0)} to "
                             f"{final.max(axis=0)} pushes per worker, each made {steps}")
    shard = ctx.shard_thread.result if ctx.shard_thread is not None else None
    print("RESULT " + json.dumps({
        "rank": me, "window": window, "silent": silent,
        "shard": None if shard is None else {k: shard[k] for k in
                                             ("version", "one_sided_pushes", "dropped")}}),
          flush=True)
