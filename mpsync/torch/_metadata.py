"""What every worker says about a collective before any data moves, and the check of it.

Horovod's coordinator compares the requests of every rank for one tensor name (operation,
dtype, shape, reduce op, scale factors, root) and answers a mismatch with an error response
that every rank raises.  mpsync does the same with one small exchange per collective: each
worker contributes a fixed-length int64 record (:func:`record`), the records are allgathered,
and :func:`mismatch` -- a pure function of the gathered records, so every worker computes the
same answer -- says what differs, naming the workers.  A worker that has called ``join()``
contributes a ``JOINED`` record and learns from the others' records what to take part in.
A grouped call contributes one record holding its parts' (:func:`group_record`).

No MPI and no torch here: plain values in, numpy records out.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

__all__ = ["ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER",
           "JOINED", "GROUP", "KIND_NAMES", "HEAD", "MAX_DIMS", "record", "joined_record",
           "group_record", "group_parts", "part_kinds", "reference", "mismatch", "Field",
           "shape_of", "float_bits", "name_hash"]

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOINED, GROUP = range(1, 9)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
              ALLTOALL: "alltoall", REDUCESCATTER: "reducescatter", BARRIER: "barrier",
              JOINED: "join", GROUP: "grouped collective"}
MAX_DIMS = 8  # dimensions carried one by one; a tensor with more is compared by a hash


class Field:
    """Positions in a record; ``HEAD`` of them, then one entry per worker (alltoall splits)."""
    KIND, DTYPE, NDIM = 0, 1, 2
    DIMS = 3                      # MAX_DIMS entries
    SHAPE_HASH = DIMS + MAX_DIMS
    OP, ROOT, PRESCALE, POSTSCALE, NAME, ROW_BYTES, NBYTES, JOINED_ROUNDS, INVALID = \
        range(SHAPE_HASH + 1, SHAPE_HASH + 10)


HEAD = Field.INVALID + 1


def float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


def name_hash(name: str | None) -> int:
    return 0 if name is None else zlib.crc32(name.encode()) + 1


def record(size: int, kind: int, *, dtype: int = -1, shape: tuple = (), op: int = -1,
           root: int = -1, prescale: float = 1.0, postscale: float = 1.0,
           name: str | None = None, row_bytes: int = 0, nbytes: int = 0,
           splits=None, invalid: bool = False) -> np.ndarray:
    """This worker's record for one collective over ``size`` workers."""
    key = None
    if splits is None and prescale and postscale:  # (0.0 == -0.0: their bits differ)
        key = (size, kind, dtype, shape, op, root, prescale, postscale, name, row_bytes,
               nbytes, invalid)
        made = _MADE.get(key)
        if made is not None:
            return made.copy()
    r = np.zeros(HEAD + size, dtype=np.int64)
    r[Field.KIND], r[Field.DTYPE], r[Field.NDIM] = kind, dtype, len(shape)
    r[Field.DIMS:Field.DIMS + min(len(shape), MAX_DIMS)] = shape[:MAX_DIMS]
    r[Field.SHAPE_HASH] = zlib.crc32(repr(tuple(int(d) for d in shape)).encode())
    r[Field.OP], r[Field.ROOT] = op, root
    r[Field.PRESCALE], r[Field.POSTSCALE] = float_bits(prescale), float_bits(postscale)
    r[Field.NAME] = name_hash(name)
    r[Field.ROW_BYTES], r[Field.NBYTES] = row_bytes, nbytes
    r[Field.INVALID] = int(invalid)
    if splits is not None:
        r[HEAD:] = splits
    if key is not None:
        if len(_MADE) >= 4096:
            _MADE.clear()
        _MADE[key] = r.copy()
    return r


# Records made before, by their fields: a training loop submits the same collectives at
# every step, and building one (hashes, packed floats) costs more than copying it.
_MADE: dict[tuple, np.ndarray] = {}


def joined_record(size: int, rounds: int) -> np.ndarray:
    """The record of a worker inside ``join()`` that has served ``rounds`` collectives."""
    r = np.zeros(HEAD + size, dtype=np.int64)
    r[Field.KIND], r[Field.JOINED_ROUNDS] = JOINED, rounds
    return r


def group_record(parts: list[np.ndarray]) -> np.ndarray:
    """One record for a grouped call (Horovod's grouped ops: one request, one response):
    ``GROUP``, the number of parts, then every part's record.  Negotiated as one name, it
    costs one exchange however many tensors the group holds."""
    return np.concatenate([np.array([GROUP, len(parts)], dtype=np.int64), *parts])


def group_parts(records: np.ndarray) -> list[np.ndarray]:
    """A grouped call's gathered records (rows in worker order, checked by :func:`mismatch`:
    every active worker grouped as many parts) as one records array per part; a joined
    worker's row is its joined record in every part."""
    active = records[:, Field.KIND] != JOINED
    ref = records[int(np.argmax(active))]
    n = int(ref[1])
    if n == 0:
        return []
    width = (ref.size - 2) // n
    if active.all():  # (the usual case: views, no copies)
        rows = records[:, 2:2 + n * width].reshape(len(records), n, width)
        return [rows[:, i] for i in range(n)]
    out = []
    for i in range(n):
        part = np.empty((len(records), width), dtype=np.int64)
        part[active] = records[active, 2 + i * width:2 + (i + 1) * width]
        part[~active] = records[~active, :width]
        out.append(part)
    return out


def reference(records: np.ndarray) -> np.ndarray | None:
    """The record of the first member that has not joined (None: every member has)."""
    active = records[records[:, Field.KIND] != JOINED]
    return active[0] if len(active) else None


def part_kinds(records: np.ndarray) -> list[int]:
    """The kinds of collective a checked entry runs: its own, or a group's parts'."""
    ref = reference(records)
    if ref is None:
        return []
    if ref[Field.KIND] != GROUP:
        return [int(ref[Field.KIND])]
    return [int(reference(part)[Field.KIND]) for part in group_parts(records)]


def shape_of(rec: np.ndarray) -> tuple | None:
    """The shape a record carries (None beyond MAX_DIMS dimensions: only its hash travels)."""
    n = int(rec[Field.NDIM])
    return None if n > MAX_DIMS else tuple(int(d) for d in rec[Field.DIMS:Field.DIMS + n])


def _shape_text(rec: np.ndarray) -> str:
    s = shape_of(rec)
    return f"a tensor of rank {int(rec[Field.NDIM])}" if s is None else \
        f"a tensor of shape {list(s)}"


def mismatch(records: np.ndarray, dtype_names, op_names) -> str | None:
    """What differs between the workers' records (rows in worker order), or None.

    ``dtype_names[code]`` / ``op_names[op]`` render codes in messages.  The first active
    worker is the reference; the message names it and the first worker that differs.
    """
    active = [w for w in range(len(records)) if records[w, Field.KIND] != JOINED]
    if not active:
        return None
    if any(records[w, Field.KIND] == GROUP for w in active):
        return _group_mismatch(records, active, dtype_names, op_names)
    ref = records[active[0]]
    kind = KIND_NAMES[int(ref[Field.KIND])]
    a = active[0]
    for w in active[1:]:
        msg = _compare(ref, records[w], a, w, kind, dtype_names, op_names)
        if msg:
            return msg
    invalid = [w for w in active if records[w, Field.INVALID]]
    if invalid:
        return (f"{kind}: worker(s) {invalid} passed invalid arguments (their error says "
                f"which); no data was exchanged")
    joined = [w for w in range(len(records)) if w not in active]
    if joined:
        return _with_join(ref, kind, joined)
    return None


def _group_mismatch(records: np.ndarray, active: list[int], dtype_names,
                    op_names) -> str | None:
    """:func:`mismatch` for a grouped call: every active worker grouped as many parts, then
    each part checked as a collective of its own (the first part that differs is named)."""
    a = active[0]
    ref = records[a]
    for w in active[1:]:
        rec = records[w]
        if (rec[Field.KIND] == GROUP) != (ref[Field.KIND] == GROUP):
            g, s = (a, w) if ref[Field.KIND] == GROUP else (w, a)
            other = KIND_NAMES.get(int(records[s, Field.KIND]), "another collective")
            return (f"Mismatched collective operations: worker {g} called a grouped "
                    f"collective, but worker {s} called {other} under the same name (every "
                    f"worker must call the same collectives in the same order)")
        if rec[1] != ref[1]:
            return (f"Mismatched grouped collectives: worker {a} grouped {int(ref[1])} "
                    f"tensors, but worker {w} grouped {int(rec[1])}")
    for part in group_parts(records):
        msg = mismatch(part, dtype_names, op_names)
        if msg:
            return msg
    return None


def _compare(ref, rec, a: int, w: int, kind: str, dtype_names, op_names) -> str | None:
    F = Field
    if rec[F.KIND] != ref[F.KIND]:
        return (f"Mismatched collective operations: worker {a} called {kind}, but worker {w} "
                f"called {KIND_NAMES[int(rec[F.KIND])]} (every worker must call the same "
                f"collectives in the same order)")
    if rec[F.NAME] != ref[F.NAME]:
        return (f"Mismatched {kind} names: workers {a} and {w} called {kind} with different "
                f"name= (every worker must call the same collectives in the same order)")
    if rec[F.DTYPE] != ref[F.DTYPE]:
        return (f"Mismatched data types: worker {a} had type {dtype_names[int(ref[F.DTYPE])]}, "
                f"but worker {w} had type {dtype_names[int(rec[F.DTYPE])]}")
    first_free = kind in ("allgather", "alltoall")
    if first_free:
        if rec[F.NDIM] != ref[F.NDIM]:
            return (f"Mismatched {kind} tensor shapes: worker {a} sent a tensor of rank "
                    f"{int(ref[F.NDIM])}, but worker {w} sent a tensor of rank "
                    f"{int(rec[F.NDIM])}")
        for d in range(1, min(int(ref[F.NDIM]), MAX_DIMS)):
            if rec[F.DIMS + d] != ref[F.DIMS + d]:
                return (f"Mismatched {kind} tensor shapes: worker {a} sent a tensor with "
                        f"dimension {d} equal to {int(ref[F.DIMS + d])}, but worker {w} sent "
                        f"a tensor with dimension {d} equal to {int(rec[F.DIMS + d])}")
        if rec[F.ROW_BYTES] != ref[F.ROW_BYTES]:
            return (f"Mismatched {kind} tensor shapes: workers {a} and {w} sent tensors that "
                    f"differ beyond the first dimension")
    elif kind != "barrier" and (rec[F.NDIM] != ref[F.NDIM] or
                                rec[F.SHAPE_HASH] != ref[F.SHAPE_HASH]):
        return (f"Mismatched {kind} tensor shapes: worker {a} sent {_shape_text(ref)}, but "
                f"worker {w} sent {_shape_text(rec)}")
    if rec[F.OP] != ref[F.OP]:
        return (f"Mismatched reduction operation: worker {a} sent op "
                f"{op_names.get(int(ref[F.OP]), ref[F.OP])}, but worker {w} sent op "
                f"{op_names.get(int(rec[F.OP]), rec[F.OP])}")
    if rec[F.PRESCALE] != ref[F.PRESCALE] or rec[F.POSTSCALE] != ref[F.POSTSCALE]:
        return (f"Mismatched prescale and/or postscale factors: worker {a} sent factors "
                f"({_bits_float(ref[F.PRESCALE]):g}, {_bits_float(ref[F.POSTSCALE]):g}), but "
                f"worker {w} sent factors ({_bits_float(rec[F.PRESCALE]):g}, "
                f"{_bits_float(rec[F.POSTSCALE]):g})")
    if rec[F.ROOT] != ref[F.ROOT]:
        return (f"Mismatched {kind} root ranks: worker {a} specified root rank "
                f"{int(ref[F.ROOT])}, but worker {w} specified root rank {int(rec[F.ROOT])}")
    return None


def _with_join(ref, kind: str, joined: list[int]) -> str | None:
    """What a collective cannot do while ``joined`` workers wait in ``join()``.  Horovod's
    coordinator lets joined ranks contribute zeros to an allreduce and take part in a
    barrier; an allgather, broadcast, alltoall or reducescatter is answered with an error on
    the ranks that called it (its messages, as Horovod 0.28.1 words them)."""
    if kind in ("allgather", "broadcast", "alltoall", "reducescatter"):
        name = kind[0].upper() + kind[1:]
        return (f"{name} is not supported with Join at this time (workers {joined} have "
                f"joined).")
    return None
