"""Commits that outlive the job: sealed files, written in the background, complete or unused.

With Open MPI 4.1 a lost rank ends the whole job (no ULFM), so every rank's memory is lost with
it: a state that is to survive must be on a disk (node-local or shared) before the job ends.
Three pieces, each usable alone:

* **sealed files** (:func:`write_sealed` / :func:`read_sealed`): ``MAGIC``, one JSON header line
  with the payload's length and sha256, then the payload (``torch.save``).  Written to a
  temporary name, fsync'ed and renamed, so a reader sees the whole file or the previous one;
  a truncated or corrupt file is refused with a message naming it.  A sealed file holds only
  data (:data:`DATA_TYPES`): it is written only when the state is data (:func:`check_data`)
  and read with ``torch.load(weights_only=True)``, so loading a file someone else wrote runs
  no code of theirs -- the sha256 guards against a damaged file, not a crafted one, and a
  file whose pickle names anything else is refused, naming the file, before anything in it
  is built.
* **a background writer** (:class:`BackgroundWriter`): one thread, one waiting slot.  The
  caller hands it a *copy* of its state and goes on training; a newer commit that arrives while
  an older one still waits replaces it (commits as often as asked never queue up without bound).
* **a commit store** (:class:`CommitStore`): one job's commits, one directory per commit
  (``commit-<seq>/rank-<r>.pt``).  Each rank writes its own file and then tells rank 0 of the
  store's communicator; rank 0 writes ``MANIFEST.json`` (atomically, last) once every rank's
  file of that commit is written.  A commit without a manifest is never used:
  :func:`newest_complete` is what a restarted job resumes from.

The directory must be readable by the restarted job's rank 0: a shared file system, or a
node-local disk on the first host, which a supervisor keeps first when it restarts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["ENV_COMMIT_DIR", "ENV_HOSTS_FILE", "ENV_HOSTS_VERSION", "RESTART_EXIT_CODE",
           "HOSTS_CHANGED", "USER_ERROR_EXIT_CODE", "SealedFileError", "DATA_TYPES",
           "check_data", "write_sealed", "read_sealed", "sealed_header", "fsync_dir",
           "BackgroundWriter", "CommitStore", "Manifest", "newest_complete", "load_committed",
           "MAGIC"]

# What an elastic launcher tells every rank of the job it starts:
ENV_COMMIT_DIR = "MPSYNC_ELASTIC_DIR"            # where commits go and are resumed from
ENV_HOSTS_FILE = "MPSYNC_ELASTIC_HOSTS_FILE"     # {"version": V, "hosts": [...]}, rewritten
ENV_HOSTS_VERSION = "MPSYNC_ELASTIC_HOSTS_VERSION"  # V when the job was started
# A job that ends to be started again with new hosts exits with this (EX_TEMPFAIL).
RESTART_EXIT_CODE = 75
# How hvd.elastic's worker 0 starts the line that says so (the launcher then reports a restart
# asked for, not a failure).
HOSTS_CHANGED = "mpsync elastic: the discovery script's hosts changed"
# A job that a restart would fail the same way (a user's mistake, a refused commit) exits
# with this, and is not restarted.
USER_ERROR_EXIT_CODE = 2

MAGIC = b"MPSYNC-CKPT 1\n"
MANIFEST = "MANIFEST.json"
_REPORT_TAG = 77


# What a sealed file holds, in words (the types :func:`check_data` lets through).
DATA_TYPES = ("tensors, numpy arrays, numbers, strings, bytes, None, torch dtypes, sizes and "
              "devices, and dicts, lists, tuples and sets of them")


class SealedFileError(RuntimeError):
    """A sealed file that cannot be used; the message names the file and the reason."""


def _plain_types() -> tuple:
    import torch

    return (str, bytes, bytearray, int, float, bool, complex, type(None), torch.Size,
            torch.dtype, torch.device, torch.layout)


def check_data(state, what: str = "checkpoint", where: str = "") -> None:
    """TypeError naming the first value in ``state`` that a sealed file cannot hold (one that
    is not in :data:`DATA_TYPES`): such a value pickles as a call of its class, which
    :func:`read_sealed` refuses, so it is refused when written instead of when resumed.

    Exact types: a subclass (a namedtuple, a defaultdict, a tensor subclass) pickles as its
    own class."""
    import collections

    import numpy as np
    import torch

    plain = _plain_types()
    containers = (dict, collections.OrderedDict, collections.Counter)
    seen: set[int] = set()
    stack = [(state, "state")]
    while stack:
        value, path = stack.pop()
        kind = type(value)
        if kind in plain:
            continue
        if kind in (torch.Tensor, torch.nn.Parameter):
            continue
        if kind is np.ndarray and not value.dtype.hasobject:
            continue
        if id(value) in seen:
            continue
        if kind in containers:
            seen.add(id(value))
            for key, item in value.items():
                stack.append((key, f"a key of {path}"))
                stack.append((item, f"{path}[{key!r}]"))
            continue
        if kind in (list, tuple, set):
            seen.add(id(value))
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
            continue
        raise TypeError(f"{where + ': ' if where else ''}{path} is a {kind.__module__}."
                        f"{kind.__qualname__}; a {what} holds only data ({DATA_TYPES})")


def _numpy_array_globals() -> list:
    """What a pickled numpy array names: checkpoints of earlier versions held the numpy RNG
    key and the shards' optimizer state as arrays, and an elastic script's state may.  These
    rebuild an array of plain numbers (an array of objects holds only what else is allowed)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:   # numpy 1
        from numpy.core.multiarray import _reconstruct
    numeric = [type(np.dtype(code)) for code in np.typecodes["AllInteger"]
               + np.typecodes["AllFloat"] + "?"]   # a dtype is built by its own class
    return [_reconstruct, np.ndarray, np.dtype, *numeric]


def _serialize(state) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _load_data(payload: bytes):
    import torch

    # torch keeps the allowed globals in one process-wide set: a context, not
    # add_safe_globals, so a script's own torch.load does not accept numpy arrays because
    # mpsync loaded a checkpoint.  Sealed files are read on one thread, never concurrently.
    with torch.serialization.safe_globals(_numpy_array_globals()):
        return torch.load(io.BytesIO(payload), weights_only=True)


def _why_not_data(error: BaseException) -> str:
    """One line out of torch's refusal (several paragraphs, most of them advice to load the
    file with ``weights_only=False``, which is what must not happen)."""
    text = str(error)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return f"its pickle calls {named.group(1)}"
    built = re.search(r"but got <class '([^']+)'>", text)
    if built:
        return f"its pickle builds a {built.group(1)}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Weights only load failed",
                                                      "Check the documentation",
                                                      "Please file an issue"))]
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= 160 else line[:157] + "..."


def write_sealed(path: str | os.PathLike, state, **header) -> dict:
    """Write ``state`` to ``path`` atomically; returns the header (length, sha256, ``header``).
    TypeError (nothing written) when ``state`` is not data (:func:`check_data`)."""
    path = Path(path)
    check_data(state, what="sealed file", where=str(path))
    payload = _serialize(state)
    head = {"sha256": hashlib.sha256(payload).hexdigest(), "length": len(payload), **header}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(json.dumps(head).encode() + b"\n")
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return head


# What the pickles of sealed files name (``torch.save`` of :data:`DATA_TYPES`, protocol 2),
# for :func:`sealed_header`'s scan: each is one torch's weights-only unpickler allows
# (tests/test_checkpoint_scan.py holds the two together), so a file that passes the scan is one
# :func:`read_sealed` loads, as far as what its pickle names can tell.
_SCAN_NAMES = frozenset({
    "collections.OrderedDict", "collections.Counter", "builtins.set", "builtins.complex",
    "builtins.bytearray", "_codecs.encode", "torch.Size", "torch.device",
    "torch.serialization._get_layout", "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
    "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct"})
_SCAN_PATTERN = re.compile(r"torch\.(?:cuda\.)?(?:BFloat16|Bool|Byte|Char|ComplexDouble|"
                           r"ComplexFloat|Double|Float|Half|Int|Long|Short)Storage|"
                           r"torch\.(?:u?int(?:8|16|32|64)|float(?:16|32|64)|bfloat16|bool|"
                           r"complex(?:64|128))")
# Opcodes that build or call something without naming it in a GLOBAL (never in torch.save's
# protocol 2 of data): a pickle with one is refused by the scan.
_SCAN_REFUSED_OPS = frozenset({"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"})


def _scan_pickle(payload: bytes) -> str | None:
    """Why the pickle of a ``torch.save`` payload would not load as data (what it calls that
    :data:`_SCAN_NAMES` does not name), without importing torch or running any of it; None
    when it names only data.  ValueError when the payload is not a ``torch.save`` zip."""
    import pickletools
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise ValueError("not one data.pkl")
            data = archive.read(pickles[0])
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ValueError(str(e)) from None
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _SCAN_REFUSED_OPS:
                return f"its pickle uses {op.name}"
            if op.name == "GLOBAL":
                module, name = str(arg).split(" ", 1)
                full = f"{'builtins' if module == '__builtin__' else module}.{name}"
                if full not in _SCAN_NAMES and not _SCAN_PATTERN.fullmatch(full):
                    return f"its pickle calls {full}"
    except ValueError as e:   # a malformed pickle: torch.load would fail on it too
        return f"its pickle is malformed ({e})"
    return None


def _sealed_payload(path: Path, what: str) -> tuple[dict, bytes]:
    """The header and payload of a sealed file, magic, length and sha256 checked."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SealedFileError(f"{what} {path}: cannot read ({e.strerror})") from None
    if not data.startswith(MAGIC):
        raise SealedFileError(f"{what} {path}: not an mpsync {what} (bad magic)")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise SealedFileError(f"{what} {path}: truncated header")
    try:
        header = json.loads(data[len(MAGIC):end])
        digest, length = str(header["sha256"]), int(header["length"])
    except (ValueError, KeyError, TypeError):
        raise SealedFileError(f"{what} {path}: corrupt header") from None
    payload = data[end + 1:]
    if len(payload) != length:
        raise SealedFileError(f"{what} {path}: truncated ({len(payload)} of {length} "
                              f"payload bytes)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise SealedFileError(f"{what} {path}: corrupt (sha256 mismatch)")
    return header, payload


def sealed_header(path: str | os.PathLike, what: str = "checkpoint") -> dict:
    """The header of a sealed file that :func:`read_sealed` would load, checked as it checks
    the file (magic, length, sha256; the pickle names only data), without importing torch and
    without loading the state: SealedFileError as :func:`read_sealed` raises it.  What the
    scan cannot tell (a payload that is not a ``torch.save`` zip, e.g. of an older torch) is
    checked by loading it."""
    path = Path(path)
    header, payload = _sealed_payload(path, what)
    try:
        why = _scan_pickle(payload)
    except ValueError:
        read_sealed(path, what)
        return header
    if why is not None:
        raise SealedFileError(f"{what} {path}: refused, not plain data ({why}); nothing in it "
                              f"was run")
    return header


def read_sealed(path: str | os.PathLike, what: str = "checkpoint"):
    """The state stored in ``path`` by :func:`write_sealed`; SealedFileError if it is corrupt,
    truncated, not one, or holds more than data (its pickle would call something to build it:
    refused before that call, so nothing in the file runs)."""
    path = Path(path)
    _, payload = _sealed_payload(path, what)
    try:
        return _load_data(payload)
    except Exception as e:  # noqa: BLE001 - whatever the payload does, one line naming it
        raise SealedFileError(f"{what} {path}: refused, not plain data ({_why_not_data(e)}); "
                              f"nothing in it was run") from None


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the file system allows it)."""
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


def prune_rank_files(root: Path, rank: int, horizon: int) -> None:
    """Remove ``rank``'s own file of every commit older than ``horizon`` under ``root``.  On a
    shared disk rank 0 removes whole old commits meanwhile (``CommitStore._prune_complete``):
    a commit that vanishes while this runs is gone as wanted, never an error (it used to fail
    the commit being written, ending the job)."""
    mine = f"rank-{rank:05d}.pt"
    try:
        with os.scandir(root) as entries:
            names = [e.name for e in entries if e.name.startswith("commit-")]
    except FileNotFoundError:
        return
    for name in names:
        try:
            old = int(name.split("-")[1]) < horizon
        except ValueError:
            continue
        if old:
            try:
                os.unlink(os.path.join(root, name, mine))
            except (FileNotFoundError, NotADirectoryError):
                pass


class BackgroundWriter:
    """Runs write jobs on one thread, newest first: a job submitted while another waits
    replaces it (the older commit is superseded, not queued).  An exception of a job is raised
    by the next :meth:`submit` or :meth:`wait`, so a failing disk is not silent."""

    def __init__(self, name: str = "mpsync-commit-writer"):
        self._cond = threading.Condition()
        self._pending: Callable[[], None] | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self.superseded = 0          # jobs replaced before they started
        self.written = 0
        self.write_s = 0.0           # seconds spent in jobs (for the cost of a commit)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError("BackgroundWriter is closed")
            if self._pending is not None:
                self.superseded += 1
            self._pending = job
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until no job waits or runs (True), or ``timeout`` passes (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            self._raise_error()
        return True

    def close(self, timeout: float | None = None) -> bool:
        done = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if done:
            # Idle: the thread returns at once.  Joined, so it is not still ending (and
            # dropping its last references) while the interpreter finalizes.
            self._thread.join(1.0)
        return done

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"a background commit write failed: {err}") from err

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, True
            t0 = time.perf_counter()
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                with self._cond:
                    self._error = e
            finally:
                # The job holds the commit's tensors: not kept while the thread idles (a
                # daemon thread dropping a tensor at interpreter exit aborts the process).
                job = None
                with self._cond:
                    self._busy = False
                    self.written += 1
                    self.write_s += time.perf_counter() - t0
                    self._cond.notify_all()


@dataclass(frozen=True)
class Manifest:
    """A commit complete on every rank of the job that wrote it."""
    directory: Path
    seq: int
    size: int                 # ranks of the job that wrote it
    files: dict               # rank -> {"name", "sha256", "length"}
    info: dict                # what the committer attached (step, wall time, ...)

    def path_of(self, rank: int) -> Path:
        return self.directory / self.files[rank]["name"]


def _commit_dir(root: Path, seq: int) -> Path:
    return root / f"commit-{seq:09d}"


def newest_complete(root: str | os.PathLike) -> Manifest | None:
    """The newest commit under ``root`` whose manifest is there (None when there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    for d in sorted((p for p in root.iterdir() if p.name.startswith("commit-")), reverse=True):
        try:
            m = json.loads((d / MANIFEST).read_text())
            return Manifest(d, int(m["seq"]), int(m["size"]),
                            {int(r): f for r, f in m["files"].items()}, m.get("info", {}))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def load_committed(manifest: Manifest, rank: int):
    """Rank ``rank``'s state of a complete commit (checked against the manifest's digest)."""
    return read_sealed(manifest.path_of(rank), what="commit")


class CommitStore:
    """One job's durable commits under ``root`` (see the module doc).  Created collectively
    on every rank of ``comm`` (its ``Dup()`` carries the reports to rank 0)."""

    def __init__(self, root: str | os.PathLike, comm, *, keep: int = 2,
                 report_timeout: float = 60.0):
        from mpi4py import MPI

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.keep, self.report_timeout = max(1, keep), report_timeout
        self.threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self.writer = BackgroundWriter() if self.threaded else None
        self.last_complete = -1                    # rank 0: the newest manifest written
        self._lock = threading.Lock()
        self._reported: dict[int, dict] = {}       # rank 0: seq -> {rank: file entry}
        self._last_own = -1
        self._collector = None
        self._stop = threading.Event()
        if self.rank == 0 and self.threaded and self.size > 1:
            self._collector = threading.Thread(target=self._collect, daemon=True,
                                               name="mpsync-commit-manifest")
            self._collector.start()

    # -- every rank ----------------------------------------------------------------------------
    def commit(self, seq: int, state, info: dict | None = None) -> None:
        """Write ``state`` (already a copy: the caller goes on changing the original) as this
        rank's part of commit ``seq``, in the background.  TypeError at once when ``state``
        is not data (:func:`check_data`): a commit is resumed from by another job."""
        check_data(state, what="commit")

        def job():
            self._write(seq, state, info or {})
        if self.writer is None:
            job()
            if self.rank == 0 and self.size > 1:
                self._drain_reports(block_until=None)
        else:
            self.writer.submit(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Until this rank's writes are done and (rank 0) the last one's manifest is written."""
        ok = self.writer.wait(timeout) if self.writer is not None else True
        if self.rank == 0 and self._last_own >= 0:
            end = time.monotonic() + (self.report_timeout if timeout is None else timeout)
            while self.last_complete < self._last_own and time.monotonic() < end:
                if self._collector is None:
                    self._drain_reports(block_until=end)
                else:
                    time.sleep(0.005)
            ok = ok and self.last_complete >= self._last_own
        return ok

    def close(self, timeout: float | None = None) -> bool:
        ok = self.flush(timeout)
        if self.writer is not None:
            self.writer.close(0)
        self._stop.set()
        if self._collector is not None:
            self._collector.join(1.0)
        return ok

    def _write(self, seq: int, state, info: dict) -> None:
        d = _commit_dir(self.root, seq)
        d.mkdir(parents=True, exist_ok=True)
        name = f"rank-{self.rank:05d}.pt"
        head = write_sealed(d / name, state, seq=seq, rank=self.rank, size=self.size)
        entry = {"name": name, "sha256": head["sha256"], "length": head["length"]}
        self._last_own = seq
        if self.rank == 0:
            self._record(seq, 0, entry, info)
        else:
            # Small and sent eagerly; rank 0 matches it by tag on the store's own communicator.
            self.comm.send((seq, entry), dest=0, tag=_REPORT_TAG)
        self._prune_own(seq)

    # -- rank 0: collecting reports, writing manifests ----------------------------------------
    def _record(self, seq: int, rank: int, entry: dict, info: dict | None = None) -> None:
        with self._lock:
            got = self._reported.setdefault(seq, {})
            got[rank] = entry
            if info is not None:
                got["info"] = info
            complete = sorted(s for s, g in self._reported.items()
                              if sum(1 for k in g if k != "info") == self.size
                              and "info" in g and s > self.last_complete)
            if not complete:
                return
            seq = complete[-1]
            files = {r: e for r, e in self._reported[seq].items() if r != "info"}
            info = self._reported[seq]["info"]
            for s in [s for s in self._reported if s <= seq]:
                del self._reported[s]
        self._write_manifest(seq, files, info)

    def _write_manifest(self, seq: int, files: dict, info: dict) -> None:
        d = _commit_dir(self.root, seq)
        tmp = d / f".{MANIFEST}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"seq": seq, "size": self.size, "info": info,
                                   "files": {str(r): e for r, e in sorted(files.items())},
                                   "written_at": time.time()}))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, d / MANIFEST)
        fsync_dir(d)
        self.last_complete = seq
        self._prune_complete(seq)

    def _drain_reports(self, block_until: float | None) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        while True:
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REPORT_TAG, status=status):
                seq, entry = self.comm.recv(source=status.Get_source(), tag=_REPORT_TAG)
                self._record(seq, status.Get_source(), entry)
                continue
            if block_until is None or time.monotonic() >= block_until:
                return
            time.sleep(0.005)

    def _collect(self) -> None:
        # Polls (a blocking receive would spin a core in Open MPI); 10 ms bounds the delay
        # between the last rank's write and the manifest.
        while not self._stop.is_set():
            self._drain_reports(block_until=None)
            self._stop.wait(0.01)
        self._drain_reports(block_until=None)

    # -- pruning -------------------------------------------------------------------------------
    def _prune_complete(self, newest: int) -> None:
        """Rank 0: keep the newest ``keep`` complete commits and anything newer than them."""
        dirs = sorted(p for p in self.root.iterdir() if p.name.startswith("commit-"))
        complete = [p for p in dirs if (p / MANIFEST).exists()]
        if len(complete) <= self.keep:
            return
        oldest_kept = complete[-self.keep].name
        for p in dirs:
            if p.name < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    def _prune_own(self, seq: int) -> None:
        """Every rank: its own files of commits far older than the last it wrote (on a
        node-local disk rank 0 never sees them)."""
        if self.rank != 0:
            prune_rank_files(self.root, self.rank, seq - 4 * self.keep)
