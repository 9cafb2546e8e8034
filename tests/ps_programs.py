"""Rank programs for tests/test_ps_shards.py: the sharded parameter server on real ranks.

Run through the harness (``run_mpi("ps_programs:NAME", ...)``) or as a script for the fault
programs (``run_mpi(str(PROGRAMS), args=["NAME", ...])``), so mpsync's own abort machinery
ends the job.  Each program prints ``RESULT {...}`` per worker and raises on a wrong answer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402
from mpsync.server import wire as W  # noqa: E402

BASE = 1000   # worker j's pushes are counted in the j-th base-1000 digit of every coordinate


def _args() -> dict:
    return dict(a.partition("=")[::2] for a in sys.argv[1:] if "=" in a)


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _busy(seconds: float) -> None:
    """Compute in pure Python: holds the interpreter lock, so a shard thread on this rank
    gets it only at the interpreter's switch interval and its shard falls behind."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _decode(flat: np.ndarray, workers: int) -> np.ndarray:
    """Per coordinate, how many pushes of each worker the model holds: shape (numel, n)."""
    values = np.rint(flat).astype(np.int64)
    if not np.array_equal(values, flat):
        raise AssertionError("the model holds a value that is no sum of whole pushes")
    counts = np.empty((flat.size, workers), dtype=np.int64)
    for j in range(workers):
        values, counts[:, j] = np.divmod(values, BASE)
    if np.any(values):
        raise AssertionError("the model holds more pushes than the workers made")
    return counts


def counting_model():
    """A float64 model at 0 and SGD at lr 1 on it: a gradient of -BASE**j pushes BASE**j."""
    model = torch.nn.Linear(10, 6).double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    return model, opt


def staleness_over_shards() -> None:
    """SSP or DSSP on ``ps_shards`` shards, float64 model starting at 0: every push of
    worker j adds BASE**j to every coordinate, so each pull tells, per coordinate (per
    shard), how many pushes of each worker it holds.  Worker 0 is slow and computes in pure
    Python, so the shard on its rank lags behind the others.  After the k-th push, a pull
    must hold on *every* coordinate all k of this worker's pushes and at least k - bound of
    everyone's (the bound: s for SSP, s_U for DSSP), the whole-model rule; a shard whose
    updates the state server counted before they were applied would fail it, and so would
    a pull read without asking (``SyncClient.pull_is_sure``) that the rule would hold."""
    a = _args()
    policy, steps = a.get("policy", "ssp"), int(a.get("steps", 30))
    mps.init(policy=policy, topology="ps", backend="mpi", server="dedicated", deadline=60,
             ps_shards=int(a.get("ps_shards", 3)), staleness=2, staleness_low=1,
             staleness_high=3)
    bound = {"ssp": 2, "dssp": 3}.get(policy, steps)   # asp: none
    exchanges = _count_one_exchanges()
    server_calls = _count_server_calls()
    me, n = mps.rank(), mps.size()
    model, opt = counting_model()
    worst_gap, shards_differ = 0, 0
    for k in range(1, steps + 1):
        for p in model.parameters():
            p.grad = torch.full_like(p, -float(BASE ** me))   # lr 1: each push adds BASE**me
        if me == 0:
            _busy(0.03)
        opt.step()   # SSP/DSSP: every step pushes and pulls
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        counts = _decode(flat, n)
        if np.any(counts[:, me] != k):
            raise AssertionError(f"pull {k}: this worker's own pushes {counts[:, me]}")
        gap = int(k - counts.min())
        if gap > bound:
            bad = np.argwhere(k - counts > bound)[0]
            raise AssertionError(f"pull {k}: coordinate {bad[0]} holds {counts[bad[0]]} "
                                 f"pushes, worker {bad[1]} more than {bound} behind")
        worst_gap = max(worst_gap, gap)
        shards_differ += int(len({tuple(c) for c in counts}) > 1)
    # (before shutdown, whose last push and pull are separate requests)
    asked = {name: server_calls.get(getattr(W, name), 0)
             for name in ("PUSH", "PULL", "PUSH_PULL")}
    mps.shutdown()
    server = mps.stats(server=False)["server"]
    final = _decode(_flat_params(model).numpy(), n)
    if policy == "asp" and np.any(final != steps):
        raise AssertionError(f"after shutdown the model holds {final.min(axis=0)} to "
                             f"{final.max(axis=0)} pushes per worker, each made {steps}")
    _result(rank=me, worst_gap=worst_gap, bound=bound, torn_pulls=shards_differ,
            one_exchanges=exchanges[0], asked=asked,
            compiled=server["messages"]["compiled_push_pulls"] if server else None,
            controller_grants=sum(server["policy_state"].get("controller_grants", []))
            if server else None)


def _count_one_exchanges() -> list:
    """Count this worker's ``ShardClient.push_pull`` calls (push and pull in one exchange)."""
    from mpsync.torch import _runtime

    shards, calls = _runtime.context().shards, [0]
    exchange = shards.push_pull

    def counted(*args, **kw):
        calls[0] += 1
        return exchange(*args, **kw)

    shards.push_pull = counted
    return calls


def _count_server_calls() -> dict:
    """Count the requests this worker sends the state server and waits for, by wire tag."""
    from mpsync.torch import _runtime

    client, calls = _runtime.context().client, {}
    call = client._call

    def counted(tag, *args, **kw):
        calls[tag] = calls.get(tag, 0) + 1
        return call(tag, *args, **kw)

    client._call = counted
    return calls


def shard_fault() -> None:
    """ASP on the sharded PS; at step 5 the rank hosting shard ``victim`` is killed
    (``kind=sigkill``) or stopped (``kind=sigstop``); ``heartbeat``: the beat period (0:
    none); ``one_sided=0``: pushes and pulls as messages.  Prints ``FAULT <wall time>``
    first."""
    a = _args()
    kind, victim = a.get("kind", "sigkill"), int(a.get("victim", 1))
    mps.init(policy="asp", topology="ps", backend="mpi", server="dedicated",
             ps_shards=int(a.get("ps_shards", 3)), heartbeat_s=float(a.get("heartbeat", 0.5)),
             ps_one_sided=a.get("one_sided", "1") == "1")
    from mpsync.torch import _runtime

    host = _runtime.context().shard_layout.hosts[victim]
    model = torch.nn.Linear(8, 4)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    for step in range(100_000):
        if step == 5 and mps.rank() == host:
            print(f"FAULT {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(0.01)
    raise AssertionError("training went on after the fault")


def bytes_accounted() -> None:
    """ASP on 2 shards, float32 model (``bf16=1``: bfloat16, on a bfloat16 wire as across
    nodes unless ``bf16_wire=auto``: one host's choice), ``steps`` steps (one push and one
    pull each), with or without Compression.fp16: the data bytes each worker counted are
    exactly the model on the wire per push and per pull (plus the first pull, and worker 0's
    initial weights in float32, the store's dtype), the analytic minimum is 2·B per step, and
    control bytes were counted."""
    a = _args()
    steps, fp16, bf16 = int(a.get("steps", 6)), a.get("fp16") == "1", a.get("bf16") == "1"
    bf16_wire = bf16 and a.get("bf16_wire") != "auto"
    mps.init(policy="asp", topology="ps", backend="mpi", server="dedicated", deadline=60,
             ps_shards=2)
    me = mps.rank()
    model = torch.nn.Linear(50, 20)          # 1,020 float32 elements
    if bf16:
        from mpsync.torch.strategies.ps import ParameterServer
        ParameterServer.bfloat16_wire = True if bf16_wire else None
        model = model.to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    compression = mps.Compression.fp16 if fp16 else mps.Compression.none
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 50, dtype=model.weight.dtype)).sum().backward()
        opt.step()
    local = mps.stats()["local"]
    mps.shutdown()
    if not all(p.dtype == start[0].dtype and not torch.equal(p, s)
               for p, s in zip(model.parameters(), start)):
        raise AssertionError("the model did not train, or left its dtype")
    model_bytes = 1020 * 4
    wire = model_bytes // 2 if fp16 or bf16_wire else model_bytes
    expect = {"data_sent": steps * wire + (model_bytes if me == 0 else 0),
              "data_received": (steps + 1) * wire, "data_min": 2 * steps * wire}
    got = {k: local[k] for k in expect}
    _result(rank=me, **got, control_sent=local["control_sent"],
            control_received=local["control_received"], shard_sent=local["shard_sent"])
    if got != expect:
        raise AssertionError(f"bytes counted {got}, expected {expect}")


def bad_shards() -> None:
    """``ps_shards`` larger than the model: a clear error before any shard is used."""
    mps.init(policy="asp", topology="ps", backend="mpi", server="dedicated",
             ps_shards=int(_args().get("ps_shards", 3)))
    model = torch.nn.Linear(1, 1, bias=False)   # one parameter element
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()   # raises on every worker, before anything is sent
    raise AssertionError("a model smaller than the shard count was accepted")


def _delay_pulls(seconds: float) -> None:
    """Open the window the barrier/round rules must close: this worker's reads of the shards
    start ``seconds`` after the state server granted them, so the others' next pushes can
    reach the shards before it reads (a slow link or a busy rank does the same)."""
    from mpsync.torch import _runtime

    shards = _runtime.context().shards
    read = shards.pull

    def late_read(*args, **kw):
        time.sleep(seconds)
        return read(*args, **kw)

    shards.pull = late_read


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().numpy().tobytes()).hexdigest()[:16]


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ebsp_barrier_weights() -> None:
    """ElasticBSP on the PS, 2 workers at speeds 1:4 (10 and 40 ms per iteration), the slow
    one's reads of the shards ``delay`` seconds late: at every barrier both must hold
    bitwise-identical weights (ZipLine §6.2.5), although the fast worker pushes again right
    after its own barrier pull.  Prints the digest of the weights after each barrier."""
    a = _args()
    rounds, delay = int(a.get("rounds", 5)), float(a.get("delay", 0.06))
    mps.init(policy="ebsp", topology="ps", backend="mpi", server="dedicated", lookahead=8,
             deadline=60)
    me = mps.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    if me == 1:
        _delay_pulls(delay)
    at_barrier, step = [], 0
    while opt.strategy.round < rounds:
        g = torch.Generator().manual_seed(1000 * me + step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.04 if me == 1 else 0.01)
        before = opt.strategy.round
        opt.step()
        step += 1
        if opt.strategy.round > before:
            at_barrier.append(_digest(_flat_params(model)))
    opt.synchronize()
    mps.shutdown()
    _result(rank=me, at_barrier=at_barrier, steps=step)


def esync_join_rounds() -> None:
    """ESync on the PS, 3 workers; worker 2 (the fastest) stops one local iteration after
    round ``join_at`` and joins while the others train to round ``rounds``; the others' reads
    of the shards are ``delay`` seconds late.  Every worker must start every round from
    bitwise-identical weights, also the rounds around the join (those of the joined worker
    run inside ``join()``).  Prints the digest of the weights after each round, by round."""
    a = _args()
    rounds, join_at = int(a.get("rounds", 6)), int(a.get("join_at", 2))
    delay = float(a.get("delay", 0.15))
    mps.init(policy="esync", topology="ps", backend="mpi", server="dedicated", deadline=60)
    me = mps.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    strategy = opt.strategy
    after_round: dict[int, str] = {}
    aggregate = strategy._aggregate

    def recorded(*args, **kw):
        out = aggregate(*args, **kw)
        after_round[strategy.round] = _digest(torch.from_numpy(strategy._base.copy()))
        return out

    strategy._aggregate = recorded
    if me != 2:
        _delay_pulls(delay)
    step = 0

    def train_step() -> None:
        nonlocal step
        g = torch.Generator().manual_seed(1000 * me + step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep((0.005, 0.02, 0.002)[me])
        opt.step()
        step += 1

    while strategy.round < (join_at if me == 2 else rounds):
        train_step()
    while me == 2:   # a local iteration after the round: an update left for join() to push
        before = strategy.round
        train_step()
        if strategy.round == before:
            break
    opt.synchronize()
    mps.shutdown()
    _result(rank=me, after_round={str(k): v for k, v in sorted(after_round.items())},
            steps=step)


def stopped_at_join() -> None:
    """SSP on the sharded PS (2 shards on workers 0 and 1), a time budget of ``budget``
    seconds; worker ``victim`` (which hosts no shard) stops itself (SIGSTOP) ``stop_at``
    seconds in and never comes back.  The state server takes it out after ``silent``
    seconds and the others train on to the budget, printing ``STEP <wall time>`` per step,
    then ``BUDGET_END <wall time>``, and join: the join must end the job (a
    DeadlineExceeded naming the stopped worker, through the abort hook) instead of waiting
    for it for ever."""
    a = _args()
    victim, budget = int(a.get("victim", 2)), float(a.get("budget", 8))
    stop_at = float(a.get("stop_at", 1.5))
    mps.init(policy="ssp", topology="ps", backend="mpi", server="dedicated", staleness=2,
             ps_shards=2, deadline=float(a.get("deadline", 5)),
             silent_timeout=float(a.get("silent", 2)))
    from mpsync.torch import _runtime

    me = mps.rank()
    if victim in _runtime.context().shard_layout.hosts:
        raise AssertionError(f"worker {victim} hosts a shard; this program stops one that "
                             f"does not")
    model = torch.nn.Linear(8, 4)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    start = time.monotonic()
    while time.monotonic() - start < budget:
        if me == victim and time.monotonic() - start > stop_at:
            print(f"FAULT {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        print(f"STEP {time.time():.6f}", flush=True)
        time.sleep(0.02)
    print(f"BUDGET_END {time.time():.6f}", flush=True)
    mps.shutdown()
    raise AssertionError("shutdown returned although a worker had stopped")


def bsp_round_left_out() -> None:
    """BSP with SGD on 2 shards, 3 workers (a dedicated server): worker 2 falls silent in its
    step 3 for longer than the silence timeout, so the state server grants round 3 without
    it (its pulls name worker 2 left out), then worker 2 comes back and trains on.  The model
    is two equal halves, one per shard, whose gradients are equal: where every shard stepped
    on the same pushes in every round, the halves end equal (to the rounding of sums whose
    pushes came in another order; a push in another round moves a half by about 0.01)."""
    mps.init(policy="bsp", topology="ps", backend="mpi", server="dedicated", ps_shards=2,
             ps_optimizer="server", silent_timeout=1.0, deadline=60)
    me, m = mps.rank(), 64
    p = torch.nn.Parameter(torch.ones(2 * m, dtype=torch.float64))
    opt = mps.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)])
    x = torch.linspace(-1.0, 1.0, m, dtype=torch.float64) * (me + 1)
    for step in range(8):
        opt.zero_grad()
        ((p[:m] * x).sin().sum() + (p[m:] * x).sin().sum()).backward()
        if me == 2 and step == 3:
            time.sleep(3.0)
        opt.step()
    opt.synchronize()
    mps.shutdown()
    flat = p.detach()
    _result(rank=me, halves_equal=bool(torch.allclose(flat[:m], flat[m:], rtol=0, atol=1e-12)),
            moved=bool(not torch.equal(flat, torch.ones_like(flat))))


def pulls_land_in_the_parameters() -> None:
    """ASP on 2 shards, a float64 model, gradients set by hand (worker r's are r + 1 times a
    power of two, so every sum is exact): the parameters share one storage (each is its
    view of the flat tensor a pull lands in), and the final model holds every push exactly
    once, also where the script rebound one parameter's ``.data`` mid-run (``rebind=1``).
    ``server=1``: the shards run the optimizer."""
    a = _args()
    steps, rebind = int(a.get("steps", 6)), a.get("rebind") == "1"
    mps.init(policy="asp", topology="ps", backend="mpi", server="dedicated", deadline=60,
             ps_shards=2, ps_optimizer="server" if a.get("server") == "1" else "worker")
    me, workers = mps.rank(), mps.size()
    torch.manual_seed(0)    # one starting model (the shards start from worker 0's)
    model = torch.nn.Linear(30, 7).double()
    start = [p.detach().clone() for p in model.parameters()]
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    shared = []
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.25 * (me + 1))
        opt.step()
        shared.append(len({p.untyped_storage().data_ptr() for p in model.parameters()}))
        if rebind and step == steps // 2:
            model.weight.data = model.weight.data.clone()
    opt.synchronize()
    mps.shutdown()
    moved = 0.5 * 0.25 * steps * sum(r + 1 for r in range(workers))
    exact = all(torch.equal(p.detach(), s - moved) for p, s in zip(model.parameters(), start))
    _result(rank=me, shared=shared, exact=exact)
    if not exact:
        raise AssertionError("the final model does not hold every push exactly once")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
