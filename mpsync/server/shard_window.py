"""One-sided pushes and pulls for shards on the workers' own node: the worker adds its slice
into each shard's weights itself (``MPI_Accumulate``) and reads them (``MPI_Get``), through an
RMA window over the shards' memory, and the shard's thread is not involved at all.

Why: on one node Open MPI's shared-memory window (``osc/sm``) maps every shard's memory into
every worker, so an accumulate is the worker's own add into the shard's range (per element
atomic with respect to the other workers' accumulates) and a get its own copy out.  The
two-sided exchange needs the shard's thread to be scheduled, receive the slice into a buffer,
add it in a second pass, and send the result back; on a node whose cores all train, that is
where the time went (a push + pull of 8.7 MB with 2 workers on 2 cores took 1.2-2.1x a plain
program echoing the same slices, bench/allreduce/README.md, where the one-sided numbers are).

Which policies: those whose shards apply every push on arrival and never hold or freeze a
read (``PolicySpec.steps_unawaited`` without ``ps_average``: ASP, SSP, DSSP; the state server
decides when a pull may happen, the shards only store).  Their guarantees carry over:

* a push is complete on every shard (``MPI_Win_flush_all``) before the worker tells the state
  server of it, so a pull the server grants reads at least every push it counted (SSP's and
  DSSP's bound, "Dynamic Stale Synchronous Parallel Distributed Training for Deep Learning",
  §I.A and Alg. 1: a lower bound on what a read contains, as in the two-sided path);
* a refused push never reaches a shard: the worker checks it before anything is sent
  (``ShardClient.checked_push``), as it already did for the two-sided path.

What differs: a read may see another worker's concurrent push applied to part of a slice
(never part of an element).  ASP's reads are unsynchronised by design (the same paper, §I.A:
a worker reads whatever is current), and the two-sided path already lets a pull see newer
pushes on one shard than on another.  BSP, ESync and ElasticBSP read a round's or a
barrier's frozen weights, and the server-side optimizer steps on the shard: those stay
two-sided, as do a compressed wire, a job whose workers span nodes, ``auto`` (a switch
reloads the shards), and an MPI other than Open MPI (:func:`unavailable_reason` names which;
``ShardClient.open_window`` adds a wire in another dtype than the model's, and a dtype other
than float32 and float64).

The window also carries, per shard, when each worker last pushed (``CLOCK_MONOTONIC``, one
clock on one node) and how many pushes were applied, so the shard's liveness answers and its
stats still count the pushes it no longer receives.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

__all__ = ["ShardWindow", "unavailable_reason", "window_layout"]

_MPI_TYPES = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}


def unavailable_reason(config, workers) -> str | None:
    """Why this job's pushes and pulls cannot be one-sided, or None (collective over
    ``workers``: it asks which of them share a node)."""
    from mpsync import policies

    on_node = workers.Split_type(MPI.COMM_TYPE_SHARED, key=workers.Get_rank())
    one_node = on_node.Get_size() == workers.Get_size()
    on_node.Free()
    if not getattr(config, "ps_one_sided", True):
        return "ps_one_sided is off"
    if config.policy == policies.AUTO:
        return "under auto, a switch reloads the shards"
    spec = policies.get(config.policy)
    if not spec.steps_unawaited or spec.ps_average:
        return f"{config.policy}'s shards hold its rounds or barriers"
    if config.ps_optimizer == "server":
        return "the shards run the optimizer"
    if not one_node:
        return "the workers span nodes"
    if "Open MPI" not in MPI.Get_library_version():
        return "the MPI is not Open MPI (its shared-memory window was the one measured)"
    return None


def window_layout(elements: int, dtype, n_workers: int) -> tuple[int, int, int]:
    """A shard's window in bytes: ``(heard_at, pushes_at, size)``: its weights at 0, then
    (8-byte aligned) a float64 per worker (when it last pushed), then an int64 per worker
    (its pushes so far): each worker writes only its own, so no write there waits."""
    heard_at = -(-elements * np.dtype(dtype).itemsize // 8) * 8
    pushes_at = heard_at + 8 * n_workers
    return heard_at, pushes_at, pushes_at + 8 * n_workers


class ShardWindow:
    """A worker's one-sided access to every shard (module doc).

    ``win``: the window over the workers' communicator (disp_unit 1), each shard's host
    exposing :func:`window_layout`'s bytes for its range; ``bounds[k]`` and ``hosts[k]`` as
    in ``ShardClient``; ``worker``: this worker's index.  The window stays in one passive
    epoch (``Lock_all``) for the whole run: the shards never lock it, so nothing waits on a
    lock, and every operation completes in the worker's own calls (no deadline to miss).
    """

    def __init__(self, win, bounds, hosts, dtype, n_workers: int, worker: int):
        self.win = win
        self.bounds = tuple(bounds)
        self.hosts = tuple(hosts)
        self.dtype = np.dtype(dtype)
        self.mpi_type = _MPI_TYPES[self.dtype]
        self.worker = int(worker)
        self._at = [window_layout(b - a, self.dtype, n_workers) for a, b in self.bounds]
        # Each worker starts on another shard: accumulates into one shard take turns (its
        # lock), so workers that push at once would otherwise queue on the first shard.
        first = self.worker % len(self.bounds)
        self._order = [(self.bounds[k], self.hosts[k], self._at[k])
                       for k in (*range(first, len(self.bounds)), *range(first))]
        self._stamp = np.zeros(1, dtype=np.float64)
        self._pushes = np.zeros(1, dtype=np.int64)
        win.Lock_all()

    def push(self, wire: np.ndarray) -> None:
        """Add ``wire`` (the checked update, this dtype) into every shard's range; complete on
        every shard when this returns."""
        win, kind, me = self.win, self.mpi_type, 8 * self.worker
        for (a, b), host, _ in self._order:
            win.Accumulate([wire[a:b], kind], host, target=(0, b - a, kind), op=MPI.SUM)
        self._stamp[0] = time.monotonic()
        self._pushes[0] += 1
        for _, host, (heard_at, pushes_at, _) in self._order:
            win.Put([self._stamp, MPI.DOUBLE], host, target=(heard_at + me, 1, MPI.DOUBLE))
            win.Put([self._pushes, MPI.INT64_T], host, target=(pushes_at + me, 1, MPI.INT64_T))
        win.Flush_all()

    def pull(self, out: np.ndarray) -> None:
        """Every shard's weights into ``out`` (contiguous, this dtype)."""
        win, kind = self.win, self.mpi_type
        for (a, b), host, _ in self._order:
            win.Get([out[a:b], kind], host, target=(0, b - a, kind))
        win.Flush_all()
