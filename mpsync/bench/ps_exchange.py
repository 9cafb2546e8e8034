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
* ``ps_raw_ms``: the baseline (``_PlainProgram``), timed in the same session as the PS, the
  two taking turns: each worker sends every shard's slice to the rank hosting it and gets a
  slice back, answered there by an echo thread with ``Probe``/``Recv``/``Send`` (no control
  plane, no apply, no acks); ``ps_ssp_raw_ms``, the same beside the ssp rows, whose ratios
  are to it;
* ``ps_ssp_ms``: ``ps_ms``'s exchange under ssp, whose bound never binds here (the workers are in
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

Turns: ``BLOCK`` calls of each method, of which the first ``SETTLE`` are run but not counted.
One call each in turn was tried first: the state server, which sleeps until a worker's next
report is due (``server._loop``), then saw a rhythm no training job has (another method's
calls between each of the worker's) and slept through the asked path's queries (64 KB, 2
workers: 0.77 ms back to back and 2.5 ms paced, against 0.12 and 0.28 ms in turns of 6).
Turns still put every method under the same background: on a 2-vCPU machine the cores'
placement can change within seconds and move a whole exchange's time by 2x, so a baseline
timed after the PS, as before, gave ratios that depended on when each ran.

Ratios: ``ps_vs_raw``, ``ps_shard_vs_raw``, ``ps_ssp_vs_raw``, ``ps_ssp_asked_vs_raw`` and
their paced forms; each also against the applying baseline (``*_vs_raw_apply``).  With the
data bytes one worker's exchange moved, counted message by message (``ps_wire_bytes``), beside
the analytic minima per worker of a push and a pull (``ps_min_bytes`` = 2·B) and of a ring
allreduce (``ring_min_bytes`` = 2(n-1)/n·B).
"""

from __future__ import annotations

import json
import queue
import threading
import time

import numpy as np

from mpsync import policies as registry
from mpsync.bench._timing import interleaved, timed
from mpsync.server.weights import all_finite

__all__ = ["ps_child", "PACE_S"]

PACE_S = 0.02   # time before each paced exchange (an iteration's compute)
BLOCK, SETTLE = 6, 2   # calls per turn of each method, of which the first are not counted
# A loop's methods and the baseline's four variants share one budget of this many times the
# per-point one (the job's length stays near what separate loops took: 12 against 14).
SHARED_BUDGET = 3


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
        raw = _PlainProgram(workers, ps.layout.hosts, weights.size)
        row.update(raw.beside(timed, workers, {"ps_ms": exchange, "ps_shard_ms": shard_exchange,
                                               "ps_check_ms": lambda: all_finite(delta)},
                              "ps_raw", "", max_repeats, SHARED_BUDGET * budget))
        per_exchange = (shards.bytes_sent + shards.bytes_received - moved) / (2 * (it[0] - calls))
        row.update(raw.beside(paced, workers, {"ps_paced_ms": exchange,
                                               "ps_shard_paced_ms": shard_exchange},
                              "ps_raw", "_paced", max_repeats, SHARED_BUDGET * budget, pace))
        raw.close()
        ps.stop(idle_after=False)   # the server's rank meets the workers after the row
        if workers.Get_rank() == 0:
            size = workers.Get_size()
            row.update({"bytes": nbytes, "ps_shards": ps.layout.count, "ps_pace": pace,
                        "ps_one_sided": ps.one_sided,
                        "ps_wire_bytes": per_exchange, "ps_min_bytes": 2 * weights.nbytes,
                        "ring_min_bytes": 2 * (size - 1) * weights.nbytes // size})
            # Each against the plain program timed beside it, in the same session.
            for subject, beside in (("ps", "ps"), ("ps_shard", "ps"), ("ps_ssp", "ps_ssp"),
                                    ("ps_ssp_asked", "ps_ssp")):
                for paced_ in ("", "_paced"):
                    ms = row[f"{subject}{paced_}_ms"]
                    for base in ("raw", "raw_apply"):
                        baseline = row[f"{beside}_{base}{paced_}_ms"]
                        row[f"{subject}{paced_}_vs_{base}"] = ms / baseline
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

    raw = _PlainProgram(ps.workers, ps.layout.hosts, weights.size)
    row = raw.beside(timed, ps.workers, {"ps_ssp_ms": exchange, "ps_ssp_asked_ms": asked},
                     "ps_ssp_raw", "", max_repeats, SHARED_BUDGET * budget)
    row.update(raw.beside(paced, ps.workers, {"ps_ssp_paced_ms": exchange,
                                              "ps_ssp_asked_paced_ms": asked},
                          "ps_ssp_raw", "_paced", max_repeats, SHARED_BUDGET * budget, pace))
    row["ps_ssp_sure_share"] = sure[0] / tried[0]
    raw.close()
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


def paced(comm, methods: dict, max_repeats: int, budget: float, pace: str = "compute",
          block: int = 1, settle: int = 0) -> dict:
    """Like :func:`~mpsync.bench._timing.timed`, each call after ``PACE_S`` of ``pace`` on
    every rank after the barrier (``"idle"``: sleeping; ``"compute"``: computing on the
    caller's thread, as a trainer does), then times the call: ``{name: median ms}``, the
    methods taking turns as ``interleaved`` says (``block``, ``settle``)."""
    wait = PACES[pace]
    repeats = comm.bcast(int(min(max_repeats,
                                 max(3, budget / (len(methods) * PACE_S * 1.5)))), root=0)
    return interleaved(comm, methods, repeats, lambda: wait(PACE_S), block=block, settle=settle)


class _PlainProgram:
    """The PS exchange's baseline (module doc), set up beside a session so that its calls
    take turns with the parameter server's (``beside``; ``BLOCK``): each worker sends every
    shard's slice to the rank hosting it and gets a slice back, answered there by an echo
    thread.  The echo thread sleeps on a queue between calls (a worker's call wakes its rank's
    echo before posting), so it never polls against the exchange it is compared with; while
    woken it serves that call's slice from every worker (tagged with the call's number: a
    worker already in its next call, as in a warm-up without barriers, waits for the echo's
    next wake-up rather than taking this one's place) with a blocking ``Probe`` (it wakes at
    once) or polling ``Iprobe`` (it never spins inside Open MPI against the exchange on its
    rank) -- both timed, the faster is the baseline; with ``apply`` it adds each slice into its
    own weights with numpy and replies with the sum, the least a parameter server does with a
    push.  The exchange's requests are tested with ``time.sleep(0)`` between tests, which lets
    go of the interpreter's lock for the echo thread.  (A blocking ``Waitall`` there took 8 ms
    per exchange at 64 KB back to back on 2 cores, 0.3 ms paced: the echo thread on the same
    rank could not run.)"""

    PROBES = ("blocking", "polled")

    def __init__(self, workers, hosts, n: int):
        from mpsync.server.shard_plan import shard_bounds

        self.comm, self.replies = workers.Dup(), workers.Dup()   # the echo probes requests only
        self.hosts, self.bounds = list(hosts), shard_bounds(n, len(hosts))
        self.out = np.full(n, 1e-6, dtype=np.float32)
        self.back = np.empty(n, dtype=np.float32)
        self.orders: queue.SimpleQueue = queue.SimpleQueue()
        self.thread, self.calls = None, 0
        if self.comm.Get_rank() in self.hosts:
            self.thread = threading.Thread(target=self._echo, daemon=True)
            self.thread.start()

    def _echo(self) -> None:
        from mpi4py import MPI

        comm, status, buf = self.comm, MPI.Status(), np.empty(0, dtype=np.uint8)
        store = np.empty(0, dtype=np.float32)   # the shard's weights, with ``apply``
        while (order := self.orders.get()) is not None:
            probe, apply, tag = order
            for _ in range(comm.Get_size()):
                if probe == "blocking":
                    comm.Probe(MPI.ANY_SOURCE, tag, status)
                else:
                    while not comm.Iprobe(MPI.ANY_SOURCE, tag, status):
                        time.sleep(0)
                src, count = status.Get_source(), status.Get_count(MPI.BYTE)
                if buf.size < count:
                    buf = np.empty(count, dtype=np.uint8)
                comm.Recv([buf[:count], MPI.BYTE], source=src, tag=tag)
                if apply:
                    if store.nbytes != count:
                        store = np.zeros(count // 4, dtype=np.float32)
                    np.add(store, buf[:count].view(np.float32), out=store)
                    self.replies.Send([store, MPI.BYTE], dest=src, tag=1)
                else:
                    self.replies.Send([buf[:count], MPI.BYTE], dest=src, tag=1)

    def exchange(self, probe: str, apply: bool):
        """One call of the plain program (``probe``, ``apply``: see the class doc)."""
        from mpi4py import MPI

        comm, replies, hosts = self.comm, self.replies, self.hosts

        def call():
            self.calls += 1   # every worker makes the same calls, so their numbers agree
            tag = 1 + self.calls % 30000   # MPI's tags reach at least 32767
            if self.thread is not None:
                self.orders.put((probe, apply, tag))
            reqs = [replies.Irecv([self.back[a:b], MPI.FLOAT], source=h, tag=1)
                    for (a, b), h in zip(self.bounds, hosts)]
            reqs += [comm.Isend([self.out[a:b], MPI.FLOAT], dest=h, tag=tag)
                     for (a, b), h in zip(self.bounds, hosts)]
            while not MPI.Request.Testall(reqs):
                time.sleep(0)
        return call

    def beside(self, timer, workers, methods: dict, key: str, paced_: str, *args) -> dict:
        """``timer(workers, methods + this program's variants, *args)``, taking turns in
        blocks (``BLOCK``, ``SETTLE``: module doc); the variants folded into
        ``{key}{paced_}_ms`` (the faster echo) and ``{key}_apply{paced_}_ms``, each kept under
        ``{key}{paced_}_variants``."""
        variants = {f"{probe}{'_apply' if apply else ''}": self.exchange(probe, apply)
                    for apply in (False, True) for probe in self.PROBES}
        row = timer(workers, {**methods, **{f"{key}:{v}": f for v, f in variants.items()}},
                    *args, block=BLOCK, settle=SETTLE)
        ms = {v: row.pop(f"{key}:{v}") for v in variants}
        return {**row, f"{key}{paced_}_ms": min(ms[p] for p in self.PROBES),
                f"{key}_apply{paced_}_ms": min(ms[f"{p}_apply"] for p in self.PROBES),
                f"{key}{paced_}_variants": ms}

    def close(self) -> None:
        if self.thread is not None:
            self.orders.put(None)
            self.thread.join()
        self.comm.Free()
        self.replies.Free()


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
