"""Checkpoints: atomic, verified, the previous good one kept; kill-and-resume of a
deterministic BSP run ends with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mpi_harness import REPO, run_mpi

from mpsync.apps.checkpoint import (CheckpointError, latest_good, list_checkpoints,
                                    load_checkpoint, save_checkpoint)

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
    assert run.returncode != 0
    assert f"checkpoint {bad}: truncated" in run.rank_err(0)
    assert bad.exists()
