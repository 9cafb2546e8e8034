"""Rank programs for tests/test_ps_faults.py: the sharded parameter server off the happy path.

The shard programs start the shards directly (``start_shards`` on ``COMM_WORLD``, no state
server), so a test talks to a shard the way a worker does, or the way a broken sender would.
Run through the harness (``run_mpi("ps_fault_programs:NAME", ...)``), or as a script for the
programs that must end through mpsync's own abort machinery (``run_mpi(str(PROGRAMS),
args=["NAME", ...])``).  Each prints ``RESULT {...}`` per rank and raises on a wrong answer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from mpsync.config import SyncConfig
from mpsync.server import DeadlineExceeded
from mpsync.server.shards import start_shards


def _args() -> dict:
    return dict(a.partition("=")[::2] for a in sys.argv[1:] if "=" in a)


def _result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _shards(deadline: float, numel: int):
    """Every rank of COMM_WORLD is a worker; 2 shards on the lowest ranks, holding a float32
    model of ``numel`` zeros.  Returns the communicator, this rank's shard client, shard
    thread (or None) and a model-sized buffer."""
    world = MPI.COMM_WORLD
    config = SyncConfig(policy="asp", topology="ps", ps_shards=2,
                        deadline=deadline).validate()
    client, thread, _ = start_shards(world, config, list(range(world.Get_size())),
                                     log=lambda text: print(text, flush=True))
    model = np.zeros(numel, dtype=np.float32)
    if world.Get_rank() == 0:
        client.init(model)
    world.Barrier()
    return world, client, thread, model


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until process ``pid`` is stopped (SIGSTOP): its state in /proc is 'T'."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def _finish(thread) -> None:
    # ShardThread.finish bounds the wait for the workers' goodbyes; older code had join only.
    if thread is not None:
        (thread.finish if hasattr(thread, "finish") else thread.join)()


def late_pull_reply() -> None:
    """2 ranks, a shard on each, ``elements`` float32 per shard.  Rank 1 stops (SIGSTOP)
    while rank 0 pulls: rank 0's pull passes its deadline naming shard 1 and cancels its
    receive; then rank 0 lets rank 1 go on (SIGCONT), and shard 1 answers the pull late.  The
    late reply must neither reach the shard thread on rank 0 (whose any-tag probe once took
    it for a request with an unknown tag and died) nor leave shard 1 stuck sending it (a large
    reply to a cancelled receive never completes): afterwards rank 1 pushes to and pulls from
    both shards, and gets its push back."""
    n = int(_args().get("elements", 4096))
    world, client, thread, model = _shards(deadline=1.0, numel=2 * n)
    me = world.Get_rank()
    pids = world.allgather(os.getpid())
    named = None
    if me == 1:
        os.kill(os.getpid(), signal.SIGSTOP)   # rank 0 sends SIGCONT once it gave up
        delta = np.arange(2 * n, dtype=np.float32)
        client.push(delta)
        client.pull(model)
        if not np.array_equal(model, delta):
            raise AssertionError("rank 1's push did not come back from both shards")
    else:
        _wait_stopped(pids[1])
        t0 = time.monotonic()
        try:
            client.pull(model)
        except DeadlineExceeded as e:
            named = str(e)
        waited = time.monotonic() - t0
        os.kill(pids[1], signal.SIGCONT)
        if named is None or "PS shard 1" not in named:
            raise AssertionError(f"the pull from a stopped shard ended with {named!r}")
        if waited > 5.0:
            raise AssertionError(f"the pull waited {waited:.1f}s with a 1s deadline")
    world.Barrier()   # rank 1 is done with both shards: rank 0's thread served it
    alive = thread is not None and thread.thread.is_alive()
    client.close()
    _finish(thread)
    _result(rank=me, named=named, shard_alive_after=alive)
    if not alive:
        raise AssertionError(f"the shard thread on rank {me} died")


def malformed_pushes() -> None:
    """2 ranks, a shard on each, float32 model of 8 elements starting at 0; rank 1 pushes.
    First over a float16 wire, a delta above 65504 on shard 1's range only: it must be
    refused before anything is sent (once, only shard 1 refused it and shard 0 applied its
    slice).  Then what no mpsync worker sends: a push of 7 bytes (not a whole float32) and a
    message with a tag the shards do not know; the shard refuses or drops each with a log
    line and serves on (once, the first was an MPI error that ended the shard's thread).
    Last, a good push is applied on both shards.  Each outcome is recorded, not raised."""
    world, client, thread, model = _shards(deadline=5.0, numel=8)
    me = world.Get_rank()
    outcome = {}
    if me == 1:
        from mpsync.server import shards as wire_tags

        client.wire = np.float16
        delta = np.zeros(8, dtype=np.float32)
        delta[0], delta[-1] = 1.0, 70000.0
        try:
            client.push(delta)
            outcome["overflow"] = "accepted"
        except FloatingPointError:
            outcome["overflow"] = "refused before sending"
        except RuntimeError as e:
            outcome["overflow"] = f"refused by a shard: {e}"
        client.pull(model)
        outcome["after_overflow"] = model.tolist()
        client.wire = None

        replies = getattr(client, "replies", client.comm)
        ack = np.zeros(2, dtype=np.int64)
        host0 = client.hosts[0]
        got = replies.Irecv([ack, MPI.INT64_T], source=host0, tag=wire_tags.ACK)
        client.comm.Send([np.zeros(7, dtype=np.uint8), MPI.BYTE], dest=host0,
                         tag=wire_tags.PUSH + 1)
        deadline = time.monotonic() + 5.0
        while not got.Test() and time.monotonic() < deadline:
            time.sleep(0.001)
        outcome["ragged_push_status"] = int(ack[1]) if got.Test() else "no answer"
        if not got.Test():
            got.Cancel()
        client.comm.Send([np.zeros(3, dtype=np.int64), MPI.INT64_T], dest=host0, tag=999)
        try:
            client.push(np.full(8, 2.0, dtype=np.float32))
            client.pull(model)
            outcome["after_good_push"] = model.tolist()
        except DeadlineExceeded as e:
            outcome["after_good_push"] = str(e)
    world.Barrier()
    client.close()
    _finish(thread)
    _result(rank=me, **outcome)


def push_pull_refusals() -> None:
    """2 ranks, a shard on each, float32 model of 8 elements starting at 0; rank 1 pushes and
    pulls in one exchange (``push_pull``).  A good one reads the weights after its own push
    from both shards; over a float16 wire, a delta above 65504 is refused before anything is
    sent; a push of the wrong length (a client laid out for 10 elements) is refused by both
    shards, which send no weights, so the next good exchange reads its own weights, not a
    stray reply; update and weights in one buffer are refused.  Each outcome is recorded."""
    from mpsync.server.shards import ShardClient

    world, client, thread, model = _shards(deadline=5.0, numel=8)
    me = world.Get_rank()
    outcome = {}
    if me == 1:
        client.push_pull(client.checked_push(np.ones(8, dtype=np.float32)), model)
        outcome["after_good"] = model.tolist()
        client.wire = np.float16
        delta = np.zeros(8, dtype=np.float32)
        delta[-1] = 70000.0
        try:
            client.push_pull(client.checked_push(delta), model)
            outcome["overflow"] = "accepted"
        except FloatingPointError:
            outcome["overflow"] = "refused before sending"
        client.wire = None
        wrong = ShardClient(client.comm, client.replies, client.hosts, client.names, 5.0)
        try:
            wrong.push_pull(wrong.checked_push(np.ones(10, dtype=np.float32)),
                            np.zeros(10, dtype=np.float32))
            outcome["wrong_length"] = "accepted"
        except RuntimeError as e:
            outcome["wrong_length"] = str(e)
        client.push_pull(client.checked_push(np.full(8, 2.0, dtype=np.float32)), model)
        outcome["after_refusals"] = model.tolist()
        try:
            client.push_pull(model, model)
            outcome["one_buffer"] = "accepted"
        except ValueError as e:
            outcome["one_buffer"] = str(e)
    world.Barrier()
    client.close()
    _finish(thread)
    _result(rank=me, **outcome)


def push_while_a_reply_is_read() -> None:
    """2 ranks, a shard on each, float32 model of ``elements`` zeros.  Rank 1 asks shard 0
    for its weights and does not take the reply yet (a slice in Open MPI's rendezvous
    protocol stays in flight, read from the shard's buffer); meanwhile it pushes ones.  The
    reply, taken afterwards, must hold the weights it was asked for (zeros): the shard adds
    the push into another buffer; the next pull reads the ones."""
    from mpsync.server import shards as wire_tags

    n = int(_args().get("elements", 524288))
    world, client, thread, model = _shards(deadline=10.0, numel=n)
    outcome = {}
    if world.Get_rank() == 1:
        client.layout(n)
        a, b = client.bounds[0]
        ask = np.zeros(1, dtype=np.int64)
        client.comm.Send([ask, MPI.INT64_T], dest=client.hosts[0],
                         tag=wire_tags.PULL + wire_tags.wire_code(np.float32))
        time.sleep(0.5)   # the shard has started its reply
        client.push(np.ones(n, dtype=np.float32))
        early = np.full(b - a, -1.0, dtype=np.float32)
        client.replies.Recv([early, MPI.BYTE], source=client.hosts[0], tag=wire_tags.DATA)
        client.pull(model)
        outcome = {"early_reply": sorted(set(early.tolist())),
                   "after_push": sorted(set(model.tolist()))}
    world.Barrier()
    client.close()
    _finish(thread)
    _result(rank=world.Get_rank(), **outcome)


def silent_at_shutdown() -> None:
    """3 ranks, shards on ranks 0 and 1, deadline 2 s.  Rank 2 pushes, then stops for good
    (SIGSTOP) without saying goodbye; ranks 0 and 1 shut their shards down: each must end
    its wait within the deadline naming worker 2, not wait for its goodbye for ever."""
    world, client, thread, _ = _shards(deadline=2.0, numel=8)
    me = world.Get_rank()
    client.push(np.ones(8, dtype=np.float32))
    world.Barrier()
    if me == 2:
        print(f"FAULT {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    client.close()
    t0 = time.monotonic()
    try:
        _finish(thread)
    except DeadlineExceeded as e:
        _result(rank=me, waited=time.monotonic() - t0, named=str(e))
        # The others stay stopped: end the job here, as the abort hook would.
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(3)
    raise AssertionError("the shard shut down with a worker that never said goodbye")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
