"""The state server's start-up: a server slower to start than a decision's deadline is not a
fault (imports and compiling its rules on a busy node), so workers wait for it as long as the
server waits for them (``startup_timeout``)."""

from __future__ import annotations

import re

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


def test_a_server_slower_to_start_than_the_deadline_still_registers_its_workers():
    """A worker's first call waits for the server's start-up (``startup_timeout``), not for a
    decision (``deadline``): a server that starts 3 s late serves workers whose deadline is 1 s."""
    run = run_mpi("server_fault_programs:late_server", np=3, timeout=90,
                  args=["late=3", "deadline=1", "startup=30"])
    for rank in (1, 2):
        waited = re.search(r"REGISTERED rank=%d waited=([\d.]+)" % rank, run.rank_out(rank))
        assert waited and float(waited.group(1)) >= 2.5, run.report()
