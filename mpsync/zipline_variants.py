"""The names of the ZipLine barrier-search variants (implemented in :mod:`mpsync.sched.zipline`).

A module without imports, so that the configuration can check a variant name (and the CLI can
list them) without loading Numba; ``mpsync.sched.zipline`` dispatches on these same names.
"""

__all__ = ["ZIPLINE_VARIANTS", "EXACT_VARIANTS", "FASTEST_EXACT_VARIANT"]

ZIPLINE_VARIANTS: tuple[str, ...] = ("basic", "opt", "optbs", "gridscan", "fullgridscan", "window")
EXACT_VARIANTS: tuple[str, ...] = ("basic", "opt", "optbs", "fullgridscan", "window")
# All exact variants return the same barrier; this one is the fastest (bench/zipline), so it is
# the default of the server and of ``sched.zipline``.
FASTEST_EXACT_VARIANT = "window"
