"""mpsync: decide *when* data-parallel workers synchronize, not only how.

Public entry points:

- ``mpsync.sched``   pure Numba scheduling kernels (ZipLine, DSSP, ESync, SSP, OSP)
- ``mpsync.torch``   the Horovod-like PyTorch API (``import mpsync.torch as mps``)
- ``mpsync`` CLI     ``mpsync train``, ``mpsync compare``, ``mpsync bench``, ``mpsync doctor``
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
