"""``mpsync doctor`` on this installation, and on one with a broken item."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

DOCTOR = [sys.executable, "-m", "mpsync.cli", "doctor", "--timeout", "60"]


def _run(env=None):
    return subprocess.run(DOCTOR, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.mpi
def test_doctor_passes_and_reports_horovod_build_flags():
    res = _run()
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "built with PyTorch=yes, MPI=yes, Gloo=yes" in out
    for name in ("numpy", "numba", "torch", "mpi4py", "Open MPI", "MPI thread level"):
        assert name in out, name
    assert "two ranks exchanged a message" in out
    # The device transports, each named with what this machine has (gloo is in every torch
    # build mpsync supports; the rest depend on the machine).
    line = next(ln for ln in out.splitlines() if "device transports" in ln)
    assert "gloo=yes" in line, line
    for name in ("nccl=", "CUDA-aware MPI=", "Horovod NCCL ops="):
        assert name in line, (name, line)


def test_doctor_fails_with_one_line_reason_when_mpirun_is_missing():
    env = dict(os.environ, PATH="/nonexistent")
    res = _run(env)
    assert res.returncode == 1, res.stdout + res.stderr
    reasons = res.stderr.strip().splitlines()
    # Without mpirun/orted on PATH, neither a singleton MPI_Init nor mpirun can work: one line
    # each, naming the item, and the items that still work are reported as ok.
    assert "mpsync doctor: mpirun -np 2: mpirun not found on PATH (install openmpi-bin)" in reasons
    assert all(line.startswith("mpsync doctor: ") for line in reasons), reasons
    assert "BAD  mpirun -np 2" in res.stdout
    assert "ok   numba kernel" in res.stdout


def test_the_cache_warm_up_runs_every_policy_and_names_a_job_that_failed():
    from mpsync import doctor, policies

    jobs = doctor.warm_jobs()
    warmed = {flags[flags.index("--policy") + 1] for flags in jobs}
    assert warmed == set(policies.names()), warmed   # a new policy is warmed too
    inbox = {flags[1] for flags in jobs if "--ps-optimizer" in flags}
    assert inbox == {s.name for s in policies.specs() if s.steps_unawaited
                     and not s.ps_average and s.name != policies.AUTO} and inbox, inbox
    lines = []
    checks = doctor.warm_cache(timeout=120, log=lines.append,
                               jobs=[("--policy", jobs[0][1], "--staleness", "-1")])
    name = f"warm {jobs[0][1]}"
    assert [(c.name, c.ok) for c in checks] == [(name, False)], checks
    assert "exit 2: " in checks[0].detail and "staleness" in checks[0].detail, checks
    assert lines == [f"BAD  {name}  {checks[0].detail}"]
