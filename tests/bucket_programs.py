"""Programs for tests/test_buckets.py: BSP's gradient buckets started during backward, against
the whole model averaged at step(), on real ranks (run under tests/mpi_harness.py)."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402


def _args() -> dict:
    return dict(a.partition("=")[::2] for a in sys.argv[1:] if "=" in a)


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


class Branchy(torch.nn.Module):
    """Three layers on the main path and a side branch that only some steps of some workers
    use: the branch's parameters get no gradient in the others (DDP's unused parameters)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.side = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x, use_side: bool):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        if use_side:
            h = h + torch.tanh(self.side(h))
        return self.out(h)


def _model() -> Branchy:
    torch.manual_seed(0)
    return Branchy().double()


def _digest(model) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def _train(opt, model, steps: int, passes: int, me: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        # Alternate the two ways of zeroing: set_to_none leaves the gradients None until the
        # next backward makes them anew.
        opt.zero_grad(set_to_none=step % 2 == 0)
        for k in range(passes):
            g = torch.Generator().manual_seed(1000 * step + 10 * me + k)
            x = torch.randn(5, 6, generator=g, dtype=torch.float64)
            y = torch.randint(0, 3, (5,), generator=g)
            # Worker 0 uses the side branch every third step, the others never.
            use_side = me == 0 and step % 3 == 0
            torch.nn.functional.cross_entropy(model(x, use_side), y).backward()
        opt.step()


def buckets_equal_the_whole_model() -> None:
    """The same training twice in one process: first with buckets started during backward,
    then (a second optimizer follows the first, so it averages at step()) the whole model at
    step(); the weights after each, and where each bucket started relative to backward's
    gradient hooks, come back as the RESULT."""
    a = _args()
    steps, passes = int(a.get("steps", 50)), int(a.get("passes", 1))
    mps.init(policy="bsp", backend=a.get("backend", "mpi"), server="colocated", deadline=60,
             bucket_mb=float(a.get("bucket_mb", 0.001)))
    me = mps.rank()

    bucketed = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(bucketed.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=bucketed.named_parameters(),
                                   backward_passes_per_step=passes)
    strategy = opt.strategy
    assert strategy.buckets is not None, "no buckets under bsp with overlap on"
    n_buckets = len(strategy.buckets.buckets)

    # The order of events in the first step: a bucket's collective started, or a gradient
    # hook of the test (registered after the optimizer's, so it fires after the bucket's own
    # hook for the same parameter).
    events: list[str] = []
    start_sum = strategy.wire.start_sum

    def recording_start_sum(tensor, what, *args, **kw):
        events.append("start " + what)
        return start_sum(tensor, what, *args, **kw)

    strategy.wire.start_sum = recording_start_sum
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: events.append("grad " + n))
             for n, p in bucketed.named_parameters()]
    _train(opt, bucketed, 1, passes, me)
    first_step = list(events)
    for h in hooks:
        h.remove()
    strategy.wire.start_sum = start_sum
    _train(opt, bucketed, steps - 1, passes, me, first=1)
    opt.zero_grad(set_to_none=True)
    none_after_zero = all(p.grad is None for p in bucketed.parameters())

    whole = _model()
    opt2 = mps.DistributedOptimizer(torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=whole.named_parameters(),
                                    backward_passes_per_step=passes)
    assert opt.strategy.buckets is None and opt2.strategy.buckets is None
    _train(opt2, whole, steps, passes, me)

    diff = max(float(((p - q).abs() / q.abs().clamp_min(1e-12)).max())
               for p, q in zip(bucketed.parameters(), whole.parameters()))
    _result(rank=me, size=mps.size(), buckets=n_buckets, first_step=first_step,
            bucketed=_digest(bucketed), whole=_digest(whole), max_rel=diff,
            none_after_zero=none_after_zero)
    mps.shutdown()
