"""``mpsync train --optimizer``: which settings apply to which optimizer (refused where they
mean nothing, one line, exit 2), and short real runs of Adam on the ring and on the parameter
server's shards (``--ps-optimizer server``), 2 workers each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpi_harness import REPO, run_mpi

from mpsync.config import ConfigError, OptimizerChoice, optimizer_choice

TRAIN = str(REPO / "mpsync" / "apps" / "train.py")
PY = sys.executable


def test_each_optimizer_gets_the_settings_that_mean_something_to_it():
    assert optimizer_choice(None, 0.05, env={}).torch_kwargs() == \
        {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.9, "nesterov": False}
    assert optimizer_choice(None, 0.1, env={"MPSYNC_OPTIMIZER": "AdamW"}).torch_kwargs() == \
        {"lr": 0.1, "weight_decay": 0.01}          # torch.optim.AdamW's default decay
    adam = optimizer_choice("adam", 0.01, weight_decay=1e-4, env={})
    assert adam.torch_class == "Adam" and adam.torch_kwargs() == {"lr": 0.01,
                                                                 "weight_decay": 1e-4}
    assert adam.to_dict()["momentum"] is None and adam.to_dict()["nesterov"] is None
    sgd = optimizer_choice("sgd", 0.05, momentum=0.5, nesterov=True, env={})
    assert sgd.torch_kwargs()["momentum"] == 0.5 and sgd.torch_kwargs()["nesterov"] is True
    # The flag wins over the environment.
    assert optimizer_choice("sgd", 0.05, env={"MPSYNC_OPTIMIZER": "adam"}).kind == "sgd"


@pytest.mark.parametrize("kw, names", [
    (dict(kind="adam", nesterov=True), "--nesterov is SGD's"),
    (dict(kind="adamw", momentum=0.9), "--momentum is SGD's"),
    (dict(kind="sgd", momentum=0.0, nesterov=True), "--nesterov needs a momentum > 0"),
    (dict(kind="sgd", momentum=1.5), "--momentum must be in [0, 1)"),
    (dict(kind="adam", weight_decay=-1.0), "--weight-decay must be >= 0"),
    (dict(kind="rmsprop"), "unknown optimizer 'rmsprop'"),
])
def test_settings_that_mean_nothing_are_refused(kw, names):
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace(")", r"\)")):
        OptimizerChoice(lr=0.05, **kw).validate()


def test_a_bad_environment_names_its_variable():
    with pytest.raises(ConfigError, match="MPSYNC_OPTIMIZER='lamb'"):
        optimizer_choice(None, 0.05, env={"MPSYNC_OPTIMIZER": "lamb"})


@pytest.mark.parametrize("prog, flags, names", [
    ("train", ["--np", "2", "--time-budget", "1", "--optimizer", "adam", "--nesterov"],
     "--nesterov is SGD's"),
    ("train", ["--np", "2", "--time-budget", "1", "--optimizer", "adam", "--momentum", "0.9"],
     "--momentum is SGD's"),
    ("compare", ["--policies", "ssp", "--optimizer", "adamw", "--train-args=--nesterov"],
     "--nesterov is SGD's"),
])
def test_cli_refuses_a_setting_the_optimizer_has_not_before_launch(prog, flags, names, tmp_path):
    r = subprocess.run([PY, "-m", f"mpsync.apps.{prog}", *flags, "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], r.stderr
    assert not any(tmp_path.iterdir()), "nothing may be launched or written"


@pytest.mark.parametrize("topology, extra", [
    ("ring", ["--policy", "bsp"]),
    ("ps", ["--policy", "ssp", "--ps-optimizer", "server"]),
])
def test_train_runs_adam(topology, extra, tmp_path):
    run = run_mpi(TRAIN, np=3, timeout=180, check=False, args=[
        *extra, "--optimizer", "adam", "--lr", "0.005", "--weight-decay", "1e-4",
        "--epochs", "2", "--batch-size", "16", "--eval-every", "0.5",
        "--out", str(tmp_path), "--no-progress", "--no-plots"])
    assert run.ok, run.report()
    m = json.loads((tmp_path / "metrics.json").read_text())
    c = m["config"]
    assert (c["topology"], c["optimizer"], c["weight_decay"], c["momentum"]) == \
        (topology, "adam", 1e-4, None)
    assert c["ps_optimizer"] == ("server" if topology == "ps" else "worker")
    # Adam at lr 0.005 learns digits in 2 epochs: well above chance (10 classes).
    assert m["final_acc"] > 0.5 and m["evals"][0]["accuracy"] < m["final_acc"], m["evals"]


def _steps(opt_class, params, grads, **kw) -> list:
    """Twenty steps of ``opt_class`` from ``params`` with the gradients ``grads`` (a list per
    step), the parameters after them."""
    import torch

    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_class(ps, **kw)
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g
        opt.step()
    return [p.detach() for p in ps]


def test_train_fuses_the_step_where_it_steps_to_the_default_steps_bits():
    import torch

    from mpsync.apps.models import build_model
    from mpsync.apps.trainer import fused_step

    model = build_model((64,), 10, 0, "wide-mlp")
    cpu = torch.device("cpu")
    assert fused_step(model, cpu) == {"fused": True}
    assert fused_step(model.to(torch.float64), cpu) == {"fused": True}
    # Half precision keeps torch's default step (the fused kernel rounds once, not per
    # operation), and so does a device without the kernel.
    assert fused_step(build_model((64,), 10, 0, "wide-mlp").to(torch.bfloat16), cpu) == {}
    assert fused_step(build_model((64,), 10, 0, "mlp").to("meta"), torch.device("meta")) == {}
    # What the docstring promises, on the wide MLP's own shapes: the default step's result
    # to rounding, for SGD (momentum; Nesterov and weight decay), Adam and AdamW.
    gen = torch.Generator().manual_seed(0)
    params = [p.detach().float() for p in build_model((64,), 10, 0, "wide-mlp").parameters()]
    grads = [[torch.randn(p.shape, generator=gen) * 0.1 for p in params] for _ in range(20)]
    for cls, kw in [(torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True,
                                           weight_decay=1e-4)),
                    (torch.optim.Adam, dict(lr=0.003, weight_decay=1e-4)),
                    (torch.optim.AdamW, dict(lr=0.003))]:
        fused = _steps(cls, params, grads, **kw, fused=True)
        default = _steps(cls, params, grads, **kw)
        moved = max((a - p).abs().max().item() for a, p in zip(default, params))
        assert moved > 1e-3, "the steps must move the weights for the comparison to mean much"
        for a, b in zip(fused, default):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
