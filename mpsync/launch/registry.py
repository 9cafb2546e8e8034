"""The launch registry: every way mpsync starts its ranks, one entry each, as policies are
registered in :mod:`mpsync.policies`.

``mpsync jobs`` renders the scripts of the targets that have templates; ``mpsync train
--cluster``, ``mpsync compare`` and the benchmarks build their command lines through
:func:`launch_argv`, which picks the target.  Adding a target is one module that defines its
:class:`~mpsync.launch.target.LaunchTarget` and one :func:`register` call (mpsync's own are
registered at the bottom of this file; one of your own, wherever your code runs first).
"""

from __future__ import annotations

from typing import Sequence

from mpsync.launch import cluster, horovodrun, mpirun, pbs, slurm
from mpsync.launch.target import LaunchError, LaunchTarget

__all__ = ["register", "unregister", "get", "names", "targets", "templates", "launch_argv",
           "LOCAL", "VIRTUAL_CLUSTER"]

# The targets that start ranks from this machine: on it, or on the virtual cluster's nodes.
LOCAL = "mpirun"
VIRTUAL_CLUSTER = "cluster"

_REGISTRY: dict[str, LaunchTarget] = {}


def register(target: LaunchTarget, *, replace: bool = False) -> LaunchTarget:
    """Add a target; registering a name twice is an error unless ``replace``."""
    if not isinstance(target, LaunchTarget):
        raise LaunchError(f"register() takes a LaunchTarget, got {type(target).__name__}")
    name = target.name
    if not name or not name.replace("-", "").isalnum() or name != name.lower():
        raise LaunchError(f"launch target name must be lower-case letters, digits or '-', "
                          f"got {name!r}")
    if target.templates and not (target.prologue and target.launch_text):
        raise LaunchError(f"launch target {name!r} has templates but no prologue or launch text")
    old = _REGISTRY.get(name)
    if old is not None and old is not target and not replace:
        raise LaunchError(f"launch target {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = target
    return target


def unregister(name: str) -> None:
    get(name)
    del _REGISTRY[name]


def get(name: str) -> LaunchTarget:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LaunchError(f"unknown launch target {name!r}; choose one of: "
                          f"{', '.join(_REGISTRY)}") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def targets() -> tuple[LaunchTarget, ...]:
    return tuple(_REGISTRY.values())


def templates() -> dict[tuple[str, str], str]:
    """(target, template) -> path of its default script under ``jobs/``, for every target."""
    return {(t.name, template): path for t in targets() for template, path in t.templates.items()}


def launch_argv(nprocs: int, command: Sequence[str], *, cluster: str | None = None,
                placement: str = "server-alone", **options) -> list[str]:
    """The command line that starts ``nprocs`` ranks of ``command``: here, or with ``cluster``
    (a name; "" for the default) on the virtual cluster's nodes, placed by ``placement``.
    ``options`` are :func:`mpsync.launch.mpirun.mpirun_options`'."""
    if cluster is None:
        return get(LOCAL).launch_argv(nprocs, command, **options)
    return get(VIRTUAL_CLUSTER).launch_argv(nprocs, command, cluster=cluster,
                                            placement=placement, **options)


for _target in (mpirun.TARGET, cluster.TARGET, slurm.TARGET, pbs.TARGET, horovodrun.TARGET):
    register(_target)
