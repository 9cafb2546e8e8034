"""What the aggregation benchmarks share: the ``--sizes`` parser, the interleaved timing of
several collectives on every rank, and how a result is written out."""

from __future__ import annotations

import json
import os
import time

__all__ = ["byte_sizes", "timed", "report_json"]


def report_json(result: dict, out: str | None, filename: str, as_json: bool) -> bool:
    """Write ``result`` to ``out/filename`` (when ``out`` is given) and print it with
    ``as_json``; returns ``as_json`` (the caller prints its table otherwise)."""
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, filename), "w") as f:
            json.dump(result, f, indent=1)
    if as_json:
        print(json.dumps(result, indent=1))
    return as_json


def byte_sizes(text: str | None, default: tuple[int, ...]) -> list[int]:
    """``"4096,1e6"`` -> [4096, 1000000]; ``default`` when ``text`` is empty."""
    if not text:
        return list(default)
    sizes = [int(float(x)) for x in text.split(",") if x.strip()]
    if not sizes or any(s < 4 for s in sizes):
        raise SystemExit(f"--sizes: need byte counts >= 4, got {text!r}")
    return sizes


def timed(comm, methods: dict, max_repeats: int, budget: float) -> dict:
    """Median over repeats of the slowest rank's time for each ``methods[name]()``, in ms.

    The methods are interleaved (one call of each per repeat, a barrier before each call), so
    background activity hits all of them alike.  One warm-up round sizes the number of repeats
    (rank 0's estimate, so all ranks agree).
    """
    import numpy as np  # the parent process that parses arguments needs neither
    from mpi4py import MPI

    names = list(methods)
    comm.Barrier()
    t0 = time.perf_counter()
    for name in names:
        methods[name]()
    once = time.perf_counter() - t0
    repeats = comm.bcast(int(min(max_repeats, max(3, budget / max(once, 1e-6)))), root=0)
    times = np.zeros((len(names), repeats))
    for i in range(repeats):
        for j, name in enumerate(names):
            comm.Barrier()
            t0 = time.perf_counter()
            methods[name]()
            times[j, i] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: 1e3 * float(np.median(times[j])) for j, name in enumerate(names)}
