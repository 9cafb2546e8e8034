"""horovod.torch's semantics on mpsync's workers, checked against references computed from
the same seeds: integer averages, errors raised on every worker with the job going on,
gradients through collectives, the async and grouped variants, process sets, join with the
script's collectives, DistributedOptimizer details.  One mpirun per case, each running every
check (tests/horovod_semantics_programs.py); 2 and 3 workers, the collectives also under the
local-step policies (which never consult the state server for them).
"""

from __future__ import annotations

import json

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi

CASES = [(2, "bsp"), (3, "bsp"), (2, "esync"), (3, "ebsp")]


@pytest.mark.parametrize("np, policy", CASES, ids=[f"{p}-np{n}" for n, p in CASES])
def test_horovod_semantics(tmp_path, np, policy):
    trace = tmp_path / "timeline.json"
    run = run_mpi("horovod_semantics_programs:main", np=np,
                  args=[f"policy={policy}", f"optimizer={'yes' if policy == 'bsp' else 'no'}",
                        f"timeline={trace}"], timeout=240)
    for r in range(np):
        assert f"SEMANTICS-OK rank={r}" in run.rank_out(r), run.report()
    if policy == "bsp":
        names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
        assert {"compute", "aggregate"} <= names, names


def test_a_collectives_set_up_has_a_deadline_naming_the_late_worker():
    run = run_mpi("horovod_semantics_programs:deadline", np=2, timeout=120)
    assert all(f"DEADLINE-OK rank={r}" in run.rank_out(r) for r in range(2)), run.report()
