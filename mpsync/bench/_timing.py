"""What the aggregation benchmarks share: the ``--sizes`` parser, the interleaved timing of
several collectives on every rank, and how a result is written out."""

from __future__ import annotations

import json
import os
import time

__all__ = ["byte_sizes", "timed", "interleaved", "report_json"]


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


def timed(comm, methods: dict, max_repeats: int, budget: float, block: int = 1,
          settle: int = 0) -> dict:
    """Median over repeats of the slowest rank's time for each ``methods[name]()``, in ms.

    The methods are interleaved (a barrier before each call), so background activity hits all
    of them alike: one call of each per round, or with ``block`` > 1 that many calls of each
    in turn, the first ``settle`` of each block run but not counted (``interleaved``).  One
    warm-up round sizes the number of repeats (rank 0's estimate, so all ranks agree).
    """
    names = list(methods)
    comm.Barrier()
    t0 = time.perf_counter()
    for name in names:
        methods[name]()
    once = time.perf_counter() - t0
    repeats = comm.bcast(int(min(max_repeats, max(3, budget / max(once, 1e-6)))), root=0)
    return interleaved(comm, methods, repeats, block=block, settle=settle)


def interleaved(comm, methods: dict, repeats: int, before=None, block: int = 1,
                settle: int = 0) -> dict:
    """``{name: median ms}`` over ``repeats`` counted calls of each method, each call timed on
    every rank after a barrier and ``before()`` (untimed), the slowest rank's time counted.

    The methods take turns in blocks of ``block`` calls, of which the first ``settle`` run but
    are not counted: a method whose peer adapts to the rhythm of its calls (a state server
    that sleeps until a worker's next report is due) is then timed at that rhythm, not on the
    first call after the other methods' turns; the turns still catch a background that
    changes within the run, alike for every method.
    """
    import numpy as np  # the parent process that parses arguments needs neither
    from mpi4py import MPI

    if not 0 <= settle < block:
        raise ValueError(f"settle: need 0 <= settle < block ({block}), got {settle}")
    names, counted = list(methods), block - settle
    rounds = -(-repeats // counted)
    times = np.zeros((len(names), rounds * counted))
    for r in range(rounds):
        for j, name in enumerate(names):
            for c in range(block):
                comm.Barrier()
                if before is not None:
                    before()
                t0 = time.perf_counter()
                methods[name]()
                if c >= settle:
                    times[j, r * counted + c - settle] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: 1e3 * float(np.median(times[j])) for j, name in enumerate(names)}
