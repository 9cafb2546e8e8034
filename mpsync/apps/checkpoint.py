"""Checkpoints that survive crashes: atomic writes, checksums, the previous good one kept.

File layout (``ckpt-<round>.mpsck``)::

    b"MPSYNC-CKPT 1\n"                          magic and format version
    {"sha256": ..., "length": N, "round": R}\n  one JSON header line
    <N bytes>                                   torch.save of the state dict

A write goes to a temporary file in the same directory, is fsync'ed, then renamed over the
final name (rename is atomic on POSIX), so a crash mid-write leaves the previous checkpoint
untouched.  Only the newest ``keep`` checkpoints are kept.  Loading checks magic, length and
checksum; a corrupt or truncated file is refused with a message naming it and what is wrong,
and ``latest_good`` falls back to the previous good one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path

import torch

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_good", "list_checkpoints"]

MAGIC = b"MPSYNC-CKPT 1\n"
SUFFIX = ".mpsck"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def _name(round_: int) -> str:
    return f"ckpt-{round_:09d}{SUFFIX}"


def save_checkpoint(directory: str | os.PathLike, round_: int, state: dict, *, keep: int = 2) -> Path:
    """Write ``state`` atomically as the checkpoint of ``round_``; prune older ones."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = json.dumps({"sha256": hashlib.sha256(payload).hexdigest(), "length": len(payload),
                         "round": int(round_)}).encode() + b"\n"
    final = directory / _name(round_)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(header)
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (by round in the name)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if p.name.startswith("ckpt-") and p.name.endswith(SUFFIX))


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state stored in ``path``; CheckpointError if it is corrupt or truncated."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read ({e.strerror})") from None
    if not data.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {path}: not an mpsync checkpoint (bad magic)")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise CheckpointError(f"checkpoint {path}: truncated header")
    try:
        header = json.loads(data[len(MAGIC):end])
        digest, length = str(header["sha256"]), int(header["length"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path}: corrupt header") from None
    payload = data[end + 1:]
    if len(payload) != length:
        raise CheckpointError(f"checkpoint {path}: truncated ({len(payload)} of {length} "
                              f"payload bytes)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"checkpoint {path}: corrupt (sha256 mismatch)")
    return torch.load(io.BytesIO(payload), weights_only=False)


def latest_good(location: str | os.PathLike, *, warn=None) -> tuple[Path, dict]:
    """The newest checkpoint under ``location`` (a file, a directory of checkpoints, or a run
    directory with ``checkpoints/``) that passes verification.  Corrupt ones are reported via
    ``warn`` (default: stderr) and skipped; CheckpointError when none is usable."""
    location = Path(location)
    warn = warn or (lambda msg: print(f"mpsync: {msg}", file=sys.stderr))
    if location.is_file():
        return location, load_checkpoint(location)
    candidates = list_checkpoints(location) or list_checkpoints(location / "checkpoints")
    if not candidates:
        raise CheckpointError(f"--resume {location}: no checkpoint (ckpt-*{SUFFIX}) found")
    problems = []
    for path in reversed(candidates):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"refusing {e}; trying the previous one")
    raise CheckpointError("no usable checkpoint: " + "; ".join(problems))
