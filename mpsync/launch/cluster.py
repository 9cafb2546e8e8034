"""Starting mpsync's own jobs on the virtual cluster: the ``--cluster`` option of ``mpsync
train``, ``mpsync compare`` and the benchmarks.

    mpsync train --cluster --np 4 --policy esync --time-budget 20      # 5 ranks, 4 nodes
    mpsync compare --cluster --np 3 --policies bsp,esync

``--cluster`` takes an optional cluster name (default ``$MPSYNC_CLUSTER`` or ``mpsync``).  Rank
0 (the dedicated state server) runs alone on node1; the other ranks go round-robin over the
other nodes (``--cluster-placement round-robin``: every rank round-robin over all nodes).
"""

from __future__ import annotations

import argparse

from mpsync import cluster as vc
from mpsync.launch.mpirun import mpirun_argv
from mpsync.launch.target import LaunchTarget

__all__ = ["add_cluster_arguments", "cluster_mpirun_extra", "cluster_mpirun_argv",
           "argv_from_namespace", "TARGET", "PLACEMENTS"]

PLACEMENTS = ("server-alone", "round-robin")


def add_cluster_arguments(parser) -> None:
    """``--cluster [NAME]`` and ``--cluster-placement`` (for a parser or an argument group)."""
    parser.add_argument("--cluster", nargs="?", const="", default=None, metavar="NAME",
                        help="run the ranks on the nodes of the virtual cluster "
                             "(`mpsync cluster up`); NAME defaults to $MPSYNC_CLUSTER or mpsync")
    parser.add_argument("--cluster-placement", default="server-alone",
                        choices=PLACEMENTS,
                        help="server-alone: rank 0 alone on node1, the rest round-robin over "
                             "the other nodes; round-robin: every rank over all nodes")


def cluster_mpirun_extra(np: int, cluster: str | None = "", *,
                         placement: str = "server-alone", tuning: str | None = None) -> list[str]:
    """The options ``mpirun_argv(extra=...)`` needs to put ``np`` ranks on the
    cluster's nodes ([] when ``cluster`` is None: run on this host), the transport settings
    of ``mpsync.transport`` for ``tuning`` (None: ``$MPSYNC_MPI_TUNING`` or the tuned set)
    last."""
    if cluster is None:
        return []
    return vc.launch_options(np, name=cluster or None,
                             server_alone=placement == "server-alone", tuning=tuning)


def cluster_mpirun_argv(np: int, command: list[str], cluster: str | None = "", *,
                        placement: str = "server-alone", tuning: str | None = None,
                        **mpirun_kw) -> list[str]:
    """``mpirun_argv`` for ``np`` ranks of ``command`` on the cluster (any ``mpirun_argv``
    keyword passes through; ``extra`` is appended after the cluster's options)."""
    extra = tuple(cluster_mpirun_extra(np, cluster, placement=placement, tuning=tuning)) + \
        tuple(mpirun_kw.pop("extra", ()))
    return mpirun_argv(np, command, extra=extra, **mpirun_kw)


def argv_from_namespace(parser: argparse.ArgumentParser, args: argparse.Namespace,
                        drop: tuple[str, ...] = ()) -> list[str]:
    """Flags that reproduce ``args`` under ``parser`` (options whose value differs from the
    default; ``drop``: destinations left out).  For re-running a command under ``mpirun``."""
    argv: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk of its options
        if not action.option_strings or action.dest in drop or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            argv.append(flag)
        elif isinstance(action, argparse._StoreFalseAction):  # noqa: SLF001
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


TARGET = LaunchTarget(name="cluster", description="the virtual cluster's nodes (mpsync cluster "
                                                  "up): mpirun through its ssh stand-in",
                      argv=cluster_mpirun_argv)
