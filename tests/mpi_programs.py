"""Small rank programs for the harness's own tests (run by ``run_mpi("mpi_programs:NAME")``)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI


def ring() -> None:
    """Pass a token around the ring twice; every rank adds its rank, buffer-based Send/Recv."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    token = np.zeros(1, dtype=np.int64)
    right, left = (rank + 1) % size, (rank - 1) % size
    for lap in range(2):
        if rank == 0:
            token[0] += rank
            comm.Send(token, dest=right, tag=lap)
            comm.Recv(token, source=left, tag=lap)
        else:
            comm.Recv(token, source=left, tag=lap)
            token[0] += rank
            comm.Send(token, dest=right, tag=lap)
    if rank == 0:
        expected = 2 * size * (size - 1) // 2
        assert token[0] == expected, f"ring token {token[0]} != {expected}"
        print(f"ring ok size={size} token={token[0]}")


def allreduce() -> None:
    """mpi4py buffer Allreduce: the sum of per-rank vectors matches the closed form on every rank."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    send = np.arange(1000, dtype=np.float64) * (rank + 1)
    recv = np.empty_like(send)
    comm.Allreduce(send, recv, op=MPI.SUM)
    expected = np.arange(1000, dtype=np.float64) * (size * (size + 1) / 2)
    np.testing.assert_array_equal(recv, expected)
    print(f"allreduce ok rank={rank}")


def horovod_without_rank0() -> None:
    """Horovod on a communicator of ranks 1..N-1 while rank 0 stays out of every collective.

    This is how a dedicated state-server rank coexists with Horovod workers: the workers call
    ``hvd.init(comm=...)`` with their sub-communicator; rank 0 only exchanges P2P messages.
    """
    import torch
    import horovod.torch as hvd

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    workers = world.Split(color=0 if rank == 0 else 1, key=rank)
    if rank == 0:
        # Rank 0 answers each worker's P2P hello while they run collectives without it.
        buf = np.zeros(1, dtype=np.int64)
        for _ in range(world.Get_size() - 1):
            status = MPI.Status()
            world.Recv(buf, source=MPI.ANY_SOURCE, tag=7, status=status)
            world.Send(buf * 10, dest=status.Get_source(), tag=8)
        print("server rank served", world.Get_size() - 1, "workers")
    else:
        hvd.init(comm=workers)
        assert hvd.size() == world.Get_size() - 1, (hvd.size(), world.Get_size())
        assert hvd.rank() == rank - 1, (hvd.rank(), rank)
        t = torch.full((256,), float(hvd.rank() + 1), dtype=torch.float64)
        total = hvd.allreduce(t, op=hvd.Sum, name="sum")
        n = hvd.size()
        assert torch.all(total == n * (n + 1) / 2), total[:4]
        avg = hvd.allreduce(t, name="avg")
        assert torch.allclose(avg, torch.full_like(t, (n + 1) / 2)), avg[:4]
        hello = np.array([rank], dtype=np.int64)
        world.Send(hello, dest=0, tag=7)
        world.Recv(hello, source=0, tag=8)
        assert hello[0] == rank * 10
        hvd_rank = hvd.rank()
        hvd.shutdown()
        print(f"horovod ok rank={rank} hvd_rank={hvd_rank} size={n}")
    workers.Free()


def hang_on_rank1() -> None:
    """Rank 1 waits for a message nobody sends: only the harness's deadline can end this run."""
    comm = MPI.COMM_WORLD
    print(f"pid={os.getpid()} rank={comm.Get_rank()}", flush=True)
    if comm.Get_rank() == 1:
        comm.Recv(np.zeros(1), source=0, tag=99)
    else:
        time.sleep(3600)


def raise_on_rank2() -> None:
    """Rank 2 raises; the harness's runner aborts the job and the test sees rank 2's traceback."""
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 2:
        raise RuntimeError("deliberate failure on rank 2")
    comm.Barrier()  # the others would wait forever without the abort


def print_args() -> None:
    print("args:", " ".join(sys.argv[1:]))
