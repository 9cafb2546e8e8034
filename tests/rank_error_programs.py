"""Scripts for tests/test_rank_errors.py, run as plain scripts under mpirun (no harness runner
in the way): ``python rank_error_programs.py NAME``."""

from __future__ import annotations

import sys
import time

import mpsync.torch as mps


def raise_before_init() -> None:
    """World rank 2 fails before init(); the others wait in init() for it."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 2:
        time.sleep(1.0)
        print(f"ERROR-AT {time.time():.3f}", flush=True)
        raise ValueError("a bug in the script before init")
    mps.init()
    mps.shutdown()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
