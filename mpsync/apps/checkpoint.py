"""Checkpoints that survive crashes: atomic writes, checksums, the previous good one kept.

File layout (``ckpt-<round>.mpsck``): a sealed file of :mod:`mpsync.commits`::

    b"MPSYNC-CKPT 1\n"                          magic and format version
    {"sha256": ..., "length": N, "round": R}\n  one JSON header line
    <N bytes>                                   torch.save of the state dict

The state holds only data (``mpsync.commits.DATA_TYPES``: tensors, numbers, strings, numpy
arrays and containers of them; no objects of other classes) and is loaded with
``torch.load(weights_only=True)``: resuming a checkpoint someone else wrote runs no code of
theirs.  A file whose pickle would call anything else to build the state is refused with one
line naming it, as a corrupt one is.  Checkpoints written before this rule load as they are
(what they held was already data: tensors, numpy arrays, numbers).

A write goes to a temporary file in the same directory, is fsync'ed, then renamed over the
final name (rename is atomic on POSIX), so a crash mid-write leaves the previous checkpoint
untouched.  Only the newest ``keep`` checkpoints are kept.  Loading checks magic, length and
checksum; a corrupt or truncated file is refused with a message naming it and what is wrong,
and ``latest_good`` falls back to the previous good one.

:class:`CheckpointWriter` writes them in the background from a copy, so training goes on
while the file is written; a newer checkpoint that arrives while an older one still waits
replaces it.
"""

from __future__ import annotations

import copy
import numbers
import os
import sys
from pathlib import Path

from mpsync.commits import BackgroundWriter, SealedFileError, check_data, read_sealed, \
    sealed_header, write_sealed

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "checkpoint_header",
           "latest_good", "list_checkpoints", "CheckpointWriter", "HEADER_FIELDS"]

SUFFIX = ".mpsck"

# A checkpoint that cannot be used; the message names the file and the reason.
CheckpointError = SealedFileError


def _name(round_: int) -> str:
    return f"ckpt-{round_:09d}{SUFFIX}"


# Numbers of the state copied into the file's header, so that a supervisor can say what it
# resumes from without loading the state (:func:`checkpoint_header`).
HEADER_FIELDS = ("step", "wall_s", "workers")


def save_checkpoint(directory: str | os.PathLike, round_: int, state: dict, *, keep: int = 2) -> Path:
    """Write ``state`` atomically as the checkpoint of ``round_``; prune older ones."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / _name(round_)
    header = {k: int(v) if isinstance(v, numbers.Integral) else float(v)
              for k, v in ((k, state.get(k)) for k in HEADER_FIELDS)
              if isinstance(v, numbers.Real) and not isinstance(v, bool)}
    write_sealed(final, state, round=int(round_), **header)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


class CheckpointWriter:
    """Checkpoints written in the background: :meth:`save` takes a deep copy of ``state``
    (the caller goes on training and changing it) and returns; :meth:`flush` waits for the
    newest one to be on disk.  A write error is raised by the next call."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory, self.keep = Path(directory), keep
        self._writer = BackgroundWriter("mpsync-checkpoint-writer")

    def save(self, round_: int, state: dict) -> None:
        check_data(state)   # here, not in the writer thread, so the caller hears of it
        snapshot = copy.deepcopy(state)
        self._writer.submit(lambda: save_checkpoint(self.directory, round_, snapshot,
                                                    keep=self.keep))

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer.wait(timeout)

    @property
    def superseded(self) -> int:
        """Checkpoints replaced by a newer one before their write began."""
        return self._writer.superseded


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (by round in the name)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if p.name.startswith("ckpt-") and p.name.endswith(SUFFIX))


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state stored in ``path``; CheckpointError if it is corrupt, truncated or holds
    more than data (nothing in it is run)."""
    return read_sealed(path, what="checkpoint")


def checkpoint_header(path: str | os.PathLike) -> dict:
    """The header of the checkpoint ``path`` (``round``, and :data:`HEADER_FIELDS` where the
    writer put them), checked as :func:`load_checkpoint` checks the file but without loading
    the state or importing torch (``mpsync.commits.sealed_header``)."""
    return sealed_header(path, what="checkpoint")


def latest_good(location: str | os.PathLike, *, warn=None,
                read=load_checkpoint) -> tuple[Path, dict]:
    """The newest checkpoint under ``location`` (a file, a directory of checkpoints, or a run
    directory with ``checkpoints/``) that passes verification, and ``read(path)`` of it (the
    state; :func:`checkpoint_header` for the header only).  Corrupt ones are reported via
    ``warn`` (default: stderr) and skipped; CheckpointError when none is usable."""
    location = Path(location)
    warn = warn or (lambda msg: print(f"mpsync: {msg}", file=sys.stderr))
    if location.is_file():
        return location, read(location)
    candidates = list_checkpoints(location) or list_checkpoints(location / "checkpoints")
    if not candidates:
        raise CheckpointError(f"--resume {location}: no checkpoint (ckpt-*{SUFFIX}) found")
    problems = []
    for path in reversed(candidates):
        try:
            return path, read(path)
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"refusing {e}; trying the previous one")
    raise CheckpointError("no usable checkpoint: " + "; ".join(problems))
