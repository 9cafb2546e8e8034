"""How the parameter server is sharded: how many shards, which worker hosts each, which bytes
each holds.  Pure functions of plain values (host names, counts), no MPI: the MPI glue is
:mod:`mpsync.server.shards`.

The layout follows the sharded key-value stores the ESync and DSSP papers ran on (MXNet's
kvstore; ps-lite and BytePS likewise): the flat parameter vector is cut into ``S`` contiguous
ranges of equal bytes, one per shard server, so a worker's push or pull of the whole model
puts B/S bytes on each server's link instead of B on one.
"""

from __future__ import annotations

from typing import NamedTuple

from mpsync.config import ConfigError

__all__ = ["SINGLE_HOST_SHARDS", "ShardLayout", "resolve_shard_count", "place_shards",
           "shard_bounds", "plan_layout", "shards_unavailable"]

# ``auto`` on one host: two shard servers show the sharded protocol (and split the work of
# applying updates over two processes) without taking more of a small machine.
SINGLE_HOST_SHARDS = 2


class ShardLayout(NamedTuple):
    """``hosts[k]``: the worker index (rank in the workers' communicator) that runs shard
    ``k``; ``nodes``: how many distinct hosts the workers are on."""
    hosts: tuple[int, ...]
    nodes: int

    @property
    def count(self) -> int:
        return len(self.hosts)


def resolve_shard_count(requested, hostnames: list[str]) -> int:
    """``requested`` (``"auto"`` or an int >= 1, as :func:`mpsync.config.parse_ps_shards`
    returns it) for workers on ``hostnames`` (one per worker): ``auto`` is one shard per
    node, or :data:`SINGLE_HOST_SHARDS` on a single node, never more than the workers."""
    workers = len(hostnames)
    nodes = len(set(hostnames))
    if requested == "auto":
        return max(1, min(nodes if nodes > 1 else SINGLE_HOST_SHARDS, workers))
    if requested > workers:
        raise ConfigError(f"ps_shards={requested}: more shards than the {workers} worker "
                          f"rank(s) that would host them (each hosts at most one); use "
                          f"ps_shards <= {workers} or 'auto'")
    return requested


def place_shards(count: int, hostnames: list[str]) -> tuple[int, ...]:
    """The worker hosting each shard: spread over the nodes first (shard k on the
    (k mod nodes)-th node, in order of the nodes' first worker), so each node's link carries
    its share; within a node, its workers in rank order."""
    by_node: dict[str, list[int]] = {}
    for w, host in enumerate(hostnames):
        by_node.setdefault(host, []).append(w)
    hosts: list[int] = []
    depth = 0
    while len(hosts) < count:
        for workers in by_node.values():
            if depth < len(workers) and len(hosts) < count:
                hosts.append(workers[depth])
        depth += 1
    return tuple(hosts)


def shard_bounds(numel: int, count: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of each shard's elements: contiguous, sizes differing by at most one
    element.  The flat vector has one dtype, so equal elements are equal bytes."""
    if count > numel:
        raise ConfigError(f"ps_shards={count} is more than the model's {numel} parameter "
                          f"element(s): every shard must hold at least one; use "
                          f"ps_shards <= {numel}")
    base, extra = divmod(numel, count)
    bounds, start = [], 0
    for k in range(count):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def plan_layout(requested, hostnames: list[str]) -> ShardLayout:
    """The shard count and hosts for workers on ``hostnames`` (module doc)."""
    count = resolve_shard_count(requested, hostnames)
    return ShardLayout(place_shards(count, hostnames), len(set(hostnames)))


# MPI's thread levels (the standard's order: SINGLE < FUNNELED < SERIALIZED < MULTIPLE).
_THREAD_LEVELS = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED",
                  "MPI_THREAD_MULTIPLE")


def shards_unavailable(thread_level: int | None = None, dtypes=()) -> str | None:
    """Why this job cannot host the sharded parameter server, or None.  ``thread_level``: the
    level MPI provides, 0-3 as ``MPI.Query_thread()`` returns it (``MPI_THREAD_SINGLE`` ..
    ``MPI_THREAD_MULTIPLE``; None: not checked); ``dtypes``: the model's parameter dtypes, as
    names.

    A shard server is a thread of a worker rank that calls MPI while its trainer does
    (MPI_THREAD_MULTIPLE), and it holds the model as one flat vector of one dtype."""
    if thread_level is not None and thread_level < len(_THREAD_LEVELS) - 1:
        name = _THREAD_LEVELS[thread_level] if 0 <= thread_level else str(thread_level)
        return (f"MPI provides {name}, and the parameter server's shard threads need "
                f"MPI_THREAD_MULTIPLE")
    kinds = sorted({str(d) for d in dtypes})
    if len(kinds) > 1:
        return (f"the model mixes parameter dtypes ({', '.join(kinds)}), and the parameter "
                f"server holds one flat model of one dtype")
    return None
