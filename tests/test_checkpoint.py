"""Checkpoints: atomic, verified, the previous good one kept; only data, so a crafted one runs
nothing on resume; kill-and-resume of a deterministic BSP run ends with exactly the parameters
of an uninterrupted run; with ESync on the ring and SSP on the parameter server a resume rolls
back at most K rounds."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from mpi_harness import REPO, run_mpi

from mpsync.apps.checkpoint import (CheckpointError, CheckpointWriter, latest_good,
                                    list_checkpoints, load_checkpoint, save_checkpoint)
from mpsync.apps.train_checkpoints import restore_rng_states, rng_states, shards_state_as_data
from mpsync.apps.train_restarts import _keep_newest
from mpsync.commits import MAGIC, write_sealed
from mpsync.config import SyncConfig
from mpsync.server.shard_optimizer import ShardOptimizer, settings_of

TRAIN = str(REPO / "mpsync" / "apps" / "train.py")


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((100,), v)}, "round": int(v)}


def test_round_trip_and_pruning(tmp_path):
    for r in (5, 10, 15):
        save_checkpoint(tmp_path, r, _state(r))
    files = list_checkpoints(tmp_path)
    assert [f.name for f in files] == ["ckpt-000000010.mpsck", "ckpt-000000015.mpsck"]
    assert torch.equal(load_checkpoint(files[-1])["model"]["w"], torch.full((100,), 15.0))
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name], "no temporary file left"


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[: len(b) - 17], "truncated"),
    (lambda b: b[:-40] + bytes([b[-40] ^ 0xFF]) + b[-39:], "sha256 mismatch"),
    (lambda b: b"garbage" + b, "bad magic"),
    (lambda b: b[:20], "header"),
])
def test_corrupt_checkpoint_refused_previous_kept(tmp_path, damage, message):
    save_checkpoint(tmp_path, 1, _state(1))
    newest = save_checkpoint(tmp_path, 2, _state(2))
    newest.write_bytes(damage(newest.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(newest)
    assert str(newest) in str(err.value)
    warnings = []
    path, state = latest_good(tmp_path, warn=warnings.append)
    assert path.name == "ckpt-000000001.mpsck" and state["round"] == 1
    assert len(warnings) == 1 and message in warnings[0]
    assert newest.exists(), "the bad file is left for inspection, not silently deleted"


def test_interrupted_write_keeps_previous(tmp_path, monkeypatch):
    good = save_checkpoint(tmp_path, 1, _state(1))
    before = good.read_bytes()

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, _state(2))
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path)] == [good.name]
    assert good.read_bytes() == before
    assert latest_good(tmp_path)[1]["round"] == 1


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        latest_good(tmp_path)


class _RunsOnLoad:
    """A pickle that runs a shell command when it is loaded (what a crafted file would do)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def crafted_checkpoint(path, marker) -> None:
    """A sealed file, header and sha256 valid, whose pickle would create ``marker`` on load:
    only the pickle is wrong."""
    buf = io.BytesIO()
    torch.save({**_state(7), "step": 7, "workers": 2, "payload": _RunsOnLoad(f"touch {marker}")},
               buf)
    payload = buf.getvalue()
    head = {"sha256": hashlib.sha256(payload).hexdigest(), "length": len(payload), "round": 7}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(MAGIC + json.dumps(head).encode() + b"\n" + payload)


def test_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    good = save_checkpoint(tmp_path / "checkpoints", 5, _state(5))
    bad = tmp_path / "checkpoints" / "ckpt-000000007.mpsck"
    crafted_checkpoint(bad, marker)
    # The file alone (--resume FILE): one line naming it and what its pickle would call.
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(bad)
    message = str(err.value)
    assert message.startswith(f"checkpoint {bad}: refused") and "\n" not in message, message
    assert "system" in message, message
    # A run directory (--resume DIR, and the supervisor before a restart): the crafted newest
    # is refused, named, and the previous good one used.
    warnings = []
    path, state = latest_good(tmp_path, warn=warnings.append)
    assert path == good and state["round"] == 5
    assert len(warnings) == 1 and str(bad) in warnings[0]
    kept = _keep_newest(tmp_path, 1)
    assert [p.name for p in kept.iterdir()] == [good.name]
    good.unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(bad))):
        latest_good(tmp_path, warn=lambda m: None)
    assert _keep_newest(tmp_path, 2) is None        # nothing usable: start from the beginning
    assert not marker.exists(), "loading the crafted checkpoint ran its command"


def _equal(a, b) -> bool:
    """Exactly equal, types included (tensors: dtype, shape and every bit)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _adam_shards(steps: int) -> ShardOptimizer:
    shard = ShardOptimizer(settings_of("Adam", [{"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8,
                                                 "weight_decay": 0.0, "amsgrad": True}]), 50)
    weights = np.linspace(-1, 1, 50)
    for i in range(steps):
        shard.step(weights, np.sin(weights * (i + 1)))
    return shard


def test_checkpoint_round_trips_exactly_and_training_continues(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 4)).sum().backward()
    inner.step()
    np.random.seed(3)
    random.seed(4)
    shards = _adam_shards(3)
    server = shards_state_as_data({"kind": "adam", "steps": shards.steps, **shards.export()})
    state = {"model": model.state_dict(), "workers": 1, "round": 9, "step": 9, "wall_s": 1.5,
             "evals": [{"wall_s": 0.0, "samples": 0, "accuracy": 0.1, "loss": 2.3}],
             "policy": SyncConfig().to_dict(),
             "per_worker": [{"epoch": 0, "index": 9, "samples": 72,
                             "optimizer": inner.state_dict(), **rng_states(),
                             "counters": {"rounds": 9, "wait_s": 0.25},
                             "resharded_from": (2, 0)}],
             "server": {"topology": "ps", "ps_version": 9, "optimizer": server}}
    draws = (torch.rand(3), np.random.rand(3), random.random())
    loaded = load_checkpoint(save_checkpoint(tmp_path, 9, state))
    assert _equal(loaded, state)
    # The RNGs continue where they were saved.
    restore_rng_states(loaded["per_worker"][0])
    assert torch.equal(torch.rand(3), draws[0]) and np.array_equal(np.random.rand(3), draws[1])
    assert random.random() == draws[2]
    # The shards' Adam (moments and amsgrad's maximum, as tensors) goes on bit for bit.
    saved = loaded["server"]["optimizer"]
    resumed = _adam_shards(0)
    resumed.load(saved["steps"], {k: np.asarray(v) for k, v in saved.items()
                                  if k not in ("kind", "steps")})
    w1, w2 = np.linspace(0, 1, 50), np.linspace(0, 1, 50)
    for _ in range(2):
        shards.step(w1, np.cos(w1))
        resumed.step(w2, np.cos(w2))
    assert np.array_equal(w1, w2)


def test_checkpoint_of_earlier_versions_with_numpy_arrays_loads(tmp_path):
    # Written as before: the numpy RNG state and the shards' state as numpy arrays.
    np.random.seed(5)
    rng = np.random.get_state()
    momentum = np.arange(10, dtype=np.float32)
    path = tmp_path / "ckpt-000000001.mpsck"
    write_sealed(path, {"per_worker": [{"rng_numpy": rng, "rng_torch": torch.get_rng_state(),
                                        "rng_python": random.getstate()}],
                        "server": {"optimizer": {"kind": "sgd", "steps": 1,
                                                 "momentum": momentum}}}, round=1)
    loaded = load_checkpoint(path)
    assert np.array_equal(loaded["server"]["optimizer"]["momentum"], momentum)
    expected = np.random.rand(2)
    restore_rng_states(loaded["per_worker"][0])
    assert np.array_equal(np.random.rand(2), expected)


@dataclasses.dataclass
class _NotData:
    x: int = 1


def test_state_that_is_not_data_is_refused_when_written(tmp_path):
    state = {"model": {"w": torch.ones(2)}, "extra": [1, _NotData()]}
    with pytest.raises(TypeError, match=r"state\['extra'\]\[1\] is a .*_NotData; a "
                                        r"checkpoint holds only data"):
        CheckpointWriter(tmp_path).save(1, state)
    with pytest.raises(TypeError, match="_NotData"):
        save_checkpoint(tmp_path, 1, state)
    assert list(tmp_path.iterdir()) == []


def _run(out, *extra, check=True):
    return run_mpi(TRAIN, np=3, timeout=240, check=check, args=[
        "--policy", "bsp", "--backend", "mpi", "--epochs", "1.5", "--batch-size", "16",
        "--seed", "7", "--checkpoint-every", "5", "--out", str(out), "--no-progress", *extra])


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_run, whole)
        b = pool.submit(_run, broken, "--kill-at-step", "33", check=False)
        a.result()
        killed = b.result()
    assert killed.returncode != 0, "the killed run must fail"
    assert not (broken / "metrics.json").exists()
    ckpts = list_checkpoints(broken / "checkpoints")
    assert ckpts and load_checkpoint(ckpts[-1])["step"] == 30
    _run(broken, "--resume", str(broken))
    m_whole = json.loads((whole / "metrics.json").read_text())
    m_resumed = json.loads((broken / "metrics.json").read_text())
    assert m_resumed["config"]["resumed"] is True
    assert m_resumed["total_samples"] == m_whole["total_samples"]
    assert m_resumed["final_param_sha256"] == m_whole["final_param_sha256"]
    w, r = torch.load(whole / "model.pt"), torch.load(broken / "model.pt")
    assert all(torch.equal(w[k], r[k]) for k in w)


@pytest.mark.slow
def test_resume_from_corrupt_checkpoint_refused(tmp_path):
    save_checkpoint(tmp_path / "checkpoints", 5, {"workers": 2})
    bad = tmp_path / "checkpoints" / "ckpt-000000005.mpsck"
    bad.write_bytes(bad.read_bytes()[:-3])
    run = _run(tmp_path, "--resume", str(bad), check=False)
    assert run.returncode != 0 and not run.timed_out, run.report()
    # Said once, by worker 0 (world rank 1: the dedicated server's rank does not read it).
    said = [r for r in range(3) if f"checkpoint {bad}: truncated" in run.rank_err(r)]
    assert said == [1], run.report()
    assert bad.exists()


@pytest.mark.mpi
def test_resume_from_crafted_checkpoint_refused(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "checkpoints" / "ckpt-000000007.mpsck"
    crafted_checkpoint(bad, marker)
    run = _run(tmp_path, "--resume", str(bad), check=False)
    assert run.returncode != 0 and not run.timed_out, run.report()
    lines = [ln for r in range(3) for ln in run.rank_err(r).splitlines() if "refused" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"mpsync train: error: checkpoint {bad}: "
                                                   f"refused"), run.report()
    assert not any("Traceback" in run.rank_err(r) for r in range(3)), run.report()
    assert not marker.exists(), "resuming the crafted checkpoint ran its command"


# -- rollback of at most K rounds (policies without a deterministic trajectory) -----------------
def _rollback_run(out, policy, k, *extra, check=True):
    return run_mpi(TRAIN, np=3, timeout=120, check=check, args=[
        "--policy", policy, "--epochs", "1.2", "--batch-size", "16", "--seed", "3",
        "--eval-every", "0.25", "--checkpoint-every", str(k), "--out", str(out),
        "--no-progress", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("policy, extra, k, kill_at", [
    ("esync", (), 4, 30),                       # ring: checkpoints at common rounds
    # ps: global weights pulled from the server.  Both workers' steps apply there in full, so
    # the ring's lr 0.05 is 0.025 here: at 0.05 one full-suite run ended at 0.37 after 0.52.
    ("ssp", ("--staleness", "2", "--lr", "0.025"), 8, 45),
])
def test_kill_and_resume_rolls_back_at_most_k_rounds(tmp_path, policy, extra, k, kill_at):
    killed = _rollback_run(tmp_path, policy, k, *extra, "--kill-at-step", str(kill_at),
                           check=False)
    assert killed.returncode != 0 and not killed.timed_out, killed.report()
    assert not (tmp_path / "metrics.json").exists()
    # Worker 0 (world rank 1; rank 0 is the server) says which round it had reached.
    hit = re.search(r"SIGKILL worker 0 after step (\d+), round (\d+)", killed.rank_out(1))
    assert hit, killed.report()
    killed_round = int(hit.group(2))
    newest = load_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1])
    # A consistent cut: every worker had made exactly `round` rounds (pushes on the PS).
    assert [w["counters"]["rounds"] for w in newest["per_worker"]] == [newest["round"]] * 2
    if newest["server"]["topology"] == "ps":
        # Every push up to the cut is in the saved weights and none after it: the version is
        # the number of updates the server applied.
        assert newest["server"]["ps_version"] == 2 * newest["round"], newest["server"]

    resumed = _rollback_run(tmp_path, policy, k, *extra, "--resume", str(tmp_path))
    # Worker 0 says it (world rank 1: the dedicated server's rank does not read it).
    hit = re.search(r"resuming from \S+: round (\d+), step (\d+)", resumed.rank_out(1))
    assert hit, resumed.report()
    resume_round, resume_step = int(hit.group(1)), int(hit.group(2))
    assert resume_round == newest["round"] > 0
    assert 0 <= killed_round - resume_round <= k, (killed_round, resume_round)
    print(f"{policy}: killed at round {killed_round}, resumed from round {resume_round} "
          f"(K = {k}); kill run {killed.elapsed:.1f}s, resumed run {resumed.elapsed:.1f}s")
    assert resume_step <= kill_at

    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["config"]["resumed"] is True and m["config"]["topology"] == newest["server"][
        "topology"]
    # The evaluations up to the checkpoint are kept (the first is the untrained model), the
    # resumed ones continue on the same wall-time axis, the last is the final model.
    kept = [{key: v for key, v in e.items() if key != "wall_clock"} for e in newest["evals"]]
    assert kept and kept[0]["samples"] == 0 and m["evals"][:len(kept)] == kept
    walls = [e["wall_s"] for e in m["evals"]]
    assert walls == sorted(walls) and walls[-1] == m["wall_s"] > newest["wall_s"]
    assert m["evals"][-1]["samples"] == m["total_samples"]
    assert m["total_samples"] >= 1.2 * m["config"]["train_samples"]
    workers = m["workers"]
    assert sorted(workers) == ["0", "1"]
    assert sum(w["samples"] for w in workers.values()) == m["total_samples"]
    for w in workers.values():
        # Counters carried over the resume agree with the data position carried over.
        assert w["iterations"] > 0 and w["samples"] == 16 * w["iterations"], w
        assert w["rounds"] > resume_round, w
    # Every worker ends with the same parameters, the ones worker 0 reports and saved.
    assert {w["param_sha256"] for w in workers.values()} == {m["final_param_sha256"]}
    assert m["final_acc"] > 0.5, m["final_acc"]   # 10 classes: chance is 0.1
