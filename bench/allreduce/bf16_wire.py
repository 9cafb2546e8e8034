"""The parameter server's exchange of a bfloat16 model on a bfloat16 wire against the same
model sent as float32 (how it travelled before), in one job.

Rank 0 is the dedicated state server, the others workers hosting the shards (``auto``
layout), policy asp.  Per size: ``ShardClient.push_pull`` of the model (each shard's slice
out, applied, and the weights after it back), with the wire as float32 (``wire=None``: the
store's dtype) and as bfloat16 (``weights.BFLOAT16``), interleaved call by call
(``bench._timing.timed``: median of the slowest worker), plus the bytes one exchange moved.

    mpirun -np 3 python bench/allreduce/bf16_wire.py 65536,8716288
    mpirun $(mpsync cluster mpirun-args --np 3) python bench/allreduce/bf16_wire.py 8716288
"""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from mpsync.bench._timing import timed
from mpsync.bench.ps_exchange import _idle_barrier, _Session
from mpsync.server.weights import BFLOAT16


def main(sizes: list[int], max_repeats: int = 200, budget: float = 6.0) -> None:
    world = MPI.COMM_WORLD
    control = world.Dup()
    workers = world.Split(color=1 if world.Get_rank() else MPI.UNDEFINED, key=world.Get_rank())
    for nbytes in sizes:
        ps = _Session(world, control, workers, "asp", nbytes)
        if ps.client is None:
            continue
        shards, delta, weights = ps.shards, ps.delta, ps.weights
        moved = {}

        def exchange(wire):
            def run():
                shards.wire = wire
                before = shards.bytes_sent + shards.bytes_received
                shards.push_pull(shards.checked_push(delta), weights)
                moved[wire] = shards.bytes_sent + shards.bytes_received - before
            return run

        row = timed(workers, {"float32_wire_ms": exchange(None),
                              "bfloat16_wire_ms": exchange(BFLOAT16)}, max_repeats, budget)
        shards.wire = None
        ps.stop(idle_after=False)
        if workers.Get_rank() == 0:
            row.update({"bytes": nbytes, "workers": workers.Get_size(),
                        "float32_wire_bytes": moved[None], "bfloat16_wire_bytes": moved[BFLOAT16],
                        "bfloat16_vs_float32": row["bfloat16_wire_ms"] / row["float32_wire_ms"]})
            print(json.dumps(row), flush=True)
        _idle_barrier(world)


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1].split(",")])
