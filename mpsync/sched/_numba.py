"""The one place mpsync.sched configures Numba.

Every kernel is compiled with ``njit(cache=True)`` so that a freshly started state server loads
machine code from the on-disk cache instead of recompiling (see ``mpsync bench zipline``, which
reports compile time and cached-start time separately). Numba writes the cache next to the
source (``__pycache__``); when that directory is not writable it falls back to a per-user
directory, and ``NUMBA_CACHE_DIR`` overrides both. ``NUMBA_DISABLE_JIT=1`` turns every kernel
back into the plain Python function it was written as, for debugging.

A cached function holds the machine code of every jitted function it calls, inlined or linked
in, but Numba checks only the caller's own source file before loading it: after an edit to
``server/rules.py`` the cached serve loop of ``server/_fastpath.py`` would go on running the
old rules.  So mpsync's cached functions carry a stamp of every source file in the packages
that hold jitted code (``JITTED_PACKAGES``) plus their own: any edit there recompiles them.
Numba's file-backed cache locators (``NUMBA_CACHE_DIR``, ``__pycache__``, the per-user
directory) are used as they are, with that stamp in place of the file's own.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

__all__ = ["jit", "JITTED_PACKAGES", "source_stamp"]

# The sub-packages of mpsync whose jitted functions call each other (directories).
JITTED_PACKAGES = ("sched", "server", "simulate")
_ROOT = Path(__file__).resolve().parent.parent
_tree_stamp: str | None = None


def source_stamp(py_file) -> str:
    """The cache stamp of a cached function defined in ``py_file``: the contents of its file
    and of every ``.py`` file in ``JITTED_PACKAGES`` (read once per process)."""
    global _tree_stamp
    if _tree_stamp is None:
        h = hashlib.sha256()
        for package in JITTED_PACKAGES:
            for path in sorted((_ROOT / package).glob("*.py")):
                h.update(path.name.encode())
                h.update(path.read_bytes())
        _tree_stamp = h.hexdigest()
    own = hashlib.sha256(Path(py_file).read_bytes()).hexdigest()
    return f"{_tree_stamp}:{own}"


def _stamped(base):
    """Numba's locator ``base``, for mpsync's files, stamped by :func:`source_stamp`."""
    class Locator(base):
        def get_source_stamp(self):
            return source_stamp(self._py_file)

        @classmethod
        def from_function(cls, py_func, py_file):
            try:
                ours = Path(py_file).resolve().is_relative_to(_ROOT)
            except (OSError, ValueError):
                ours = False
            return super().from_function(py_func, py_file) if ours else None

    Locator.__name__ = Locator.__qualname__ = f"MpsyncStamped{base.__name__}"
    return Locator


def _register_locators() -> None:
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    if impl is None:
        return
    if any(c.__name__.startswith("MpsyncStamped") for c in impl._locator_classes):
        return
    bases = [getattr(caching, name, None) for name in
             ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")]
    if all(bases) and not os.environ.get("NUMBA_CACHE_LOCATOR_CLASSES"):
        impl._locator_classes[:0] = [_stamped(b) for b in bases]


_register_locators()


def jit(func=None, *, inline: bool = False, refcount: bool = True):
    """Compile ``func`` in nopython mode with the on-disk cache enabled.  ``@jit(inline=True)``
    also inlines it into every compiled caller (Numba IR inlining): for the small helpers of
    a loop that runs once per event, where a call each time costs measurably.

    ``refcount=False`` compiles ``func`` without Numba's reference counting (its ``_nrt``
    option): for an event loop over arrays its caller allocated, and its helpers.  Numba
    counts a reference each time an array is taken out of a tuple or handed to an inlined
    helper, an atomic increment and decrement its pruning cannot remove inside a loop with
    branches; in the simulator's loops those were 35-70 % of the time.  Such a function
    cannot allocate (Numba refuses to compile an array creation in it); the jitted functions
    it calls keep their counting.  It is not inlined at Numba's IR level (LLVM still inlines
    what it finds worth it): IR inlining made the simulator's loops a fifth faster and
    their first compilation 40-60 % longer."""
    if func is None:
        return lambda f: jit(f, inline=inline, refcount=refcount)
    if not refcount:
        return numba.njit(cache=True, nogil=True, _nrt=False)(func)
    return numba.njit(cache=True, nogil=True, inline="always" if inline else "never")(func)
