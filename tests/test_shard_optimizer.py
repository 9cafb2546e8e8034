"""The shards' optimizer (mpsync.server.shard_optimizer) against torch.optim on the same numbers,
in one process: SGD (momentum, dampening, Nesterov, weight decay), Adam (weight decay,
amsgrad), AdamW; a round's merge-then-step against one step on the mean gradient; settings
taken from torch param groups, their wire form, and what is refused; BSP's rounds counted per
worker; a checkpoint's state saved and restored."""

import math

import numpy as np
import pytest
import torch

from mpsync.server.shard_optimizer import (OptimizerSettings, ShardOptimizer,
                                           UnsupportedOptimizer, pack_state,
                                           settings_from_group)

CASES = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.8, "dampening": 0.3}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.Adam, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
]


def _ids(case):
    cls, kw = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_steps_equal_torch_optim_over_20_steps_in_float64(case):
    cls, kw = case
    rng = np.random.default_rng(7)
    w0 = rng.normal(size=257)
    grads = rng.normal(size=(20, 257)) * np.geomspace(1, 1e-3, 20)[:, None]
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = cls([p], **kw)
    ours = ShardOptimizer(settings_from_group(cls.__name__, opt.param_groups[0]), w0.size)
    w = w0.copy()
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        ours.step(w, g)
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-12, atol=1e-15)
    assert not np.allclose(w, w0)


def _numpy_steps(cls, kw, w, grads):
    """The shard's steps as numpy operations, one pass each (what the compiled pass fuses)."""
    s = settings_from_group(cls.__name__.lower(), {**_DEFAULTS[cls], **kw})
    m = v = vmax = None
    for t, grad in enumerate(grads, start=1):
        g = grad.copy()
        if s.kind == "sgd":
            if s.weight_decay:
                g += w * s.weight_decay
            if s.momentum:
                m = g.copy() if m is None else m * s.momentum + g * (1.0 - s.dampening)
                g = g + m * s.momentum if s.nesterov else m
            w = w - g * s.lr
            continue
        if s.weight_decay:
            if s.kind == "adamw":
                w = w * (1.0 - s.lr * s.weight_decay)
            else:
                g += w * s.weight_decay
        m = (np.zeros_like(w) if m is None else m) * s.beta1 + g * (1.0 - s.beta1)
        v = (np.zeros_like(w) if v is None else v) * s.beta2 + (g * g) * (1.0 - s.beta2)
        if s.amsgrad:
            vmax = np.maximum(np.zeros_like(w) if vmax is None else vmax, v)
        denominator = np.sqrt(vmax if s.amsgrad else v) * (1.0 / math.sqrt(1.0 - s.beta2 ** t)) + s.eps
        w = w - (m / denominator) * (s.lr / (1.0 - s.beta1 ** t))
    return w


_DEFAULTS = {torch.optim.SGD: {"momentum": 0, "dampening": 0, "nesterov": False,
                               "weight_decay": 0},
             torch.optim.Adam: {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0,
                                "amsgrad": False},
             torch.optim.AdamW: {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                                 "amsgrad": False}}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_the_compiled_step_is_numpys_operations_to_the_bit(case, dtype):
    cls, kw = case
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(1_001).astype(dtype)
    grads = [rng.standard_normal(1_001).astype(dtype) for _ in range(6)]
    settings = settings_from_group(cls.__name__.lower(), {**_DEFAULTS[cls], **kw})
    opt = ShardOptimizer(settings, w0.size, dtype)
    w = w0.copy()
    for grad in grads:
        opt.step(w, grad)
    np.testing.assert_array_equal(w, _numpy_steps(cls, kw, w0.copy(), grads))


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_float32_state_stays_float32_and_tracks_torch(cls):
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=64).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = cls([p], lr=0.01, **({"momentum": 0.9} if cls is torch.optim.SGD else {}))
    ours = ShardOptimizer(settings_from_group(cls.__name__, opt.param_groups[0]), 64,
                          np.float32)
    w = w0.copy()
    for _ in range(10):
        g = rng.normal(size=64).astype(np.float16)   # a float16 wire gradient
        p.grad = torch.from_numpy(g.astype(np.float32))
        opt.step()
        ours.step(w, g)
    assert w.dtype == np.float32
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_round_kept_then_settled_is_one_step_on_the_mean_gradient():
    from mpsync.server.shard_optimizer import ServerUpdates

    rng = np.random.default_rng(11)
    settings = OptimizerSettings(kind="adam", lr=0.01)
    w_round, w_mean = np.ones(33), np.ones(33)
    rounds, direct = ServerUpdates(per_round=True), ShardOptimizer(settings, 33)
    rounds.configure(settings.to_array())
    for _ in range(5):
        pushes = rng.normal(size=(3, 33))
        for worker, g in enumerate(pushes):
            rounds.take(w_round, g, worker)
        assert rounds.settle(w_round, None)
        direct.step(w_mean, pushes.mean(axis=0))
    np.testing.assert_allclose(w_round, w_mean, rtol=1e-14)
    before = w_round.copy()
    assert not rounds.settle(w_round, None)      # nothing kept: no step
    np.testing.assert_array_equal(w_round, before)
    assert rounds.optimizer.steps == 5


def test_a_new_learning_rate_keeps_the_state_as_torch_does():
    rng = np.random.default_rng(5)
    p = torch.nn.Parameter(torch.zeros(16, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    ours = ShardOptimizer(settings_from_group("SGD", opt.param_groups[0]), 16)
    w = np.zeros(16)
    for step in range(6):
        if step == 3:
            opt.param_groups[0]["lr"] = 0.01
            ours.configure(settings_from_group("SGD", opt.param_groups[0]))
        g = rng.normal(size=16)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        ours.step(w, g)
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-13)
    with pytest.raises(UnsupportedOptimizer, match="cannot change from sgd to adam"):
        ours.configure(OptimizerSettings(kind="adam"))


def test_settings_travel_as_a_float64_vector_and_back():
    s = settings_from_group("AdamW", torch.optim.AdamW([torch.zeros(1)], lr=0.002,
                                                        amsgrad=True).param_groups[0])
    assert s.kind == "adamw" and s.weight_decay == 0.01 and s.amsgrad is True
    wire = s.to_array()
    assert wire.dtype == np.float64
    assert OptimizerSettings.from_array(wire) == s
    with pytest.raises(UnsupportedOptimizer, match="expected"):
        OptimizerSettings.from_array(wire[:-1])
    bad = wire.copy()
    bad[0] = 7
    with pytest.raises(UnsupportedOptimizer, match="unknown kind"):
        OptimizerSettings.from_array(bad)


def test_what_the_shards_cannot_run_is_refused_with_the_way_out():
    with pytest.raises(UnsupportedOptimizer, match="not 'rmsprop'.*ps_optimizer='worker'"):
        settings_from_group("RMSprop", {"lr": 0.1})
    with pytest.raises(UnsupportedOptimizer, match="maximize"):
        settings_from_group("SGD", torch.optim.SGD([torch.zeros(1)], lr=0.1,
                                                   maximize=True).param_groups[0])
    with pytest.raises(UnsupportedOptimizer, match="nesterov"):
        OptimizerSettings(kind="sgd", nesterov=True)
    with pytest.raises(UnsupportedOptimizer, match="beta2"):
        OptimizerSettings(kind="adam", beta2=1.0)
    opt = ShardOptimizer(OptimizerSettings(), 4)
    with pytest.raises(ValueError, match="gradient of 3 elements for a range of 4"):
        opt.step(np.zeros(4), np.zeros(3))


def test_server_updates_step_per_push_or_once_per_round_and_refuse_what_they_cannot_use():
    from mpsync.server.shard_optimizer import ServerUpdates

    settings = OptimizerSettings(kind="sgd", lr=0.5, momentum=0.9)
    w = np.ones(4)
    per_push = ServerUpdates(per_round=False)
    assert per_push.take(w, np.ones(4), 0) == "a gradient before the optimizer's settings"
    assert per_push.configure(settings.to_array()[:3]) is not None   # malformed: refused
    assert per_push.configure(settings.to_array()) is None
    assert per_push.take(w, np.ones(3), 0) == "push before ps_init or of the wrong length"
    assert per_push.take(w, np.array([1.0, np.nan, 0, 0]), 0) == "push with NaN or inf"
    np.testing.assert_array_equal(w, np.ones(4))         # nothing refused moved the weights
    assert per_push.take(w, np.ones(4), 0) is None
    np.testing.assert_allclose(w, 0.5)                    # stepped on arrival
    assert not per_push.settle(w, 0)

    rounds = ServerUpdates(per_round=True)
    rounds.configure(settings.to_array())
    w = np.ones(4)
    assert rounds.take(w, np.full(4, 1.0), 0) is None and rounds.take(w, np.full(4, 3.0), 1) is None
    np.testing.assert_array_equal(w, np.ones(4))         # merged, not yet stepped
    assert rounds.pending and rounds.settle(w, 0) == 0   # a pull told no round: a read
    assert rounds.settle(w, 1) == 1                      # round 1's first pull: one step
    np.testing.assert_allclose(w, 1 - 0.5 * 2.0)         # one step on the mean, 2
    assert not rounds.pending and not rounds.settle(w, 1)
    assert rounds.configure(OptimizerSettings(kind="adam").to_array()) is not None


def _adam_rounds(*rounds_of_pushes, w0=1.0):
    """The weights after single-process Adam on each round's mean gradient."""
    opt, w = ShardOptimizer(OptimizerSettings(kind="adam", lr=0.1), 3), np.full(3, w0)
    for pushes in rounds_of_pushes:
        opt.step(w, np.mean(pushes, axis=0))
    return w


def test_a_pull_reads_its_own_round_whatever_the_other_workers_pushed_since():
    """The orders the state server does not rule out: a worker's first pull (round 0) after
    the others' first pushes, a joined worker's last pull (told no round) after the others'
    next pushes, a worker taken out and back, whose push the round it missed left out."""
    from mpsync.server.shard_optimizer import ServerUpdates

    g = {w: np.full(3, float(w + 1)) for w in range(3)}
    rounds = ServerUpdates(per_round=True)
    rounds.configure(OptimizerSettings(kind="adam", lr=0.1).to_array())
    w = np.ones(3)
    rounds.take(w, g[0], 0)                  # worker 0's round-1 push ...
    assert not rounds.due(0) and rounds.settle(w, 0) == 0
    np.testing.assert_array_equal(w, 1.0)    # ... is not read by worker 1's first pull
    rounds.take(w, g[2], 2)
    rounds.take(w, g[1], 1)
    assert rounds.due(1) and rounds.settle(w, 1) == 1      # round 1: one step on all three
    np.testing.assert_array_equal(w, _adam_rounds([g[0], g[1], g[2]]))
    assert rounds.settle(w, 1) == 0          # the round's other pulls read the same weights

    # worker 2 joins after round 1; worker 0 pushes round 2 before worker 2's last pull
    rounds.take(w, g[0], 0)
    assert not rounds.due(0) and rounds.settle(w, 0) == 0
    rounds.take(w, g[1], 1)
    assert rounds.settle(w, 2, (2,)) == 1    # round 2: workers 0 and 1
    expected = _adam_rounds([g[0], g[1], g[2]], [g[0], g[1]])
    np.testing.assert_array_equal(w, expected)

    # worker 2 comes back: its push, which round 3 counts, joins round 3
    rounds.take(w, g[2], 2)
    rounds.take(w, g[0], 0)
    assert not rounds.due(2, (2,))           # round 2 is stepped: a late pull of it reads
    rounds.take(w, g[1], 1)
    assert rounds.settle(w, None) == 1       # every push is in: every push kept
    np.testing.assert_array_equal(w, _adam_rounds([g[0], g[1], g[2]], [g[0], g[1]],
                                                  [g[0], g[1], g[2]]))


def test_param_groups_must_agree_for_the_shards():
    from mpsync.server.shard_optimizer import settings_of

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    same = torch.optim.Adam([{"params": [a]}, {"params": [b]}], lr=0.1)
    assert settings_of("Adam", same.param_groups).lr == 0.1
    differ = torch.optim.Adam([{"params": [a], "weight_decay": 0.1}, {"params": [b]}], lr=0.1)
    with pytest.raises(UnsupportedOptimizer, match="param groups that differ"):
        settings_of("Adam", differ.param_groups)


def test_the_setting_comes_from_keywords_or_the_environment_and_names_what_does_not_fit():
    from mpsync.config import ConfigError, SyncConfig

    assert SyncConfig().ps_optimizer == "worker"
    env = {"MPSYNC_PS_OPTIMIZER": "server"}
    assert SyncConfig.from_options(env=env, policy="ssp").ps_optimizer == "server"
    assert SyncConfig.from_options(env=env, policy="ssp",
                                   ps_optimizer="worker").ps_optimizer == "worker"
    with pytest.raises(ConfigError, match="MPSYNC_PS_OPTIMIZER.*got 'shard'"):
        SyncConfig(policy="asp", ps_optimizer="shard").validate()
    with pytest.raises(ConfigError, match="needs topology='ps'"):
        SyncConfig(policy="bsp", ps_optimizer="server").validate()     # bsp's own: ring
    with pytest.raises(ConfigError, match="policy='esync' does not push a gradient"):
        SyncConfig(policy="esync", topology="ps", ps_optimizer="server").validate()


def test_the_train_command_passes_the_flag_and_the_environment_on():
    import argparse

    from mpsync.apps.train import add_arguments, build_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--policy", "dssp", "--ps-optimizer", "server"])
    assert build_config(args).ps_optimizer == "server"
    with pytest.raises(SystemExit):
        p.parse_args(["--policy", "dssp", "--ps-optimizer", "gpu"])


def test_the_mean_of_per_worker_adam_steps_is_not_an_adam_step_on_the_mean_gradient():
    """Why the workers' own Adam is a departure even under BSP, where SGD's is not."""
    rng = np.random.default_rng(2)
    grads = rng.normal(size=(3, 50)) * np.array([[1.0], [0.1], [5.0]])
    for kind, differs in (("sgd", False), ("adam", True)):
        settings = OptimizerSettings(kind=kind, lr=0.01, momentum=0.9 if kind == "sgd" else 0)
        server, w_server = ShardOptimizer(settings, 50), np.zeros(50)
        server.step(w_server, grads.mean(axis=0))
        steps = []
        for g in grads:
            w = np.zeros(50)
            ShardOptimizer(settings, 50).step(w, g)
            steps.append(w)
        gap = np.abs(np.mean(steps, axis=0) - w_server).max() / np.abs(w_server).max()
        assert (gap > 1e-3) if differs else (gap < 1e-14), (kind, gap)


@pytest.mark.parametrize("per_round", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_saved_state_restored_on_fresh_shards_continues_bitwise(per_round, kind):
    """A checkpoint's optimizer state, split over other shard ranges than it was saved from,
    continues exactly where the uninterrupted run goes."""
    from mpsync.server.shard_optimizer import ServerUpdates, unpack_state

    rng = np.random.default_rng(3)
    settings = OptimizerSettings(kind=kind, lr=0.05, momentum=0.9 if kind == "sgd" else 0.0,
                                 amsgrad=kind == "adam").to_array()
    grads = rng.normal(size=(6, 2, 10)).astype(np.float32)   # 6 rounds of 2 workers' pushes

    def run(updates, w, rounds):
        for pushes in rounds:
            for worker, g in enumerate(pushes):
                assert updates.take(w, g, worker) is None
            updates.settle(w, None)

    whole, w_whole = ServerUpdates(per_round), np.ones(10, np.float32)
    whole.configure(settings)
    run(whole, w_whole, grads)

    first, w = ServerUpdates(per_round), np.ones(10, np.float32)
    first.configure(settings)
    run(first, w, grads[:3])
    kind_saved, steps, saved = unpack_state(first.save(w), np.float32, 10)
    assert (kind_saved, steps) == (kind, 3 if per_round else 6)
    for lo, hi in ((0, 4), (4, 10)):          # two shards of another layout
        again = ServerUpdates(per_round)
        assert again.restore(pack_state(kind, steps, {n: a[lo:hi] for n, a in saved.items()},
                                        hi - lo, np.float32), np.float32) is None
        again.configure(settings)
        part = w[lo:hi].copy()
        run(again, part, grads[3:, :, lo:hi])
        np.testing.assert_array_equal(part, w_whole[lo:hi])
        for name, array in whole.optimizer.export().items():
            np.testing.assert_array_equal(again.optimizer.export()[name], array[lo:hi])
    assert again.restore(first.save(w), np.float32) is not None   # after a push: refused
    wrong = ServerUpdates(per_round)
    wrong.restore(pack_state(kind, steps, {n: a[:4] for n, a in saved.items()}, 4, np.float32),
                  np.float32)
    wrong.configure(OptimizerSettings(kind="adamw" if kind == "adam" else "adam").to_array())
    assert "restored is" in wrong.take(np.ones(4, np.float32), grads[3, 0, :4], 0)
