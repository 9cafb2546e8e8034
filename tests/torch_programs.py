"""Rank programs for tests/test_torch*.py and tests/test_failures.py.

Run through the harness: ``run_mpi("torch_programs:NAME", np=N, args=[...])``, or as a script
(``run_mpi(str(PROGRAMS), args=["NAME", ...])``) when the program must rely on mpsync's own
abort hook rather than the harness's runner.  Each program checks its own result, prints one
``RESULT {...}`` JSON line per rank for the test to read, and raises on a wrong answer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402


def _args() -> dict:
    """``key=value`` command-line arguments."""
    out = {}
    for a in sys.argv[1:]:
        k, sep, v = a.partition("=")
        if sep:
            out[k] = v
    return out


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _model(seed: int = 0, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8), torch.nn.Tanh(),
        torch.nn.Linear(8, 3)).to(dtype)


def _data(n: int, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _digest(t: torch.Tensor) -> str:
    """Bitwise fingerprint of a tensor (equal digests: identical parameters)."""
    import hashlib

    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())


def _reference_sgd(steps: int, workers: int, batch: int, lr: float, momentum: float):
    """Single-process SGD on the concatenated batch of all workers."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        x, y = _data(workers * batch, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return _flat(model)


def _train_shard(opt, model, steps: int, workers: int, batch: int, me: int,
                 dtype=torch.float64) -> None:
    for step in range(steps):
        x, y = _data(workers * batch, seed=100 + step, dtype=dtype)
        xs, ys = x[me * batch:(me + 1) * batch], y[me * batch:(me + 1) * batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()


# -- BSP exactness --------------------------------------------------------------------------
def bsp_equals_single_process() -> None:
    """BSP on N workers (equal shards) == single-process SGD on the concatenated batch."""
    a = _args()
    backend = a.get("backend", "mpi")
    steps, batch, lr, momentum = 6, 5, 0.2, 0.9
    mps.init(policy="bsp", backend=backend, server=a.get("server", "dedicated"), deadline=30)
    model = _model()
    with torch.no_grad():  # workers start apart; broadcast_parameters must fix that
        for p in model.parameters():
            p.add_(0.01 * mps.rank())
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    mps.broadcast_optimizer_state(opt, root_rank=0)
    _train_shard(opt, model, steps, mps.size(), batch, mps.rank())
    ref = _reference_sgd(steps, mps.size(), batch, lr, momentum)
    mine = _flat(model)
    rel = _max_rel(mine, ref)
    stats = mps.stats()
    mps.shutdown()
    _result(backend=backend, rank=mps.rank(), size=mps.size(), max_rel=rel,
            params=_digest(mine), rounds=stats["local"]["rounds"],
            iterations=stats["local"]["iterations"])
    if rel > 1e-6:
        raise AssertionError(f"BSP differs from single-process SGD: max rel {rel:.3g}")


def bsp_backends_agree() -> None:
    """The same BSP run with the horovod and the mpi backend, in one job: identical results.

    Runs the mpi backend through the strategy directly on a second context (one process can
    hold only one ``mps.init``), so both use the same workers and the same data."""
    from mpsync.torch import _runtime
    from mpsync.torch.dataplane.backends import MPIAggregator

    steps, batch, lr = 5, 4, 0.3
    mps.init(policy="bsp", backend="horovod", server="dedicated", deadline=30)
    ctx = _runtime.context()
    model_h = _model()
    opt_h = mps.DistributedOptimizer(torch.optim.SGD(model_h.parameters(), lr=lr),
                                     named_parameters=model_h.named_parameters())
    _train_shard(opt_h, model_h, steps, mps.size(), batch, mps.rank())
    mpi_ctx = _runtime.Context(
        config=ctx.config, world=ctx.world, control=ctx.control, workers=ctx.workers,
        server_rank=ctx.server_rank, dedicated=ctx.dedicated, worker_rank=ctx.worker_rank,
        world_ranks=ctx.world_ranks,
        backend=MPIAggregator(ctx.workers.Dup(), deadline=30.0, watch=None), client=None)
    model_m = _model()
    opt_m = mps.DistributedOptimizer(torch.optim.SGD(model_m.parameters(), lr=lr),
                                     named_parameters=model_m.named_parameters(),
                                     _context=mpi_ctx)
    _train_shard(opt_m, model_m, steps, mps.size(), batch, mps.rank())
    ref = _reference_sgd(steps, mps.size(), batch, lr, 0.0)
    h, m = _flat(model_h), _flat(model_m)
    mps.shutdown()
    _result(rank=mps.rank(), horovod_vs_mpi=_max_rel(h, m), horovod_vs_ref=_max_rel(h, ref),
            mpi_vs_ref=_max_rel(m, ref))
    if _max_rel(h, m) > 1e-6 or _max_rel(h, ref) > 1e-6 or _max_rel(m, ref) > 1e-6:
        raise AssertionError("backends disagree")


def bsp_gloo_matches_mpi() -> None:
    """BSP for ``steps`` steps on the gloo backend and again on the mpi backend, in one job
    (the mpi run through a second context, as ``bsp_backends_agree``), float32 with momentum:
    with 2 workers both sum the same two values and scale by 1/2, so the weights must be
    bitwise equal; with more, within 1e-6 relative (the reduction orders may differ)."""
    from mpsync.torch import _runtime
    from mpsync.torch.dataplane.backends import MPIAggregator

    steps, batch, lr = int(_args().get("steps", 20)), 4, 0.1
    mps.init(policy="bsp", backend="gloo", server="dedicated", deadline=30)
    ctx = _runtime.context()
    runs = {}
    for name, context in (("gloo", None), ("mpi", _runtime.Context(
            config=ctx.config, world=ctx.world, control=ctx.control, workers=ctx.workers,
            server_rank=ctx.server_rank, dedicated=ctx.dedicated,
            worker_rank=ctx.worker_rank, world_ranks=ctx.world_ranks,
            backend=MPIAggregator(ctx.workers.Dup(), deadline=30.0, watch=None),
            client=None))):
        model = _model(dtype=torch.float32)
        opt = mps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
            named_parameters=model.named_parameters(),
            **({} if context is None else {"_context": context}))
        _train_shard(opt, model, steps, mps.size(), batch, mps.rank(), dtype=torch.float32)
        runs[name] = _flat(model)
    backend = type(ctx.backend).__name__
    mps.shutdown()
    g, m = runs["gloo"], runs["mpi"]
    _result(rank=mps.rank(), size=mps.size(), backend=backend, bitwise=bool(torch.equal(g, m)),
            max_rel=_max_rel(g, m), digest=_digest(g))


# -- ESync / ElasticBSP deltas -------------------------------------------------------------
def esync_equal_speeds_equals_bsp() -> None:
    """ESync, equal speeds, plain SGD, ε = 1: every step is an aggregation and the model after
    each step equals BSP's (single-process SGD on the concatenated batch)."""
    steps, batch, lr = 8, 4, 0.3
    mps.init(policy="esync", backend=_args().get("backend", "mpi"), server="dedicated",
          epsilon=1.0, esync_slack=0.05, deadline=30)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    ref_model = _model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=lr)
    worst = 0.0
    n, me = mps.size(), mps.rank()
    for step in range(steps):
        x, y = _data(n * batch, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[me * batch:(me + 1) * batch]),
                                          y[me * batch:(me + 1) * batch]).backward()
        time.sleep(0.03)  # equal speeds, well above timing noise
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref_model(x), y).backward()
        ref_opt.step()
        worst = max(worst, _max_rel(_flat(model), _flat(ref_model)))
    local = mps.stats()["local"]
    mps.shutdown()
    _result(rank=me, max_rel=worst, iterations=local["iterations"], rounds=local["rounds"],
            digest=_digest(_flat(model)))


def esync_straggler() -> None:
    """ESync with worker 0 four times slower: the others take more local steps per round;
    after shutdown every worker holds the same model."""
    a = _args()
    rounds, base = int(a.get("rounds", 6)), float(a.get("iter_time", 0.02))
    policy = a.get("policy", "esync")
    mps.init(policy=policy, topology=a.get("topology", "ring"), backend=a.get("backend", "mpi"),
          server="dedicated", deadline=60)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    me = mps.rank()
    slow = 4.0 if me == 0 else 1.0
    step = 0
    while opt.strategy.round < rounds:
        x, y = _data(8, seed=1000 * me + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(base * slow)  # emulated heterogeneity
        opt.step()
        step += 1
    local = mps.stats()["local"]
    mps.shutdown()
    _result(rank=me, slow=slow, iterations=local["iterations"], rounds=opt.strategy.round,
            digest=_digest(_flat(model)))


# -- PS ---------------------------------------------------------------------------------------
def ps_updates_applied_once() -> None:
    """PS/ASP: the global model moves by exactly the sum of every worker's updates."""
    a = _args()
    steps = int(a.get("steps", 20))
    mps.init(policy=a.get("policy", "asp"), topology="ps", backend="mpi", server="dedicated",
          deadline=30)
    me, n = mps.rank(), mps.size()
    model = _model()
    w0 = _flat(model).clone()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(10 + me)
    mine = torch.zeros_like(w0)
    for step in range(steps):
        grads = []
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * (me + 1)
            grads.append(p.grad.reshape(-1))
        mine -= torch.cat(grads)  # SGD with lr 1: this step's update
        time.sleep(0.002 * (me + 1))  # unequal speeds: pushes interleave
        opt.step()
    total = mps.allreduce(mine, average=False)
    mps.shutdown()
    final = _flat(model)
    err = float((final - (w0 + total)).abs().max() / total.abs().max())
    _result(rank=me, rel_err=err, iterations=steps, digest=_digest(final), size=n)
    if err > 1e-9:
        raise AssertionError(f"global model moved by something else than the pushed updates: {err}")


def ps_init_waits_for_warm_shards() -> None:
    """PS: ``mps.init`` returns on every worker once every shard has loaded its compiled loop,
    here made to take 1.5 s (as a compile does, longer), so no trainer's clock runs while it
    loads."""
    from mpsync.server import shard_server
    from mpsync.torch import _runtime

    warm_up = shard_server.ShardServer.warm_up

    def slow_warm_up(self):
        time.sleep(1.5)
        return warm_up(self)

    shard_server.ShardServer.warm_up = slow_warm_up
    mps.init(policy="asp", topology="ps", backend="mpi", server="dedicated", deadline=30)
    thread = _runtime.context().shard_thread
    warmed = thread is None or thread.server.warmed.is_set()
    _result(rank=mps.rank(), hosts_a_shard=thread is not None, warmed=warmed)
    mps.shutdown()


# -- OSP --------------------------------------------------------------------------------------
def osp_run() -> None:
    """OSP on the ring.  ``ics=0``: the ICS share is 0 and OSP must equal BSP.  Otherwise the
    global model must move by exactly -lr x (mean over workers of the sum of their gradients):
    no gradient dropped, every ICS corrected (LGP, Eq. 7)."""
    a = _args()
    steps, batch, lr = int(a.get("steps", 12)), 4, 0.2
    frac = float(a.get("ics", 0.0))
    mps.init(policy="osp", backend=a.get("backend", "mpi"), server="dedicated", deadline=30,
          osp_ics_size="fixed", osp_ics_max_fraction=frac)
    me, n = mps.rank(), mps.size()
    model = _model()
    w0 = _flat(model).clone()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    if a.get("force_half"):  # without a server: a fixed bitmap, every other layer in ICS
        opt.strategy.bitmap = np.arange(opt.strategy.n_layers) % 2 == 1
    grad_sum = torch.zeros_like(w0)
    for step in range(steps):
        x, y = _data(n * batch, seed=100 + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[me * batch:(me + 1) * batch]),
                                          y[me * batch:(me + 1) * batch]).backward()
        grad_sum += torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        # Three "epochs" with a falling loss, so Alg. 1 opens ICS from the second one on.
        epoch = 1 + 3 * step // steps
        opt.strategy.note_progress(epoch, 1.0 / epoch)
        opt.step()
    ics_layers = opt.strategy.ics_layers_total
    opt.synchronize()
    mean_grads = mps.allreduce(grad_sum)
    expected = w0 - lr * mean_grads
    final = _flat(model)
    conservation = float((final - expected).abs().max() / (lr * mean_grads).abs().max())
    ref = _reference_sgd(steps, n, batch, lr, 0.0)
    mps.shutdown()
    _result(rank=me, ics_layers=ics_layers, conservation=conservation,
            vs_bsp=_max_rel(final, ref), digest=_digest(final))


# -- metrics collectives: allreduce sum, gather_object -----------------------------------------
def sum_and_gather() -> None:
    """``mps.allreduce(average=False)`` is a real SUM (exact for integers past 2**53 / N and
    for float values whose mean x N would round), and ``gather_object`` returns every worker's
    object on the root, in worker order, with a payload large enough to be sent by rendezvous."""
    a = _args()
    backend = a.get("backend", "mpi")
    mps.init(policy="bsp", backend=backend, server="dedicated", deadline=30)
    me, n = mps.rank(), mps.size()
    big = 2 ** 62 // (n + 1)  # exact in int64, not in float64
    got = mps.allreduce(torch.tensor([me + 1, big + me, -3], dtype=torch.int64), average=False)
    want = torch.tensor([n * (n + 1) // 2, n * big + n * (n - 1) // 2, -3 * n],
                        dtype=torch.int64)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    got32 = mps.allreduce(torch.tensor([7 * me, -1], dtype=torch.int32), average=False)
    assert got32.dtype == torch.int32
    assert got32.tolist() == [7 * n * (n - 1) // 2, -n], got32
    # 0.1 summed n times: a sum reduction gives what adding the values gives (up to the order
    # of additions), the average x n does not in general; compare with a tight tolerance.
    x = torch.tensor([0.1, 1e16, 1.0], dtype=torch.float64)
    got64 = mps.allreduce(x, average=False)
    want64 = torch.tensor([sum([0.1] * n), 1e16 * n, float(n)], dtype=torch.float64)
    assert got64[1] == want64[1] and got64[2] == want64[2], (got64, want64)
    assert abs(float(got64[0] - want64[0])) <= 4 * n * 2 ** -52, (got64, want64)
    got_f32 = mps.allreduce(torch.full((5,), 3.0, dtype=torch.float32), average=False)
    assert got_f32.dtype == torch.float32 and torch.equal(got_f32, torch.full((5,), 3.0 * n))
    avg = mps.allreduce(torch.tensor([float(me)], dtype=torch.float64))
    assert abs(float(avg[0]) - (n - 1) / 2) < 1e-12, avg
    # An integer average truncates toward zero, as Horovod's (sum x (1/n) in float64).
    five = 5 if me == 0 else 0
    iavg = mps.allreduce(torch.tensor([five, -five], dtype=torch.int64))
    assert iavg.dtype == torch.int64 and iavg.tolist() == [int(5 / n), -int(5 / n)], iavg
    payload = {"worker": me, "data": list(range(20_000 * (me + 1)))}  # 100s of KB pickled
    gathered = mps.gather_object(payload, root_rank=0)
    if me == 0:
        assert [g["worker"] for g in gathered] == list(range(n)), gathered
        assert all(g["data"] == list(range(20_000 * (w + 1))) for w, g in enumerate(gathered))
    else:
        assert gathered is None
    # Another root, a small object.
    small = mps.gather_object(me * 10, root_rank=n - 1)
    assert small == ([w * 10 for w in range(n)] if me == n - 1 else None), small
    mps.shutdown()
    _result(rank=me, size=n, backend=backend, int64=got.tolist(), float64=got64.tolist())


def gather_with_a_stopped_worker() -> None:
    """Worker ``victim`` stops (SIGSTOP) just before ``gather_object``: the root must not wait
    forever, but fail at the deadline naming it."""
    a = _args()
    # heartbeat=0: the state server's beats would name the stopped worker first.
    mps.init(policy="bsp", backend="mpi", server="dedicated",
             deadline=float(a.get("deadline", 5)), heartbeat_s=float(a.get("heartbeat", 0.5)))
    victim = int(a.get("victim", 1))
    mps.allreduce(torch.zeros(1, dtype=torch.float64))  # every worker is up
    if mps.rank() == victim:
        print(f"FAULT {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    mps.gather_object({"rank": mps.rank()}, root_rank=0, name="final metrics")
    raise AssertionError("gather_object returned although a worker was stopped")


# -- failures ------------------------------------------------------------
def _fault(kind: str) -> None:
    """BSP training on the mpi backend (or ``policy`` on ``topology``); at step 3 one rank
    suffers ``kind``.

    Prints ``FAULT <wall time>`` just before the fault so the test can measure the time from
    the fault to the end of the job.  ``deadline`` (seconds) bounds every collective wait;
    ``heartbeat`` (seconds, 0: off) is the workers' beat period.
    """
    a = _args()
    pids = MPI.COMM_WORLD.allgather(os.getpid())  # before init: the server rank's pid too
    deadline = a.get("deadline", "5")  # "default": the configuration's defaults
    beats = {"heartbeat_s": float(a["heartbeat"])} if "heartbeat" in a else {}
    mps.init(policy=a.get("policy", "bsp"), topology=a.get("topology", "ring"),
             backend=a.get("backend", "mpi"), server="dedicated", **beats,
             **({} if deadline == "default" else {"deadline": float(deadline)}))
    victim = int(a.get("victim", 1))  # a worker rank
    model = _model()
    if a.get("big"):  # 0.5 MB of float64 gradients: the mpi backend's communication thread
        model = torch.nn.Sequential(torch.nn.Linear(6, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 3)).double()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = _data(8)
    for step in range(10_000):
        if step == 3:
            if kind == "raise" and mps.rank() == victim:
                print(f"FAULT {time.time():.6f}", flush=True)
                raise RuntimeError(f"deliberate failure on worker {victim}")
            if kind in ("sigkill", "sigstop") and mps.rank() == victim:
                print(f"FAULT {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
            if kind == "kill_server" and mps.rank() == 0:
                print(f"FAULT {time.time():.6f}", flush=True)
                os.kill(pids[0], signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(0.01)
    raise AssertionError("training went on for 10,000 steps after the fault")


def fail_worker_raises() -> None:
    _fault("raise")


def fail_worker_sigkill() -> None:
    _fault("sigkill")


def fail_worker_sigstop() -> None:
    _fault("sigstop")


def fail_server_killed() -> None:
    _fault("kill_server")


def peer_notices() -> None:
    """Three ranks' ``PeerWatch`` notices over real messages: rank 1 announces a later
    collective than rank 0's, rank 2 the same number under another name (``case=past``: a
    later one too; ``silent``: none); then rank 0's timeout names each and where it
    waits."""
    from mpsync.torch.dataplane.waiting import PeerWatch

    world = MPI.COMM_WORLD
    watch = PeerWatch(world.Dup(), world_ranks=[0, 1, 2])
    me = world.Get_rank()
    case = _args().get("case", "mismatch")
    mine = {0: (7, "mpi final push (collective #7)"),
            1: (8, "mpi the PS shards' shutdown (collective #8)"),
            2: (7, "mpi final model (collective #7)")}[me]
    if me == 2 and case == "past":
        mine = (8, "mpi the PS shards' shutdown (collective #8)")
    if me != 2 or case != "silent":
        watch.announce(*mine)
    world.Barrier()                   # every notice sent before rank 0 reads them
    if me == 0:
        time.sleep(0.2)
        e = watch.timeout(mine[1], mine[0], 30.0)
        _result(message=str(e), silent=e.silent_ranks)
    world.Barrier()
    watch.comm.Free()


if __name__ == "__main__":
    # Script mode: ``python torch_programs.py NAME key=value ...``; no harness runner, so an
    # exception reaches mpsync's abort hook (installed by mps.init).
    globals()[sys.argv[1]]()
