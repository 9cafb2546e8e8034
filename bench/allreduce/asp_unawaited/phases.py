"""Where one ASP exchange with the shards spends its time, back to back and paced.

    mpirun -np 3 python bench/allreduce/asp_unawaited/phases.py [BYTES] [CALLS]

Rank 0 serves the state server; each worker times ``ShardClient.checked_push`` and the phases
of ``ShardClient.push_pull`` (the posts, the wait for the shards' answers, the wait for the
weights, what follows) over CALLS calls, back to back and then after ``PACE_S`` asleep, as
``mpsync bench allreduce`` paces them, and prints the medians in µs (the first 20 calls of
each left out).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from mpsync.bench.ps_exchange import PACE_S, _Session


def main(nbytes: int, calls: int) -> None:
    world = MPI.COMM_WORLD
    control = world.Dup()
    color = 1 if world.Get_rank() != 0 else MPI.UNDEFINED
    workers = world.Split(color=color, key=world.Get_rank())
    ps = _Session(world, control, workers, "asp", nbytes)
    if ps.client is None:   # the state server's rank: it served until the workers stopped
        return
    shards, waits = ps.shards, []
    wait = shards._wait

    def timed_wait(requests, what, shard_of, moving_here=False):
        start = time.perf_counter()
        wait(requests, what, shard_of, moving_here)
        waits.append((start, time.perf_counter()))

    shards._wait = timed_wait
    rows = []
    for pace in (0.0, PACE_S):
        for _ in range(calls):
            workers.Barrier()
            if pace:
                time.sleep(pace)
            waits.clear()
            t0 = time.perf_counter()
            wire = shards.checked_push(ps.delta)
            t1 = time.perf_counter()
            shards.push_pull(wire, ps.weights)
            t2 = time.perf_counter()
            (a0, a1), (r0, r1) = waits   # the shards' answers, then the weights
            rows.append((pace, t1 - t0, a0 - t1, a1 - a0, r0 - a1, r1 - r0, t2 - r1, t2 - t0))
    rows = np.array(rows)
    for pace in (0.0, PACE_S):
        med = np.median(rows[rows[:, 0] == pace][20:], axis=0) * 1e6
        print(f"rank {world.Get_rank()} pace {pace:g} s: check {med[1]:.0f}, posts "
              f"{med[2]:.0f}, answers {med[3]:.0f}, between {med[4]:.0f}, reads {med[5]:.0f}, "
              f"after {med[6]:.0f}, total {med[7]:.0f} µs", flush=True)
    ps.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 65536,
         int(sys.argv[2]) if len(sys.argv) > 2 else 300)
