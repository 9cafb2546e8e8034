"""Checkpoints: atomic, verified, the previous good one kept; kill-and-resume of a
deterministic BSP run ends with exactly the parameters of an uninterrupted run; with ESync on
the ring and SSP on the parameter server a resume rolls back at most K rounds."""

from __future__ import annotations

import json
import os
import re
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
    hit = re.search(r"resuming from \S+: round (\d+), step (\d+)", resumed.rank_out(0))
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
