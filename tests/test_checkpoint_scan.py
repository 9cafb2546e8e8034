"""A checkpoint checked without loading it (``checkpoint_header``: the seal and a scan of what
its pickle names, no torch): it accepts every file of data mpsync writes, refuses what the
load refuses with the same line, and lets the restart supervisor choose and describe a
checkpoint without importing torch."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from mpi_harness import REPO
from test_checkpoint import crafted_checkpoint

from mpsync.apps.checkpoint import (CheckpointError, checkpoint_header, latest_good,
                                    load_checkpoint, save_checkpoint)
from mpsync.commits import MAGIC, _SCAN_NAMES, _SCAN_PATTERN, _numpy_array_globals


def _every_kind_of_data() -> dict:
    """A state with a value of every type a sealed file holds (``DATA_TYPES``)."""
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    adam.step()
    return {
        "round": 4, "step": 12, "wall_s": 2.5, "workers": 3,
        "model": model.state_dict(), "optimizer": adam.state_dict(),
        "tensors": [torch.ones(2, dtype=d) for d in (torch.float64, torch.float16,
                                                     torch.bfloat16, torch.int32, torch.int8,
                                                     torch.uint8, torch.bool, torch.complex64)],
        "view": torch.arange(6.0)[2:5], "parameter": torch.nn.Parameter(torch.ones(2)),
        "arrays": [np.ones(3), np.arange(4, dtype=np.int32), np.zeros(2, dtype=bool)],
        "rng": [np.random.get_state(), torch.get_rng_state(), random.getstate()],
        "plain": ["text", b"bytes", bytearray(b"ba"), None, 1 + 2j, 1.5, True, {1, 2}, (1,)],
        "ordered": collections.OrderedDict(a=1), "counted": collections.Counter(b=2),
        "torch_values": [torch.float32, torch.Size([2, 3]), torch.device("cpu"), torch.strided],
    }


def test_the_header_check_accepts_every_kind_of_data_and_carries_the_numbers(tmp_path):
    path = save_checkpoint(tmp_path, 4, _every_kind_of_data())
    header = checkpoint_header(path)
    assert {k: header[k] for k in ("round", "step", "wall_s", "workers")} == \
        {"round": 4, "step": 12, "wall_s": 2.5, "workers": 3}
    assert load_checkpoint(path)["step"] == 12


@pytest.mark.parametrize("damage", [
    lambda b: b[:-17],                                        # truncated
    lambda b: b[:-40] + bytes([b[-40] ^ 0xFF]) + b[-39:],     # a flipped byte
    lambda b: b"garbage" + b,                                 # not a checkpoint
])
def test_the_header_check_refuses_a_damaged_file_as_the_load_does(tmp_path, damage):
    path = save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError) as loaded:
        load_checkpoint(path)
    with pytest.raises(CheckpointError) as scanned:
        checkpoint_header(path)
    assert str(scanned.value) == str(loaded.value)


def test_the_header_check_refuses_a_crafted_file_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "ckpt-000000007.mpsck"
    crafted_checkpoint(bad, marker)
    with pytest.raises(CheckpointError) as scanned:
        checkpoint_header(bad)
    with pytest.raises(CheckpointError) as loaded:
        load_checkpoint(bad)
    message = str(scanned.value)
    assert message.startswith(f"checkpoint {bad}: refused, not plain data (its pickle calls ")
    assert "system" in message and message == str(loaded.value), (message, loaded.value)
    assert not marker.exists()


def test_a_payload_of_torchs_older_format_is_checked_by_loading_it(tmp_path):
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}}, buf, _use_new_zipfile_serialization=False)
    payload = buf.getvalue()
    head = {"sha256": hashlib.sha256(payload).hexdigest(), "length": len(payload), "round": 2}
    path = tmp_path / "ckpt-000000002.mpsck"
    path.write_bytes(MAGIC + json.dumps(head).encode() + b"\n" + payload)
    assert checkpoint_header(path)["round"] == 2


def test_every_name_the_scan_lets_through_torchs_weights_only_load_allows():
    from torch._weights_only_unpickler import _get_allowed_globals

    allowed = set(_get_allowed_globals())
    allowed |= {f"{g.__module__}.{g.__qualname__}" for g in _numpy_array_globals()}
    # numpy 1 and numpy 2 name _reconstruct differently; this numpy's one is in `allowed`.
    other_numpy = {"numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"}
    assert not _SCAN_NAMES - allowed - other_numpy
    assert (_SCAN_NAMES & other_numpy) & allowed
    # The pattern: storage classes and dtypes, as torch names them.
    candidates = {n for n in allowed if n.startswith("torch.")} | {
        "torch.FooStorage", "torch.nn.Module", "torch.load", "torch.cuda.FloatTensor"}
    matched = {n for n in candidates if _SCAN_PATTERN.fullmatch(n)}
    assert matched and matched <= allowed
    assert {"torch.FloatStorage", "torch.float32", "torch.bfloat16", "torch.bool"} <= matched


def test_the_supervisor_chooses_and_describes_a_checkpoint_without_importing_torch(tmp_path):
    good = save_checkpoint(tmp_path / "checkpoints", 5, {"model": {"w": torch.ones(2)},
                                                         "step": 10, "wall_s": 3.0,
                                                         "workers": 2})
    marker = tmp_path / "ran"
    crafted_checkpoint(tmp_path / "checkpoints" / "ckpt-000000007.mpsck", marker)
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from mpsync.apps.train_restarts import restart_point, _describe_checkpoint\n"
        f"kept = restart_point(Path({str(tmp_path)!r}), 1)\n"
        "print(json.dumps({'kept': sorted(p.name for p in kept.iterdir()),\n"
        "                  'described': _describe_checkpoint(kept),\n"
        "                  'torch': 'torch' in sys.modules}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["kept"] == [good.name], result
    assert result["described"]["round"] == 5 and result["described"]["step"] == 10
    assert result["described"]["workers"] == 2 and result["described"]["wall_s"] == 3.0
    assert result["torch"] is False, "the supervisor imported torch"
    assert "ckpt-000000007.mpsck" in done.stderr and not marker.exists(), done.stderr
    # The state the ranks load is the one chosen.
    assert latest_good(tmp_path / "restarts" / "restart-1")[1]["step"] == 10
