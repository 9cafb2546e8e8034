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


def jit(func=None, *, inline: bool = False):
    """Compile ``func`` in nopython mode with the on-disk cache enabled.  ``@jit(inline=True)``
    also inlines it into every compiled caller (Numba IR inlining): for the small helpers of
    a loop that runs once per event, where a call each time costs measurably."""
    if func is None:
        return lambda f: jit(f, inline=inline)
    return numba.njit(cache=True, nogil=True, inline="always" if inline else "never")(func)
