"""A parameter-server copy of the model (or of one shard of it): one flat vector in the
parameters' dtype, the updates applied to it, and its version.

No MPI here: a serve loop (the state server's, or a shard server's) receives a payload, asks
this store to take it, and sends what it returns.  A refused payload leaves the weights as
they were, and the reason comes back as text for the loop's rejection log.

Under the sharded parameter server (``mpsync.server.shards``) the state server holds no
weights: its store is *remote* (``init`` with an empty payload), and only counts the updates
the shard servers have applied (``version``), so the staleness rules read a whole-model count.
"""

from __future__ import annotations

import numpy as np

__all__ = ["WeightStore", "all_finite", "numpy_cast", "subtract_checked", "copy_checked",
           "BFLOAT16",
           "round_to_bfloat16", "widen_bfloat16"]

# bfloat16 on the wire.  numpy has no bfloat16: its values travel as their bits (the upper
# half of a float32's) in this 2-byte dtype of its own, which :func:`numpy_cast` and
# :func:`all_finite` read and nothing mistakes for an integer array.  The store of a bfloat16
# model is float32 (``mpsync.torch.strategies.ps``); the wire halves its bytes.
BFLOAT16 = np.dtype([("bfloat16", "<u2")])


def numpy_cast(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` between float dtypes (rounding to nearest even), :data:`BFLOAT16`
    included (to it through float32, as torch converts; a NaN stays a NaN).  The default;
    numpy converts float16 in software (10-270 ms per million values here, subnormals the
    slowest), so a worker passes torch's conversion (``mpsync.torch``), two orders of
    magnitude faster."""
    if dst.dtype == BFLOAT16:
        if src.dtype != np.float32:
            src = src.astype(np.float32)
        round_to_bfloat16(dst.view(np.uint16), src)
    elif src.dtype == BFLOAT16:
        if dst.dtype == np.float32 and dst.flags.c_contiguous:
            widen_bfloat16(dst.view(np.uint32), src.view(np.uint16))
        else:
            np.copyto(dst, (src.view(np.uint16).astype(np.uint32) << 16).view(np.float32),
                      casting="unsafe")
    else:
        np.copyto(dst, src, casting="unsafe")

# float16's exponent field: all ones is inf or NaN.  numpy's isfinite on float16 converts
# every value to float32 first (60x slower than this bit test on a 4 MB slice).
_F16_EXPONENT = 0x7C00
_BF16_EXPONENT = 0x7F80


def all_finite(values: np.ndarray) -> bool:
    """Whether every value is finite: what a shard checks on every push and a worker checks
    on the bytes it is about to send (float32/float64: one compiled read, no temporary)."""
    if values.dtype == np.float16:
        bits = np.bitwise_and(values.view(np.uint16), _F16_EXPONENT)
        return values.size == 0 or int(bits.max()) != _F16_EXPONENT
    if values.dtype == BFLOAT16:
        bits = np.bitwise_and(values.view(np.uint16), _BF16_EXPONENT)
        return values.size == 0 or int(bits.max()) != _BF16_EXPONENT
    if values.dtype in _COMPILED and values.flags.c_contiguous:
        return _finite(values.reshape(-1))
    return bool(np.all(np.isfinite(values)))


def subtract_checked(new: np.ndarray, base: np.ndarray) -> bool:
    """``base[:] = new - base`` (a worker's Δ since its last pull, written over the base it
    was computed from), and whether every value of Δ is finite, in one pass where numpy
    makes three (the subtraction, ``isfinite`` into a temporary, ``all``).  Both arrays of
    one float dtype and contiguous; the bits are numpy's ``np.subtract``'s."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"subtract_checked: {new.dtype}{list(new.shape)} and "
                         f"{base.dtype}{list(base.shape)} differ")
    if base.dtype in _COMPILED and new.flags.c_contiguous and base.flags.c_contiguous:
        return _subtract_finite(new.reshape(-1), base.reshape(-1))
    np.subtract(new, base, out=base)
    return all_finite(base)


def copy_checked(src: np.ndarray, dst: np.ndarray) -> bool:
    """``dst[:] = src`` (a gradient into its range of the buffer a push sends), and whether
    every value is finite, in one pass where a copy and :func:`all_finite` make two.  Both
    of one float dtype, of one size, contiguous."""
    if src.size != dst.size or src.dtype != dst.dtype:
        raise ValueError(f"copy_checked: {src.dtype}[{src.size}] into {dst.dtype}[{dst.size}]")
    if dst.dtype in _COMPILED and src.flags.c_contiguous and dst.flags.c_contiguous:
        return _copy_finite(src.reshape(-1), dst.reshape(-1))
    np.copyto(dst, src.reshape(dst.shape))
    return all_finite(dst)


class WeightStore:
    """The weights of the PS topology (the whole model, one shard, or none: ``remote``).

    ``scale`` is the factor every pushed update is applied with
    (``PolicySpec.ps_update_scale``): 1 applies each worker's update as it is (ASP, SSP,
    DSSP, ElasticBSP, Downpour style); 1/n averages a round's deltas (BSP) and ε/n is
    ESync's Eq. 7-8, where the policy's rules make every delta of a round arrive before
    anyone reads the result and every pull of it happen before the next round's deltas.
    ``version`` counts the updates applied, so a worker can tell how fresh its pull is.
    The dtype is the first payload's (the parameters' own: float32 for most models); an
    update of another floating dtype (float16 on the wire) is applied in the store's dtype.
    """

    def __init__(self, scale: float = 1.0, cast=numpy_cast):
        self.weights: np.ndarray | None = None
        self.version = 0
        self.scale = float(scale)
        self.remote = False
        self.cast = cast   # an update in another dtype (a float16 wire) into the store's
        self._scratch: np.ndarray | None = None
        # Where the weights live for good, if set before ``init`` (a shard's one-sided
        # window, ``ShardServer.pin``): ``init`` copies into it and every sum is made in it.
        self.pinned: np.ndarray | None = None

    @property
    def ready(self) -> bool:
        """Initialised by the first worker's ``ps_init``; pulls wait until then."""
        return self.weights is not None or self.remote

    @property
    def size(self) -> int:
        return 0 if self.weights is None else int(self.weights.size)

    def init(self, data: np.ndarray) -> None:
        """The initial weights; the first ``ps_init`` wins (workers start from one broadcast
        model, so later ones carry the same values).  An empty payload: the model lives on the
        shard servers and this store only counts updates."""
        if self.ready:
            return
        if data.size == 0:
            self.remote = True
        elif self.pinned is not None and self.pinned.shape == data.shape:
            self.cast(self.pinned, data)
            self.weights = self.pinned
        else:
            self.weights = np.array(data, copy=True)

    def detach(self) -> None:
        """Move the weights to a buffer of their own: the old one is still being read (a
        shard's pull reply in flight) and must not change under it."""
        if self.weights is not None and self.weights is not self.pinned:
            self.weights = self.weights.copy()

    def apply(self, update: np.ndarray, into: np.ndarray | None = None) -> str | None:
        """Add ``scale * update``; returns None, or why the update was refused.  ``into``: a
        buffer of the weights' size and dtype that becomes the weights, holding the sum (the
        current buffer is still read, and is left as it was): no copy before the add, as
        :meth:`detach` would make."""
        if self.remote:
            if update.size:
                return "push with a payload, but the model is on the shard servers"
            self.version += 1
            return None
        if self.weights is None or update.shape != self.weights.shape:
            return "push before ps_init or of the wrong length"
        if not all_finite(update):
            return "push with NaN or inf"
        if update.dtype != self.weights.dtype or self.scale != 1.0:
            if self._scratch is None:
                self._scratch = np.empty_like(self.weights)
            if update.dtype != self.weights.dtype:
                self.cast(self._scratch, update)
                update = self._scratch
            if self.scale != 1.0:
                np.multiply(update, self.scale, out=self._scratch)
                update = self._scratch
        if into is None or self.weights is self.pinned:
            self.weights += update
        else:
            np.add(self.weights, update, out=into)
            self.weights = into
        self.version += 1
        return None

    def pull_problem(self, count: int) -> str | None:
        """None if a pull of ``count`` values matches the model, else why not."""
        if self.remote:
            return None if count == 0 else (f"pull of {count} values, but the model is on "
                                            f"the shard servers")
        if count != self.size:
            return f"pull of {count} values, the model has {self.size}"
        return None


# -- the checks, compiled -----------------------------------------------------------------------
# ``x - x`` is 0 for a finite x and NaN for inf and NaN, so ``(x - x) != 0`` flags both, and
# the flags are or-ed into one boolean: no branch per element, so LLVM vectorizes the loop.
import numba  # noqa: E402

import mpsync.sched._numba  # noqa: E402,F401  (mpsync's stamped cache for these kernels)

_COMPILED = (np.dtype(np.float32), np.dtype(np.float64))
_check = numba.njit(cache=True, nogil=True, error_model="numpy")


@_check
def _finite(values):
    bad = False
    for i in range(values.size):
        x = values[i]
        bad |= (x - x) != 0
    return not bad


@_check
def _subtract_finite(new, base):
    bad = False
    for i in range(base.size):
        d = new[i] - base[i]
        base[i] = d
        bad |= (d - d) != 0
    return not bad


@_check
def _copy_finite(src, dst):
    bad = False
    for i in range(dst.size):
        x = src[i]
        dst[i] = x
        bad |= (x - x) != 0
    return not bad


@_check
def round_to_bfloat16(bits, src):
    """float32 ``src`` to bfloat16 ``bits``, rounding to nearest even as torch does (a NaN
    becomes the quiet NaN 0x7FC0; torch's vectorized conversion writes 0xFFFF, also a NaN)."""
    words = src.view(np.uint32)
    for i in range(src.size):
        x = src[i]
        if x != x:
            bits[i] = 0x7FC0
        else:
            u = words[i]
            bits[i] = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16


@_check
def widen_bfloat16(words, bits):
    """bfloat16 ``bits`` to float32, written as the float32s' ``words`` (a ``uint32`` view):
    exact, a bfloat16 is a float32 with its lower half zero."""
    for i in range(bits.size):
        words[i] = np.uint32(bits[i]) << 16
