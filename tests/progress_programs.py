"""Multi-rank program for tests/test_progress.py: while a collective is in flight, its waiter
never sleeps.

Open MPI moves a non-blocking collective's bytes only while the rank is inside MPI, so a
waiter that sleeps between tests stalls its own transfer.  Here ``time.sleep`` is wrapped on
every rank; a call from the main thread while this rank's collective has started its data
step and not finished counts as a sleep in flight.  Worker 1 arrives 0.5 s late in each part,
so worker 0 waits long (and worker 1 finds worker 0 waiting).

Each part prints ``PART-OK <name> rank=<r>`` when no sleep fell in flight and the result is
right, else ``SLEPT <name> rank=<r> in_flight=<n>``.
"""

from __future__ import annotations

import threading
import time

import torch

import mpsync.torch as mps
from mpsync.torch import _runtime

_real_sleep = time.sleep
_LATE_S = 0.5


class SleepWatch:
    """Counts the main thread's ``time.sleep`` calls made while ``in_flight()`` is True
    (``time.sleep(0)``, a yield, is not a sleep)."""

    def __init__(self):
        self.in_flight = lambda: False
        self.slept_in_flight = 0
        self.slept = 0
        self._main = threading.main_thread()

    def sleep(self, seconds):
        if threading.current_thread() is self._main and seconds > 0:
            self.slept += 1
            if self.in_flight():
                self.slept_in_flight += 1
        _real_sleep(seconds)

    def part(self, name: str, r: int, ok: bool) -> None:
        if self.slept_in_flight == 0 and ok:
            print(f"PART-OK {name} rank={r} sleeps_outside_flight={self.slept}", flush=True)
        else:
            print(f"SLEPT {name} rank={r} in_flight={self.slept_in_flight} ok={ok}", flush=True)
        self.in_flight, self.slept_in_flight, self.slept = (lambda: False), 0, 0


def script_allreduce(watch: SleepWatch, r: int, n: int, numel: int, name: str) -> None:
    """``mps.allreduce`` of ``numel`` float32 values; in flight from the data step's start
    (member 0's answer) until it is done."""
    ops = _runtime.context().user_ops
    t = torch.full((numel,), float(r + 1))
    if r == 1:
        _real_sleep(_LATE_S)
    handle = mps.allreduce_async(t, name=name, op=mps.Sum)
    op = ops.handles[handle]
    watch.in_flight = lambda: op.records is not None and not op.done
    out = mps.synchronize(handle)
    watch.part(name, r, bool(torch.all(out == n * (n + 1) / 2)))


def _watch_aggregations(watch: SleepWatch, backend) -> None:
    """In flight from the backend's start of an aggregation until its wait returns."""
    state = {"on": False}
    start = backend.start_allreduce_average

    def started(*args, **kw):
        pending = start(*args, **kw)
        state["on"] = True
        wait = pending.wait

        def waited(*a, **k):
            try:
                return wait(*a, **k)
            finally:
                state["on"] = False

        pending.wait = waited
        return pending

    backend.start_allreduce_average = started
    watch.in_flight = lambda: state["on"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(2048, 2048)  # 16.8 MB of float32 gradients


def optimizer_step(watch: SleepWatch, r: int, n: int) -> None:
    """One BSP step of DistributedOptimizer on the mpi backend, worker 1 late."""
    ctx = _runtime.context()
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    before = model.weight.detach().clone()
    _watch_aggregations(watch, ctx.backend)
    if r == 1:
        _real_sleep(_LATE_S)
    opt.zero_grad()
    (model(torch.ones(1, 2048)) * (r + 1)).sum().backward()
    opt.step()
    # Every gradient entry is (r + 1): averaged over the workers, (n + 1) / 2.
    ok = torch.allclose(before - model.weight.detach(), torch.full_like(before, (n + 1) / 2))
    watch.part("optimizer_step", r, ok)
    del ctx.backend.start_allreduce_average
    return opt


def optimizer_joined(watch: SleepWatch, r: int, n: int, opt) -> None:
    """Worker 1 joins at once and takes part with zeros in worker 0's late step: its wait in
    the aggregation also answers the script's collectives (the backend's ``while_waiting``)."""
    ctx = _runtime.context()
    _watch_aggregations(watch, ctx.backend)
    if r == 1:
        last = mps.join()
    else:
        _real_sleep(_LATE_S)
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()
        last = mps.join()
    watch.part("optimizer_joined", r, last in range(n))
    del ctx.backend.start_allreduce_average


def main():
    mps.init(policy="bsp", topology="ring", backend="mpi", server="colocated", deadline=30)
    r, n = mps.rank(), mps.size()
    watch = SleepWatch()
    time.sleep = watch.sleep
    try:
        script_allreduce(watch, r, n, 4 << 20, "script_16MB")   # a blocking call on a lane
        script_allreduce(watch, r, n, 16 << 10, "script_64KB")  # Iallreduce, spun on
        opt = optimizer_step(watch, r, n)
        optimizer_joined(watch, r, n, opt)
    finally:
        time.sleep = _real_sleep
    mps.shutdown()


def _watch_shards(watch: SleepWatch, shards) -> None:
    """In flight while the worker's shard client waits for weights coming in (this rank
    copies them: a pull's or a push-and-pull's reads).  A push's own wait, for the shards to
    take their slices and answer, may pause: the shards move those bytes."""
    state = {"on": False}
    wait = shards._wait

    def waited(*args, moving_here=False, **kw):
        state["on"] = moving_here
        try:
            return wait(*args, moving_here=moving_here, **kw)
        finally:
            state["on"] = False

    shards._wait = waited
    watch.in_flight = lambda: state["on"]


def ps_main():
    """ASP on the parameter server in 2 shards (one per worker), a 16.8 MB model: 8 steps,
    each a push and a pull of the whole model, which take longer than any waiter's first
    spin.  Passes when no wait for the shards' weights slept and the waits went through the
    progress engine (it counted them)."""
    from mpsync.torch.dataplane.progress import engine

    mps.init(policy="asp", topology="ps", backend="mpi", server="dedicated", ps_shards=2,
             deadline=30)
    r = mps.rank()
    ctx = _runtime.context()
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    before = model.weight.detach().clone()
    watch = SleepWatch()
    _watch_shards(watch, ctx.shards)
    waits = engine().counts["waits"]
    time.sleep = watch.sleep
    try:
        for _ in range(8):
            opt.zero_grad()
            (model(torch.ones(1, 2048)) * (r + 1)).sum().backward()
            opt.step()
    finally:
        time.sleep = _real_sleep
    waited = engine().counts["waits"] - waits
    moved = not torch.equal(before, model.weight.detach())
    ok = moved and bool(torch.isfinite(model.weight).all()) and waited > 0
    print(f"engine waits={waited} moved={moved}", flush=True)
    watch.part("ps_push_pull", r, ok)
    mps.shutdown()
