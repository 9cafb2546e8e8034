"""The one place mpsync.sched configures Numba.

Every kernel is compiled with ``njit(cache=True)`` so that a freshly started state server loads
machine code from the on-disk cache instead of recompiling (see ``mpsync bench zipline``, which
reports compile time and cached-start time separately). Numba writes the cache next to the
source (``__pycache__``); when that directory is not writable it falls back to a per-user
directory, and ``NUMBA_CACHE_DIR`` overrides both. ``NUMBA_DISABLE_JIT=1`` turns every kernel
back into the plain Python function it was written as, for debugging.
"""

from __future__ import annotations

import numba

__all__ = ["jit"]


def jit(func):
    """Compile ``func`` in nopython mode with the on-disk cache enabled."""
    return numba.njit(cache=True, nogil=True)(func)
