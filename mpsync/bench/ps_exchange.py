"""The PS job of ``mpsync bench allreduce``: the sharded parameter server's push + pull against
a plain mpi4py program moving the same slices between the same ranks, in one ``mpirun`` job
(rank 0 the dedicated state server, the others workers, ``auto`` shards on worker ranks).

Per model size, float32, policy asp (its server never holds a pull, so the exchange is
transport), each the median over repeats of the slowest worker's time:

* ``ps_ms``: a push of a delta and a pull of the weights, what a training iteration runs
  (``ParameterServer._push_pull``): under asp ``SyncClient.push_pull``, every shard's slice
  out, applied and answered with the shard's weights, the state server told of the push and
  the pull meanwhile (its replies collected at the next call); under a policy whose pulls
  wait, ``push`` (acknowledged by every shard, then counted by the state server) + ``pull``
  (granted by it, then every slice back).  As in training, the delta comes known to be
  finite: a trainer finds that in the pass that computes it (``weights.subtract_checked``,
  which costs what the subtraction alone does), so the push does not read it again;
* ``ps_check_ms``: that check as a pass of its own (``weights.all_finite``), what a push of
  a delta not so computed adds (earlier rows timed it inside the exchange);
* ``ps_shard_ms``: the shard exchange alone (``ShardClient.push_pull``, or ``push`` +
  ``pull``), without the state server: what the shards add to the wire;
* ``ps_raw_ms``: the baseline, after them in the same job: each worker sends every shard's
  slice to the rank hosting it and gets a slice back, answered there by a thread with
  blocking ``Probe``/``Recv``/``Send`` (no control plane, no apply, no acks);
* ``ps_ssp_ms``: the same under ssp, whose bound never binds here (the workers are in
  step): one exchange per shard while the state server's last reply says the pull is sure
  (``SyncClient.pull_is_sure``; ``ps_ssp_sure_share``: how often it was); beside it
  ``ps_ssp_asked_ms``, the path of a pull the bound may hold: the push to the shards, the
  state server's count and grant in one exchange, the pull from the shards
  (``SyncClient.push_then_pull``);
* ``*_paced_ms``: each of these after ``PACE_S`` without any message (as
  between a training job's iterations, where a shard or server that sleeps while idle has
  to wake up for the push), the workers computing then on their main thread (``--pace
  compute``, the default, as a trainer does: a shard thread on the same core then shares
  it) or idle (``--pace idle``); ``ps_pace`` says which;
* ``ps_raw_apply_ms`` (and paced): the same baseline (the faster of the two) whose echo
  thread also adds each slice into its own weights with numpy and replies with the sum: the
  least work a parameter server does with a push (where every core is busy, as back to back
  on 2 cores, that add is work the plain program does not do: 8.7 MB with 2 workers, 1.4-1.6
  ms plain against 2.1-3.1 ms with the add).

Ratios: ``ps_vs_raw``, ``ps_shard_vs_raw``, ``ps_ssp_vs_raw``, ``ps_ssp_asked_vs_raw`` and
their paced forms; each also against the applying baseline (``*_vs_raw_apply``).  With the
data bytes one worker's exchange moved, counted message by message (``ps_wire_bytes``), beside
the analytic minima per worker of a push and a pull (``ps_min_bytes`` = 2·B) and of a ring
allreduce (``ring_min_bytes`` = 2(n-1)/n·B).
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np

from mpsync import policies as registry
from mpsync.bench._timing import timed
from mpsync.server.weights import all_finite

__all__ = ["ps_child", "PACE_S"]

PACE_S = 0.02   # time before each paced exchange (an iteration's compute)


def ps_child(sizes, max_repeats, budget, pace: str = "compute") -> None:
    """The rank side of the PS job; rank 0 of the workers prints one ``ROW`` per size."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    control = world.Dup()
    is_worker = world.Get_rank() != 0
    workers = world.Split(color=1 if is_worker else MPI.UNDEFINED, key=world.Get_rank())
    for nbytes in sizes:
        row = _bounded_exchange(_Session(world, control, workers, _bounded_ps_policy(), nbytes),
                                max_repeats, budget, pace)
        ps = _Session(world, control, workers, _ps_policy(), nbytes)
        if ps.client is None:   # the state server's rank: it served this size
            continue
        one_exchange = registry.get(_ps_policy()).ps_pull_ungated
        client, shards, delta, weights, it = ps.client, ps.shards, ps.delta, ps.weights, [0]
        finite = ps.delta_finite

        def exchange():   # as ParameterServer._push_pull
            it[0] += 1
            if one_exchange:
                client.push_pull(delta, weights, it[0], finite=finite)
            else:
                client.push(delta, it[0], finite=finite)
                client.pull(weights, it[0])

        def shard_exchange():
            if one_exchange:
                shards.push_pull(shards.checked_push(delta, finite), weights)
            else:
                shards.push(delta, finite)
                shards.pull(weights)

        moved, calls = shards.bytes_sent + shards.bytes_received, it[0]
        row.update(timed(workers, {"ps_ms": exchange, "ps_shard_ms": shard_exchange,
                                   "ps_check_ms": lambda: all_finite(delta)},
                         max_repeats, budget))
        per_exchange = (shards.bytes_sent + shards.bytes_received - moved) / (2 * (it[0] - calls))
        # One loop each: every worker then pushes once per PACE_S and a bit, as in training.
        row.update(paced(workers, {"ps_paced_ms": exchange}, max_repeats, budget, pace))
        row.update(paced(workers, {"ps_shard_paced_ms": shard_exchange}, max_repeats, budget,
                         pace))
        ps.stop(idle_after=False)
        row.update(_raw_slices(workers, ps.layout.hosts, weights.size, max_repeats, budget,
                               pace))
        if workers.Get_rank() == 0:
            size = workers.Get_size()
            row.update({"bytes": nbytes, "ps_shards": ps.layout.count, "ps_pace": pace,
                        "ps_one_sided": ps.one_sided,
                        "ps_wire_bytes": per_exchange, "ps_min_bytes": 2 * weights.nbytes,
                        "ring_min_bytes": 2 * (size - 1) * weights.nbytes // size})
            for subject in ("ps", "ps_shard", "ps_ssp", "ps_ssp_asked"):
                for paced_ in ("", "_paced"):
                    ms = row[f"{subject}{paced_}_ms"]
                    for raw in ("raw", "raw_apply"):
                        row[f"{subject}{paced_}_vs_{raw}"] = ms / row[f"ps_{raw}{paced_}_ms"]
            print("ROW " + json.dumps(row), flush=True)
        _idle_barrier(world)


class _Session:
    """One state server (rank 0, which serves it to the end in the constructor) and the
    workers' shards and client for ``policy``, a float32 model of ``nbytes`` loaded and
    pulled once; ``client`` is None on the server's rank."""

    def __init__(self, world, control, workers, policy: str, nbytes: int):
        from mpsync.config import SyncConfig
        from mpsync.server import StateServer, SyncClient
        from mpsync.server.shards import start_shards

        self.world, self.workers, self.client = world, workers, None
        config = SyncConfig(policy=policy, topology="ps", deadline=600.0).validate()
        if world.Get_rank() == 0:
            StateServer(control, config, server_rank=0).serve()
            _idle_barrier(world)  # no worker may reach the next server before it exists
            return
        self.shards, self.thread, self.layout = start_shards(
            workers, config, list(range(1, world.Get_size())), log=_quiet)
        # A worker waits on its shards through the progress engine, as in training.
        from mpsync.torch.dataplane.progress import engine

        self.shards.waiter = engine().wait
        self.client = SyncClient(control, config, server_rank=0, shards=self.shards)
        n = max(self.layout.count, nbytes // 4)
        self.weights = np.zeros(n, dtype=np.float32)
        self.shards.layout(n)
        self.one_sided = self.shards.open_window(self.weights.dtype) is None   # as in training
        if workers.Get_rank() == 0:
            self.client.ps_init(self.weights)
        self.delta = np.full(n, 1e-6, dtype=np.float32)
        # As in training, the pass that computes a worker's delta finds it finite
        # (``weights.subtract_checked``), so the push does not read it again (module doc).
        self.delta_finite = all_finite(self.delta)
        self.client.pull(self.weights, 0)

    def stop(self, idle_after: bool = True) -> None:
        """Shards and server shut down; ``idle_after``: meet the server's rank (else the
        caller does, after what it runs without them)."""
        self.shards.close()
        if self.thread is not None:
            self.thread.join()
        self.client.shutdown()
        if idle_after:
            _idle_barrier(self.world)


def _bounded_exchange(ps: _Session, max_repeats, budget, pace: str) -> dict:
    """Under ssp (the bound never binds: the workers are in step): ``ps_ssp_ms``, a push
    and a pull as ``ParameterServer._push_pull`` runs them, in one exchange per shard while
    the state server's last reply says the pull is sure (``SyncClient.pull_is_sure``); and
    ``ps_ssp_asked_ms``, what a pull the bound may hold takes: the push to the shards, the
    state server's count and grant, the pull from the shards (``SyncClient.push_then_pull``,
    as ``ParameterServer._push_pull`` runs it).  Each paced too."""
    if ps.client is None:
        return {}
    client, delta, weights, finite = ps.client, ps.delta, ps.weights, ps.delta_finite
    it, tried, sure = [0], [0], [0]

    def exchange():
        it[0] += 1
        tried[0] += 1
        if client.pull_is_sure():
            sure[0] += 1
            client.push_pull(delta, weights, it[0], gated=True, finite=finite)
        else:
            client.push_then_pull(delta, weights, it[0], finite=finite)

    def asked():
        it[0] += 1
        client.push_then_pull(delta, weights, it[0], finite=finite)

    row = timed(ps.workers, {"ps_ssp_ms": exchange, "ps_ssp_asked_ms": asked},
                max_repeats, budget)
    row.update(paced(ps.workers, {"ps_ssp_paced_ms": exchange}, max_repeats, budget, pace))
    row.update(paced(ps.workers, {"ps_ssp_asked_paced_ms": asked}, max_repeats, budget, pace))
    row["ps_ssp_sure_share"] = sure[0] / tried[0]
    ps.stop()
    return row


def _idle_barrier(comm) -> None:
    """A barrier that sleeps while it waits: Open MPI's blocking one polls a core, and rank 0
    waits in it through the baseline's whole measurement (the machine may have 2 cores)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(1e-3)


def _compute(seconds: float) -> None:
    """``seconds`` of a training step's kind of work on this thread: small float32 matrix
    products (one core with ``OMP_NUM_THREADS=1``)."""
    a = np.full((96, 96), 1e-3, dtype=np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


PACES = {"idle": time.sleep, "compute": _compute}


def paced(comm, methods: dict, max_repeats: int, budget: float, pace: str = "compute") -> dict:
    """Like :func:`~mpsync.bench._timing.timed`, each call after ``PACE_S`` of ``pace`` on
    every rank after the barrier (``"idle"``: sleeping; ``"compute"``: computing on the
    caller's thread, as a trainer does), then times the call: ``{name: median ms}``."""
    from mpi4py import MPI

    names, wait = list(methods), PACES[pace]
    repeats = comm.bcast(int(min(max_repeats, max(3, budget / (len(names) * PACE_S * 1.5)))),
                         root=0)
    times = np.zeros((len(names), repeats))
    for i in range(repeats):
        for j, name in enumerate(names):
            comm.Barrier()
            wait(PACE_S)
            t0 = time.perf_counter()
            methods[name]()
            times[j, i] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: 1e3 * float(np.median(times[j])) for j, name in enumerate(names)}


def _raw_slices(workers, hosts, n: int, max_repeats: int, budget: float, pace: str) -> dict:
    """The PS exchange's baseline (module doc): ``ps_raw_ms`` and ``ps_raw_paced_ms``, each the
    faster of two plain programs (``_raw_program``): the echo thread in a blocking ``Probe``
    (it wakes at once after a pause) or polling ``Iprobe`` (it never spins inside Open MPI
    against the exchange on its rank); both under ``ps_raw_variants``."""
    variants = {probe: _raw_program(workers, hosts, n, max_repeats, budget, probe, pace)
                for probe in ("blocking", "polled")}
    applying = [_raw_program(workers, hosts, n, max_repeats, budget, probe, pace, apply=True)
                for probe in ("blocking", "polled")]
    return {**{key: min(v[key] for v in variants.values()) for key in variants["polled"]},
            "ps_raw_apply_ms": min(v["ps_raw_ms"] for v in applying),
            "ps_raw_apply_paced_ms": min(v["ps_raw_paced_ms"] for v in applying),
            "ps_raw_variants": variants}


def _raw_program(workers, hosts, n: int, max_repeats: int, budget: float, probe: str,
                 pace: str, apply: bool = False) -> dict:
    """Each worker sends every shard's slice to the rank hosting it and gets a slice back,
    answered there by an echo thread (``probe``: ``"blocking"`` or ``"polled"``; ``apply``:
    the thread adds each slice into its own with numpy and replies with the sum, the least a
    parameter server does with a push, else it replies with what it received); the
    exchange's requests are tested with ``time.sleep(0)`` between tests, which lets go of the
    interpreter's lock for the echo thread.  (A blocking ``Waitall`` there took 8 ms per
    exchange at 64 KB back to back on 2 cores, 0.3 ms paced: the echo thread on the same rank
    could not run.)"""
    from mpi4py import MPI

    from mpsync.server.shard_plan import shard_bounds

    slice_tag, stop_tag = 1, 2
    comm, replies = workers.Dup(), workers.Dup()   # the echo probes requests only
    me, size = comm.Get_rank(), comm.Get_size()

    def echo():
        status, buf, left = MPI.Status(), np.empty(0, dtype=np.uint8), size
        store = np.empty(0, dtype=np.float32)   # the shard's weights, with ``apply``
        while left:
            if probe == "blocking":
                comm.Probe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            else:
                while not comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                    time.sleep(0)
            src, tag, count = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
            if buf.size < count:
                buf = np.empty(count, dtype=np.uint8)
            comm.Recv([buf[:count], MPI.BYTE], source=src, tag=tag)
            if tag == stop_tag:
                left -= 1
            elif apply:
                if store.nbytes != count:
                    store = np.zeros(count // 4, dtype=np.float32)
                np.add(store, buf[:count].view(np.float32), out=store)
                replies.Send([store, MPI.BYTE], dest=src, tag=slice_tag)
            else:
                replies.Send([buf[:count], MPI.BYTE], dest=src, tag=slice_tag)

    thread = threading.Thread(target=echo, daemon=True) if me in hosts else None
    if thread is not None:
        thread.start()
    bounds = shard_bounds(n, len(hosts))
    out, back = np.full(n, 1e-6, dtype=np.float32), np.empty(n, dtype=np.float32)

    def exchange():
        reqs = [replies.Irecv([back[a:b], MPI.FLOAT], source=h, tag=slice_tag)
                for (a, b), h in zip(bounds, hosts)]
        reqs += [comm.Isend([out[a:b], MPI.FLOAT], dest=h, tag=slice_tag)
                 for (a, b), h in zip(bounds, hosts)]
        while not MPI.Request.Testall(reqs):
            time.sleep(0)

    row = timed(replies, {"ps_raw_ms": exchange}, max_repeats, budget)
    row.update(paced(replies, {"ps_raw_paced_ms": exchange}, max_repeats, budget, pace))
    for h in hosts:
        comm.Send([np.zeros(1, dtype=np.uint8), MPI.BYTE], dest=h, tag=stop_tag)
    if thread is not None:
        thread.join()
    comm.Free()
    replies.Free()
    return row


def _quiet(_text: str) -> None:
    """The shard layout line: the benchmark prints its rows only."""


def _bounded_ps_policy() -> str:
    """A PS policy whose pulls a staleness bound may hold (the first registered policy on the
    PS that reads ``staleness``: SSP), timed beside ``_ps_policy``'s."""
    return next(s.name for s in registry.specs()
                if s.default_topology == "ps" and s.reads("staleness"))


def _ps_policy() -> str:
    """A PS policy whose server applies each push as it arrives and never holds a pull (the
    first registered policy whose own topology is the PS: ASP), so push+pull is transport."""
    return next(s.name for s in registry.specs() if s.default_topology == "ps")
