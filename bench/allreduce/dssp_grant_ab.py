"""DSSP's asked path with the state server's compiled grant on and off, in one job.

Rank 0 is the dedicated state server, the others workers hosting the shards (``auto``
layout).  For each repeat, one session with ``server_fast_path`` on, then one with it off
(the Python loop serves every ``PUSH_PULL``): ``SyncClient.push_then_pull`` of a float32
model of BYTES (push to the shards, the state server's count and grant, the pull from the
shards), timed back to back and paced (20 ms idle before each call), median of the slower
worker, with the number of requests the compiled loop served.  The workers push in step, so
every push is within s_L (Alg. 1 lines 7-9) and the compiled loop may serve each.

    mpirun -np 3 python bench/allreduce/dssp_grant_ab.py 65536 3     # 2 workers, 3 repeats
"""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

from mpsync.bench._timing import timed
from mpsync.bench.ps_exchange import _idle_barrier, paced
from mpsync.config import SyncConfig
from mpsync.server import StateServer, SyncClient
from mpsync.server.shards import start_shards


def session(world, control, workers, nbytes: int, fast: bool) -> dict | None:
    config = SyncConfig(policy="dssp", topology="ps", deadline=600.0, staleness_low=2,
                        staleness_high=4, server_fast_path=fast).validate()
    if world.Get_rank() == 0:
        StateServer(control, config, server_rank=0).serve()
        _idle_barrier(world)
        return None
    shards, thread, layout = start_shards(workers, config, list(range(1, world.Get_size())),
                                          log=lambda *_: None)
    client = SyncClient(control, config, server_rank=0, shards=shards)
    weights = np.zeros(max(layout.count, nbytes // 4), np.float32)
    if workers.Get_rank() == 0:
        client.ps_init(weights)
    delta = np.full(weights.size, 1e-6, np.float32)
    client.pull(weights, 0)
    it = [0]

    def asked():
        it[0] += 1
        client.push_then_pull(delta, weights, it[0])

    row = {"b2b_ms": timed(workers, {"x": asked}, 300, 1.5)["x"],
           "paced_ms": paced(workers, {"x": asked}, 100, 2.0)["x"]}
    shards.close()
    if thread is not None:
        thread.join()
    if workers.Get_rank() == 0:
        row["compiled"] = client.stats()["messages"]["compiled_push_pulls"]
    client.shutdown()
    _idle_barrier(world)
    return row


def main() -> None:
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    world = MPI.COMM_WORLD
    control = world.Dup()
    workers = world.Split(color=1 if world.Get_rank() else MPI.UNDEFINED, key=world.Get_rank())
    rows = {"compiled": [], "python": []}
    for _ in range(repeats):
        for mode in rows:
            row = session(world, control, workers, nbytes, fast=mode == "compiled")
            if row is not None:
                rows[mode].append(row)
    if world.Get_rank() == 1:
        print(json.dumps({"bytes": nbytes, "workers": world.Get_size() - 1, **rows}))


if __name__ == "__main__":
    main()
