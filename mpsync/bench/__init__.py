"""Benchmarks: a small registry of ``mpsync bench NAME`` commands.

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int``; each measures
a baseline in the same run (``np.sort`` for ZipLine, a raw mpi4py ping-pong for the server, raw
``hvd.allreduce`` / mpi4py ``Allreduce`` for aggregation) and reports medians after warm-up;
``memory`` compares each policy's held buffers with the model's own parameter bytes.
"""

BENCHMARKS: dict[str, tuple[str, str]] = {
    "zipline": ("mpsync.bench.zipline", "ZipLine variants vs np.sort (ZipLine paper §6.1 data)"),
    "server": ("mpsync.bench.server", "state-server query latency/throughput vs raw mpi4py ping-pong"),
    "allreduce": ("mpsync.bench.allreduce", "mpsync aggregation vs raw hvd.allreduce / mpi4py Allreduce"),
    "collectives": ("mpsync.bench.collectives", "a script's allreduce / allgather / broadcast: mpsync vs Horovod vs blocking mpi4py, interleaved in one job"),
    "transport": ("mpsync.bench.transport", "Open MPI defaults vs mpsync's tuned transport across cluster nodes (bus bandwidth)"),
    "simulate": ("mpsync.bench.simulate", "mpsync simulate replaying real runs: wait fraction and samples/s errors"),
    "startup": ("mpsync.bench.startup", "seconds from mpirun to the first iteration: mpsync train and a Horovod-style script vs importing torch, numba, mpi4py"),
    "commit": ("mpsync.bench.commit", "a durable commit of the wide MLP (copy, background write) vs a training step"),
    "memory": ("mpsync.bench.memory", "bytes each policy keeps per worker beyond parameters and gradients"),
    "psopt": ("mpsync.bench.psopt", "a PS shard's work per push with the workers' optimizer vs its own (SGD, Adam), beside the worker's torch.optim step; the simulated shard bottleneck"),
}

__all__ = ["BENCHMARKS"]
