"""The sharded parameter server's data plane: shard servers that store, apply and serve
bytes, and the worker's client that talks to all of them at once.

Roles (the state server decides, the shards only move bytes):

* The flat parameter vector is cut into S contiguous ranges of equal bytes
  (:mod:`mpsync.server.shard_plan`); shard k holds range k in the parameters' dtype
  (:class:`~mpsync.server.weights.WeightStore`) and applies each worker's slice of an update,
  scaled as the policy's registry entry says, on arrival.
* The state server on rank 0 never holds the model.  It counts a worker's push only when the
  worker tells it, and the worker tells it only after every shard has acknowledged applying
  its slice; it grants a pull by the policy's rule over those whole-model counts.

What each policy needs from the shards follows from that order:

* SSP / DSSP (DSSP Alg. 1): staleness is decided once, by the state server, over pushes that
  are in on *every* shard, so a granted pull reads, on every shard, at least every update the
  bound requires.  A shard may also hold newer updates of other workers (a pull is not one
  snapshot across shards); SSP's bound is a lower bound on what a read contains, so that is
  allowed, as in the per-key stores SSP was built on.
* BSP and ESync (ESync Alg. 1 lines 17-22): a round's pulls are granted once every worker's
  push of the round is acknowledged by every shard, and the next round's pushes start only
  after every worker has pulled (reset) -- so every shard is at exactly the round's model
  when anyone reads it, and the sharded PS computes what the single store and the ring do.
* ElasticBSP (ZipLine §6.2.5): a barrier pull waits until every worker's barrier push is in on
  every shard; within a superstep pushes and pulls are ASP, on each shard as they arrive.

Placement: each shard server is a thread on a worker rank, one per node by default (the
node's lowest worker rank), beside the workers.  Threads rather than ranks of their own: the
launch (mpirun, Slurm, a hostfile, horovodrun) needs no extra ranks laid out per node, every
node's link carries 1/S of every worker's traffic, and the shard's lifetime is its host
rank's, so a dead shard is a dead rank that Open MPI reports and ends the job for.  Needs
MPI_THREAD_MULTIPLE (the trainer and its shard thread call MPI at once).  A shard thread
shares its host's interpreter lock; it sleeps between polls (below) and numpy and MPI release
the lock while they move and add bytes.

Wire (on a ``Dup`` of the workers' communicator, nothing else on it): a request's tag says
what it is and the dtype of its payload (``INIT``/``PUSH`` + code: the slice; ``PULL`` + code:
a one-element request, answered with the slice in that dtype as ``DATA``); ``ACK`` carries
``[version, status]``; ``BYE`` ends a worker's use of the shard.  Pushes and pulls go to all
shards at once (``Isend``/``Irecv``), so a worker's link carries about one model out and one in
per synchronization.  Under ``Compression.fp16`` both travel as float16: the shards keep the
master weights in the parameters' dtype and workers compute on a float16 rounding of them,
as in mixed-precision training; their updates are applied to the master copy.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from mpsync.config import ConfigError
from mpsync.server.shard_optimizer import ServerUpdates
from mpsync.server.shard_plan import ShardLayout, plan_layout, shard_bounds
from mpsync.server.weights import WeightStore

__all__ = ["ShardServer", "ShardClient", "ShardThread", "start_shards", "WIRE_DTYPES"]

# Wire dtype codes (a tag's offset).
WIRE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
INIT, PUSH, PULL = 300, 310, 320
ACK, DATA, BYE = 330, 340, 350
# The server-side optimizer's settings (float64, ``OptimizerSettings.to_array``), ACKed.
OPT = 380
_OK, _REFUSED = 0, 1
_SLEEP_MIN_S, _SLEEP_MAX_S, _SLEEP_IDLE_S = 20e-6, 1e-3, 4e-3
_IDLE_AFTER_S = 0.05


def _code(dtype) -> int:
    try:
        return WIRE_DTYPES.index(np.dtype(dtype))
    except ValueError:
        raise TypeError(f"the parameter server stores float16/32/64, got {dtype}") from None


class ShardServer:
    """Serves one shard to ``n_workers`` workers until each has said ``BYE``.

    ``comm`` is the shard communicator; ``scale`` the policy's update factor.  One loop:
    probe, receive, apply or serve, reply; between messages it sleeps (20 µs doubling to
    1 ms, 4 ms after 50 ms of silence), so an idle shard costs its host little CPU.
    """

    def __init__(self, comm, index: int, n_workers: int, scale: float, log=None,
                 updates: ServerUpdates | None = None):
        self.comm = comm
        self.index = index
        self.store = WeightStore(scale)
        # ps_optimizer='server': pushes are gradients for this shard's optimizer
        self.updates = updates
        self.left = n_workers
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.bytes_received = 0
        self.bytes_sent = 0
        self._recv: dict[int, np.ndarray] = {}   # receive buffer per wire dtype
        self._send_buf: np.ndarray | None = None
        self._waiting_pulls: list[tuple[int, int]] = []   # pulls before the first INIT
        self._ack = np.zeros(2, dtype=np.int64)
        self._req = np.zeros(1, dtype=np.int64)

    def serve(self) -> dict:
        status = MPI.Status()
        probe = self.comm.Iprobe
        sleep, last = _SLEEP_MIN_S, time.perf_counter()
        while self.left > 0:
            if probe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                self._handle(status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))
                sleep, last = _SLEEP_MIN_S, time.perf_counter()
                continue
            time.sleep(sleep)
            idle = time.perf_counter() - last > _IDLE_AFTER_S
            sleep = min(2 * sleep, _SLEEP_IDLE_S if idle else _SLEEP_MAX_S)
        return self.stats()

    def stats(self) -> dict:
        return {"shard": self.index, "elements": self.store.size, "version": self.store.version,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent}

    def _handle(self, src: int, tag: int, nbytes: int) -> None:
        kind, code = tag - tag % 10, tag % 10
        if kind == PULL and code < len(WIRE_DTYPES):
            self.comm.Recv([self._req, MPI.INT64_T], source=src, tag=tag)
            if not self.store.ready:
                self._waiting_pulls.append((src, code))
            else:
                self._serve_pull(src, code)
        elif kind in (INIT, PUSH) and code < len(WIRE_DTYPES):
            data = self._receive(src, tag, WIRE_DTYPES[code], nbytes)
            self._ack[:] = (self.store.version, self._take(kind, data, src))
            self.comm.Send([self._ack, MPI.INT64_T], dest=src, tag=ACK)
        elif tag == OPT:
            settings = np.empty(nbytes // 8, dtype=np.float64)
            self.comm.Recv([settings, MPI.BYTE], source=src, tag=tag)
            problem = (self.updates.configure(settings) if self.updates is not None else
                       "optimizer settings, but the workers run the optimizer")
            if problem:
                self.log(f"mpsync PS shard {self.index}: refused the optimizer settings of "
                         f"worker {src}: {problem}")
            self._ack[:] = (self.store.version, _REFUSED if problem else _OK)
            self.comm.Send([self._ack, MPI.INT64_T], dest=src, tag=ACK)
        elif tag == BYE:
            self.comm.Recv([self._req, MPI.INT64_T], source=src, tag=tag)
            self.left -= 1
        else:
            raise RuntimeError(f"PS shard {self.index}: unknown message tag {tag} from worker "
                               f"{src}")

    def _receive(self, src: int, tag: int, dtype: np.dtype, nbytes: int) -> np.ndarray:
        count = nbytes // dtype.itemsize
        buf = self._recv.get(dtype.num)
        if buf is None or buf.size != count:
            buf = self._recv[dtype.num] = np.empty(count, dtype=dtype)
        self.comm.Recv([buf, MPI.BYTE], source=src, tag=tag)
        self.bytes_received += nbytes
        return buf

    def _take(self, kind: int, data: np.ndarray, src: int) -> int:
        if kind == INIT:
            self.store.init(data)
            for waiting in self._waiting_pulls:
                self._serve_pull(*waiting)
            self._waiting_pulls.clear()
            return _OK
        problem = self.apply_push(data)
        if problem:
            self.log(f"mpsync PS shard {self.index}: refused a push from worker {src}: "
                     f"{problem}")
            return _REFUSED
        return _OK

    def apply_push(self, update: np.ndarray) -> str | None:
        """A worker's slice of an update into this shard's range: added (the workers run the
        optimizer) or stepped on / merged by the shard's optimizer; None, or why refused."""
        if self.updates is None:
            return self.store.apply(update)
        problem = self.updates.take(self.store.weights, update)
        if problem is None:
            self.store.version += 1
        return problem

    def _serve_pull(self, src: int, code: int) -> None:
        if self.updates is not None:
            self.updates.settle(self.store.weights)   # a round's step before its first read
        weights = self.store.weights
        if WIRE_DTYPES[code] != weights.dtype:
            if self._send_buf is None or self._send_buf.dtype != WIRE_DTYPES[code]:
                self._send_buf = np.empty(weights.size, dtype=WIRE_DTYPES[code])
            np.copyto(self._send_buf, weights, casting="unsafe")
            weights = self._send_buf
        self.comm.Send([weights, MPI.BYTE], dest=src, tag=DATA)
        self.bytes_sent += weights.nbytes


class ShardThread:
    """A :class:`ShardServer` on a thread of its host rank; ``join()`` returns its stats.
    An exception in it goes to the rank's abort hook (``threading.excepthook``)."""

    def __init__(self, server: ShardServer):
        self.server = server
        self.result: dict | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"mpsync-ps-shard-{server.index}")
        self.thread.start()

    def _run(self) -> None:
        self.result = self.server.serve()

    def join(self, timeout: float | None = None) -> dict | None:
        self.thread.join(timeout)
        return self.result


class ShardClient:
    """A worker's side: init, push and pull the whole flat model over every shard at once.

    ``hosts[k]`` is shard k's rank in ``comm``; ``names[k]`` how errors name it (its world
    rank and host).  The layout is fixed by the first call, from the model's size.  Every
    wait has ``deadline``: a shard that does not answer raises ``DeadlineExceeded`` naming it.
    ``wire``: the dtype on the wire (None: the model's own; float16 under Compression.fp16).
    """

    def __init__(self, comm, hosts, names, deadline: float):
        self.comm = comm
        self.hosts = tuple(int(h) for h in hosts)
        self.names = tuple(names)
        self.deadline = float(deadline)
        self.wire = None
        self.bounds: tuple[tuple[int, int], ...] | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._acks = np.zeros((len(self.hosts), 2), dtype=np.int64)
        self._one = np.zeros(1, dtype=np.int64)
        self._wire_buf: np.ndarray | None = None

    @property
    def count(self) -> int:
        return len(self.hosts)

    def layout(self, numel: int) -> None:
        """Fix the shards' ranges for a model of ``numel`` elements (the same on every
        worker); a :class:`ConfigError` if there are more shards than elements."""
        if self.bounds is None:
            self.bounds = shard_bounds(numel, self.count)
        elif self.bounds[-1][1] != numel:
            raise ValueError(f"the parameter server holds {self.bounds[-1][1]} elements, got "
                             f"{numel}")

    def _on_wire(self, flat: np.ndarray) -> np.ndarray:
        if self.wire is None or np.dtype(self.wire) == flat.dtype:
            return flat
        if self._wire_buf is None or self._wire_buf.size != flat.size:
            self._wire_buf = np.empty(flat.size, dtype=self.wire)
        return self._wire_buf

    def init(self, flat: np.ndarray) -> None:
        """The initial weights, in the store's dtype (the first worker's wins on each shard)."""
        self._send_slices(INIT, flat, flat, "ps_init")

    def push(self, delta: np.ndarray) -> None:
        """Apply ``delta`` on every shard; returns once every shard has applied its slice."""
        if not np.all(np.isfinite(delta)):
            raise FloatingPointError("push with NaN or inf: the local model diverged (no shard "
                                     "was sent any of it)")
        wire = self._on_wire(delta)
        if wire is not delta:
            np.copyto(wire, delta, casting="unsafe")
        self._send_slices(PUSH, delta, wire, "push")

    def configure(self, settings: np.ndarray) -> None:
        """The server-side optimizer's settings (float64) to every shard; returns once each
        has taken them."""
        comm = self.comm
        acks = [comm.Irecv([self._acks[k], MPI.INT64_T], source=h, tag=ACK)
                for k, h in enumerate(self.hosts)]
        sends = [comm.Isend([settings, MPI.DOUBLE], dest=h, tag=OPT) for h in self.hosts]
        self._wait(acks + sends, "optimizer settings", list(range(self.count)) * 2)
        refused = [self.names[k] for k in range(self.count) if self._acks[k, 1] != _OK]
        if refused:
            raise RuntimeError(f"optimizer settings refused by {', '.join(refused)} (see its "
                               f"log line)")

    def _send_slices(self, kind: int, flat: np.ndarray, wire: np.ndarray, what: str) -> None:
        self.layout(flat.size)
        tag = kind + _code(wire.dtype)
        comm = self.comm
        acks = [comm.Irecv([self._acks[k], MPI.INT64_T], source=h, tag=ACK)
                for k, h in enumerate(self.hosts)]
        sends = [comm.Isend([wire[a:b], MPI.BYTE], dest=h, tag=tag)
                 for (a, b), h in zip(self.bounds, self.hosts)]
        self._wait(acks + sends, what, list(range(self.count)) * 2)
        self.bytes_sent += wire.nbytes
        refused = [self.names[k] for k in range(self.count) if self._acks[k, 1] != _OK]
        if refused:
            raise RuntimeError(f"{what} refused by {', '.join(refused)} (see its log line)")

    def pull(self, out: np.ndarray) -> None:
        """Every shard's slice into ``out`` (contiguous, the store's dtype)."""
        self.layout(out.size)
        wire = self._on_wire(out)
        tag = PULL + _code(wire.dtype)
        comm = self.comm
        recvs = [comm.Irecv([wire[a:b], MPI.BYTE], source=h, tag=DATA)
                 for (a, b), h in zip(self.bounds, self.hosts)]
        sends = [comm.Isend([self._one, MPI.INT64_T], dest=h, tag=tag) for h in self.hosts]
        self._wait(recvs + sends, "pull", list(range(self.count)) * 2)
        self.bytes_received += wire.nbytes
        if wire is not out:
            np.copyto(out, wire, casting="unsafe")

    def close(self) -> None:
        """This worker is done with every shard (each exits once all workers are)."""
        for h in self.hosts:
            self.comm.Send([self._one, MPI.INT64_T], dest=h, tag=BYE)

    def _wait(self, requests, what: str, shard_of) -> None:
        """Wait for ``requests``, sleeping 20 µs doubling to 1 ms after the first 2 ms;
        past the deadline, raise naming the shards that did not answer."""
        from mpsync.server._client import DeadlineExceeded

        start = time.perf_counter()
        sleep = _SLEEP_MIN_S
        while not MPI.Request.Testall(requests):
            elapsed = time.perf_counter() - start
            if elapsed > self.deadline:
                late = sorted({shard_of[i] for i, r in enumerate(requests) if not r.Test()})
                for i, r in enumerate(requests):
                    if shard_of[i] in late and r:
                        r.Cancel()
                names = [self.names[k] for k in late]
                raise DeadlineExceeded(f"no answer from {', '.join(names)} to {what} within "
                                       f"the {self.deadline:g}s deadline", names, what)
            if elapsed > 2e-3:
                time.sleep(sleep)
                sleep = min(2 * sleep, _SLEEP_MAX_S)


def start_shards(workers, config, world_ranks, *, log=None):
    """Collective over the workers' communicator ``workers``: plan the shards from the
    workers' host names (:func:`~mpsync.server.shard_plan.plan_layout`), start this rank's
    shard thread if it hosts one, and return ``(ShardClient, ShardThread | None, layout)``.
    ``world_ranks[w]``: worker w's rank in the job, for messages."""
    from mpsync import policies

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ConfigError("topology='ps' runs its shard servers as threads of worker ranks and "
                          "needs MPI_THREAD_MULTIPLE; this MPI provides level "
                          f"{MPI.Query_thread()}")
    names = workers.allgather(MPI.Get_processor_name())
    layout: ShardLayout = plan_layout(config.ps_shards, names)
    comm = workers.Dup()
    me, n = workers.Get_rank(), workers.Get_size()
    labels = [f"PS shard {k} (world rank {world_ranks[h]} on {names[h]})"
              for k, h in enumerate(layout.hosts)]
    thread = None
    if me in layout.hosts:
        spec = policies.get(config.policy)
        updates = (ServerUpdates(per_round=spec.ps_average)
                   if config.ps_optimizer == "server" else None)
        thread = ShardThread(ShardServer(comm, layout.hosts.index(me), n,
                                         spec.ps_update_scale(config, n), log=log,
                                         updates=updates))
    if me == 0:
        (log or (lambda t: print(t, file=sys.stderr, flush=True)))(
            f"mpsync: parameter server in {layout.count} shard(s) over {layout.nodes} "
            f"node(s): {'; '.join(labels)}")
    return ShardClient(comm, layout.hosts, labels, config.deadline), thread, layout
