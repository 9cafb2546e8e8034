"""Does taking turns with the parameter server change the plain program's own time?

One ASP session (rank 0 the dedicated state server, the others workers hosting the shards),
a float32 model of BYTES.  The plain program (``ps_exchange._PlainProgram``) is timed in
turns: alone, beside ASP's push+pull, alone, beside it again; then once more after the
parameter server has stopped.  Rank 1 prints one line per reading (ms, median of the slower
worker, each of the program's four variants).

    mpirun -np 3 python bench/allreduce/turns/baseline_alone.py 8704040
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from mpsync.bench import ps_exchange as P
from mpsync.bench._timing import timed


def main(nbytes: int) -> None:
    world = MPI.COMM_WORLD
    control = world.Dup()
    workers = world.Split(color=1 if world.Get_rank() else MPI.UNDEFINED, key=world.Get_rank())
    ps = P._Session(world, control, workers, P._ps_policy(), nbytes)
    if ps.client is not None:
        it = [0]

        def exchange():
            it[0] += 1
            ps.client.push_pull(ps.delta, ps.weights, it[0], finite=ps.delta_finite)

        readings = {}
        plain = P._PlainProgram(workers, ps.layout.hosts, ps.weights.size)
        for label, methods in (("alone", {}), ("beside asp", {"asp": exchange}),
                               ("alone again", {}), ("beside asp again", {"asp": exchange})):
            readings[label] = plain.beside(timed, workers, methods, "raw", "", 100, 6.0)
        plain.close()
        ps.stop(idle_after=False)
        plain = P._PlainProgram(workers, ps.layout.hosts, ps.weights.size)
        readings["after the server stopped"] = plain.beside(timed, workers, {}, "raw", "", 100,
                                                            6.0)
        plain.close()
        if workers.Get_rank() == 0:
            for label, row in readings.items():
                print(f"{label}: plain {row['raw_ms']:.3f} ms, variants "
                      + ", ".join(f"{k} {v:.3f}" for k, v in row["raw_variants"].items()),
                      flush=True)
    P._idle_barrier(world)


if __name__ == "__main__":
    main(int(sys.argv[1]))
