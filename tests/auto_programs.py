"""Rank programs for tests/test_auto_switch.py and tests/test_auto_ring_only.py: ``auto``'s
switches on real ranks.

Each program prints one ``RESULT {...}`` JSON line per worker rank (run through
``run_mpi("auto_programs:NAME", ...)``).
"""

from __future__ import annotations

import json
import sys
import time

import torch

torch.set_num_threads(1)

import mpsync.torch as mps  # noqa: E402
from torch_programs import _args, _data, _digest, _flat, _model  # noqa: E402


def _step(model, opt, me: int, step: int, pause: float) -> None:
    """One training step of worker ``me`` on its ``step``-th batch of 8, ``pause`` seconds
    of extra compute before the optimizer's step."""
    x, y = _data(8, seed=1000 * me + step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    time.sleep(pause)
    opt.step()


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def planned_switches() -> None:
    """Policy ``auto`` following a fixed plan of switches (every kind it can make), worker 0
    three times slower so ESync's and ElasticBSP's rounds hold uneven numbers of local steps.
    Each worker records its weights after every round and at every switch, and what it applied:
    with plain SGD (momentum 0, ε = 1) every policy moves the model by the mean over workers of
    the updates each applied (BSP: the mean gradient step; ESync and ElasticBSP: the mean
    delta of the local steps), so the final model must be w0 plus the mean of every update any
    worker applied, none lost at a switch, none counted twice.  On the parameter server (ASP,
    SSP, DSSP apply each worker's update as it is) the model moves by the sum of the updates
    instead: the reference is w0 + the mean of the ring's updates + the sum of the PS's."""
    a = _args()
    rounds, lr, momentum = int(a["rounds"]), 0.05, float(a.get("momentum", 0))
    mps.init(policy="auto", topology="ring", backend="mpi", server="dedicated",
             auto_plan=a["plan"], deadline=60)
    model = _model()
    w0 = _flat(model).clone()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr,
                                                   momentum=momentum),
                                   named_parameters=model.named_parameters())
    me = mps.rank()
    applied = {"ring": torch.zeros_like(w0), "ps": torch.zeros_like(w0)}
    after_round, policy_of_round, topology_of_round, step = {}, {}, {}, 0
    while opt.strategy.round < rounds:
        x, y = _data(8, seed=1000 * me + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.03 if me == 0 else 0.01)
        applied[opt.strategy.topology] -= lr * torch.cat([p.grad.reshape(-1)
                                                          for p in model.parameters()])
        before, policy, topology = opt.strategy.round, opt.strategy.policy, \
            opt.strategy.topology
        opt.step()
        step += 1
        if opt.strategy.round > before:
            after_round[opt.strategy.round] = _digest(_flat(model))
            policy_of_round[opt.strategy.round] = policy
            topology_of_round[opt.strategy.round] = topology
    server = mps.stats()["server"] if me == 0 else None
    opt.synchronize()
    moved = mps.allreduce(applied["ring"]) + mps.allreduce(applied["ps"], op=mps.Sum)
    mps.shutdown()
    final = _flat(model)
    err = float((final - (w0 + moved)).abs().max() / moved.abs().max())
    state = (server or {}).get("policy_state") or {}
    _result(rank=me, steps=step, rel_err=err, digest=_digest(final),
            after_round=after_round, policy_of_round=policy_of_round,
            topology_of_round=topology_of_round,
            switches=opt.strategy.switches, timeline=state.get("policy_timeline"),
            decisions=state.get("decisions"))


def stopped_in_gathering() -> None:
    """``auto`` on the PS (plan: ASP after round 2, BSP after round 5): worker 1 stops (falls
    silent, its process alive) at its first step on the PS, so the round the server makes to
    leave the PS can never gather everyone.  The job must end, naming it, not hang."""
    mps.init(policy="auto", topology="ring", backend="mpi", server="dedicated",
             auto_plan="2:asp,5:bsp", deadline=20, silent_timeout=3)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    me = mps.rank()
    for step in range(400):
        if me == 1 and opt.strategy.topology == "ps":
            print("STOPPED", flush=True)
            time.sleep(600)
        x, y = _data(8, seed=1000 * me + step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.01)
        opt.step()
    _result(rank=me, finished=True)


def ring_only() -> None:
    """``auto`` with ``auto_ps`` (the default) in a job that cannot host the parameter
    server: run under ``MPI4PY_RC_THREAD_LEVEL=serialized`` (no MPI_THREAD_MULTIPLE), or with
    ``mixed=1`` a model holding a float64 and a float32 parameter (``backend=``: the ring's
    transport, default mpi).  It must go on, switching on
    the ring only (plan: ElasticBSP after round 2, BSP after round 4), and say why."""
    from mpi4py import MPI

    a = _args()
    mps.init(policy="auto", topology="ring", backend=a.get("backend", "mpi"),
             server="dedicated", auto_plan="2:ebsp,4:bsp", deadline=60)
    model = _model()
    if a.get("mixed") == "1":
        model[-1].bias.data = model[-1].bias.data.to(torch.float32)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    me, step = mps.rank(), 0
    while opt.strategy.round < 6:
        x, y = _data(8, seed=1000 * me + step)
        opt.zero_grad()
        out = model[:-1](x)
        loss = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(out, model[-1].weight, model[-1].bias.to(out.dtype)), y)
        loss.backward()
        time.sleep(0.01)
        opt.step()
        step += 1
    opt.synchronize()
    state = mps.stats()["server"].get("policy_state") or {}
    mps.shutdown()
    _result(rank=me, steps=step, thread_level=MPI.Query_thread(), digest=_digest(_flat(model)),
            ring_only=state.get("ring_only"), timeline=state.get("policy_timeline"),
            topologies=(state.get("metrics") or {}).get("auto_topologies"),
            switches=[(s["from"], s["to"]) for s in opt.strategy.switches])


def _loss_ps_faster_then_diverging(t0: float, on_ps_since: float | None) -> float:
    """The training loss ``diverging_on_the_ps`` reports: 2.3 falling with a time constant of
    5 s on the ring, 3x faster once on the PS, back to 2.3 (a diverged run) after 4 s there.
    Faster on the PS, so that the switch's confirmation (its measured progress, 4 s after it)
    keeps the PS whatever the PS's first iterations cost: with the ring's rate kept there, a
    run whose first PS iterations were slow (compiling) was sent back by its confirmation
    before the loss watch saw the loss rise, and the test had nothing to test."""
    import math

    now = time.perf_counter()
    if on_ps_since is None:
        return 2.3 * math.exp(-(now - t0) / 5.0)
    if now - on_ps_since > 4.0:
        return 2.3
    return 2.3 * math.exp(-(on_ps_since - t0) / 5.0 - 3.0 * (now - on_ps_since) / 5.0)


def diverging_on_the_ps() -> None:
    """``auto`` deciding (no plan) at equal speeds on a job without gradient noise, where it
    moves to the parameter server;
    each worker reports a converging training loss (``report_loss``, as ``mpsync train``
    does) until it has run 4 s on the PS, then the loss of a diverged run.  The server must
    leave the PS for the ring, and the ring restart from the weights the lowest worker held
    on the PS before the loss rose.  Each worker records the digest of its
    weights after every step on the PS (``weights_digest``: the switch records' digest)."""
    from mpsync.torch.strategies.switching import weights_digest

    a = _args()
    mps.init(policy="auto", topology="ring", backend="mpi", server="dedicated", deadline=60)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    me, step, t0, on_ps_since = mps.rank(), 0, time.perf_counter(), None
    on_ps, rolled = [], None
    budget = float(a.get("budget", "60"))
    # Every step on one worker sees the same batch, and so does its probe: its gradient has
    # no sampling noise, so the gain of the PS's full updates the job measures
    # (mpsync.auto.noise) is n and the ranking moves it to the PS, which this test needs.
    x, y = _data(64, seed=1000 * me)
    while time.perf_counter() - t0 < budget:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.probe_gradient_noise(lambda: torch.nn.functional.cross_entropy(model(x), y)
                                 .backward())
        time.sleep(0.02)
        opt.report_loss(_loss_ps_faster_then_diverging(t0, on_ps_since))
        opt.step()
        step += 1
        if opt.strategy.topology == "ps":
            on_ps_since = on_ps_since or time.perf_counter()
            on_ps.append(weights_digest(opt.strategy.buffers))
        rolled = next((s for s in opt.strategy.switches if "rolled_back_s" in s), None)
        if rolled is not None and opt.strategy.round >= rolled["round"] + 3:
            break
    opt.synchronize()
    server = mps.stats()["server"]
    mps.shutdown()
    state = server.get("policy_state") or {}
    _result(rank=me, steps=step, on_ps=on_ps, rolled=rolled, digest=_digest(_flat(model)),
            switches=opt.strategy.switches, decisions=state.get("decisions"),
            timeline=state.get("policy_timeline"))


def idle_after_join() -> None:
    """``auto`` on the ring only, both workers at 0.15 s iterations for 5 s; then worker 1
    stops and joins (``synchronize``) while worker 0 trains 5 s more.  Worker 1's idle
    iterations go at most 50 ms apart (it answers the others' rounds quickly); what they
    report is its usual iteration, not a worker 3x faster."""
    mps.init(policy="auto", topology="ring", backend="mpi", server="dedicated",
             auto_ps=False, deadline=60)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    me, step, t0 = mps.rank(), 0, time.perf_counter()
    until = 5.0 if me == 1 else 10.0
    while time.perf_counter() - t0 < until:
        _step(model, opt, me, step, pause=0.15)
        step += 1
    opt.synchronize()
    server = mps.stats()["server"]
    mps.shutdown()
    state = server.get("policy_state") or {}
    _result(rank=me, steps=step, decisions=state.get("decisions"))


def switch_while_joined() -> None:
    """``auto`` from the ring, planned to go to SSP on the PS after round 4: worker 1 stops
    after 2 steps and joins (``synchronize``); worker 0 trains until it runs on the PS, then 5
    steps more, 30 s at most.  The switch reaches worker 1 inside its join on the ring."""
    mps.init(policy="auto", topology="ring", backend="mpi", server="dedicated",
             auto_plan="4:ssp", deadline=30)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    me, step, t0, on_ps = mps.rank(), 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < 30 and (step < 2 if me == 1 else on_ps < 5):
        _step(model, opt, me, step, pause=0.02)
        step += 1
        on_ps += opt.strategy.topology == "ps"
    opt.synchronize()
    mps.shutdown()
    _result(rank=me, steps=step, digest=_digest(_flat(model)), topology=opt.strategy.topology,
            switches=[(s["from_topology"], s["to_topology"]) for s in opt.strategy.switches])


if __name__ == "__main__":
    globals()[sys.argv[1]]()


def loss_reports() -> None:
    """A script's own loop under ``auto`` reporting its loss (``opt.report_loss``): a tensor
    each step, every 0.02 s, for 1.5 s and 8 reports; bad arguments first (each must be
    refused); the learning rate cut 10x at step 5 (a step schedule)."""
    mps.init(policy="auto", topology="ring", backend="mpi", server="dedicated", deadline=60)
    model = _model()
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    refused = []
    for bad, kw in ((torch.ones(2), {}), (1.0, {"epoch": 0})):
        try:
            opt.report_loss(bad, **kw)
        except ValueError as e:
            refused.append(str(e))
    # 1.5 s of reports and 8 reports at least, 20 s at most.  Counted from the first report,
    # not the loop's start: the first step can take most of a second (a cold cache compiles,
    # torch imports its compiler stack at the optimizer's first step), and the server's loss
    # watch needs a full second of reports for its first window.
    # The watch's first window also needs 1 s of reports on the server's clock: a server
    # busy at the start (a cold cache compiles its kernels) receives the first reports in one
    # burst, so the loop also runs until the server says the window is full (asked 4x a second).
    t0, step, first = time.perf_counter(), 0, None
    asked, watch_full = 0.0, False
    while time.perf_counter() - t0 < 20 and (
            first is None or time.perf_counter() - first < 1.5
            or mps.stats(server=False)["local"]["loss_reports"] < 8 or not watch_full):
        if first is not None and time.perf_counter() - asked > 0.25:
            asked = time.perf_counter()
            state = mps.stats()["server"].get("policy_state") or {}
            watch_full = (state.get("training_loss") or {}).get("initial") is not None
        x, y = _data(8, seed=1000 * mps.rank() + step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step == 5:
            for group in opt.param_groups:
                group["lr"] *= 0.1
        opt.report_loss(loss, epoch=1)
        if first is None:
            first = time.perf_counter()
        x2, y2 = _data(8, seed=1000 * mps.rank() + step + 500)
        opt.probe_gradient_noise(
            lambda: torch.nn.functional.cross_entropy(model(x2), y2).backward())
        time.sleep(0.02)
        opt.step()
        step += 1
    opt.synchronize()
    stats = mps.stats()
    server = stats["server"]
    mps.shutdown()
    _result(rank=mps.rank(), steps=step, refused=refused, sent=stats["local"]["loss_reports"],
            seconds=time.perf_counter() - t0,
            training_loss=(server.get("policy_state") or {}).get("training_loss"),
            rate_changes=(server.get("policy_state") or {}).get("learning_rate_changes"),
            gradient_noise=(server.get("policy_state") or {}).get("gradient_noise"))


def stride_reports(optimizer: str = "sgd") -> None:
    """A script's own loop under ``auto`` (BSP on the ring to start) whose probe closure
    returns its loss, SGD with momentum: the step test runs beside the noise probe until the
    server has a reading's worth of strides (``mpsync.auto.curvature.MIN_PAIRS``) or 20 s;
    each worker reports the server's step-test readings and its final weights' digest (the
    probes restore the weights exactly: the ring's replicas stay equal).  ``optimizer``
    "adam": no step test; the loop runs until the server has heard so from every worker."""
    from mpsync.auto.curvature import MIN_PAIRS

    mps.init(policy="auto", topology="ring", backend="mpi", server="dedicated", deadline=60,
             auto_ps=False)
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=0.001) if optimizer == "adam" else \
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = mps.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    t0, step, strides, told = time.perf_counter(), 0, 0, 0
    while time.perf_counter() - t0 < 20 and (step < 40 or (
            told < mps.size() if optimizer == "adam" else strides < MIN_PAIRS)):
        x, y = _data(8, seed=1000 * mps.rank() + step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.report_loss(loss, epoch=1)
        x2, y2 = _data(8, seed=1000 * mps.rank() + step + 500)

        def second():
            other = torch.nn.functional.cross_entropy(model(x2), y2)
            other.backward()
            return other

        opt.probe_gradient_noise(second)
        time.sleep(0.02)
        opt.step()
        step += 1
        if step % 10 == 0:
            state = mps.stats()["server"].get("policy_state") or {}
            strides = max([s["pairs"] for s in state.get("step_test") or ()] + [0])
            told = len(state.get("adaptive_workers") or ())
    opt.synchronize()
    state = mps.stats()["server"].get("policy_state") or {}
    digest = _digest(_flat(model))
    mps.shutdown()
    _result(rank=mps.rank(), steps=step, digest=digest, step_test=state.get("step_test"),
            gradient_noise=state.get("gradient_noise"),
            adaptive_workers=state.get("adaptive_workers"))


def adaptive_reports() -> None:
    """``stride_reports`` with Adam."""
    stride_reports("adam")
