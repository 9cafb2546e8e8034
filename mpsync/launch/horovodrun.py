"""horovodrun: Horovod's launcher in its MPI mode, on this machine or on the hosts named.

mpsync's state server talks over MPI, so Horovod must start the ranks with ``mpirun``
(``--mpi``), not Gloo; horovodrun forwards the whole environment (``-x`` for every variable)
itself.  Its script runs in place, without a scheduler: the rank count and the hosts are the
script's own settings.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from mpsync import transport
from mpsync.launch.mpirun import YIELD_WHEN_IDLE
from mpsync.launch.settings import JobSettings, JobTemplateError
from mpsync.launch.target import LaunchTarget, Variable

__all__ = ["TARGET", "horovodrun_argv"]

USAGE = {
    "train": [
        "bash jobs/horovodrun/train.sh                       # 5 ranks on this machine",
        "NP=9 HOSTS=node1:5,node2:4 POLICY=esync bash jobs/horovodrun/train.sh",
        "NP=16 HOSTFILE=hosts.txt bash jobs/horovodrun/train.sh   # lines: node1 slots=8",
    ],
}

TESTED = {
    "train": [
        "Tested: tests/test_jobs.py runs this script on one node (HOSTS=localhost:NP) and",
        "checks the outputs. Multi-node runs (ssh between hosts) were not tested."],
}

PROLOGUE = """
set -euo pipefail

# -- where this runs ---------------------------------------------------------------------------
# Started in place (no scheduler): the repository is two levels above this file.
REPO=$(cd -- "$(dirname -- "${{BASH_SOURCE[0]}}")/../.." && pwd)
JOB_ID=$(date +%Y%m%d-%H%M%S)
LOG_DIR=$PWD
TASKS={ranks}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}
"""

HOROVODRUN_LAUNCH = """
# horovodrun --mpi: mpsync's state server talks over MPI, so Horovod must start the ranks with
# mpirun (not Gloo).  horovodrun forwards the whole environment (-x for every variable) itself.
launch=("$VENV/bin/horovodrun" --mpi -np "$NP")
if [ -n "$HOSTFILE" ]; then launch+=(--hostfile "$HOSTFILE"); else launch+=(-H "$HOSTS"); fi
launch+=(--mpi-args=\"""" + " ".join(YIELD_WHEN_IDLE) + """ ${tuning[*]}\")
read -r -a more <<<"$HOROVODRUN_ARGS"
launch+=("${more[@]}")
command=("${launch[@]}" "${train[@]}")
"""


def horovodrun_argv(nprocs: int, command: Sequence[str], *, hosts: str | None = None,
                    horovodrun: str | None = None) -> list[str]:
    """``horovodrun --mpi`` of ``command`` on ``nprocs`` ranks (``hosts``: ``host:slots,...``,
    default all on this machine), the venv's horovodrun unless ``horovodrun`` names one."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if not command:
        raise ValueError("command must not be empty")
    exe = horovodrun or str(Path(sys.executable).with_name("horovodrun"))
    # Across hosts (or when asked) Horovod's MPI_Allreduce gets the tuned transport.
    mpi_args = [*YIELD_WHEN_IDLE, *(transport.mca_argv() if hosts or transport.is_set()
                                    else ())]
    return [exe, "--mpi", "-np", str(nprocs), "-H", hosts or f"localhost:{nprocs}",
            f"--mpi-args={' '.join(mpi_args)}", *command]


def variables(template: str, s: JobSettings) -> list[Variable]:
    return [
        ("HOSTS", s.hosts or "localhost:$NP",
         f"host:slots list (default: {s.hosts or 'localhost:NP'})"),
        ("HOSTFILE", "",
         "Horovod hostfile, lines 'host slots=K' (default: empty; used instead of HOSTS)"),
        ("HOROVODRUN_ARGS", "", "more horovodrun options"),
    ]


def check(template: str, s: JobSettings) -> None:
    if s.nodes > 1 and not s.hosts:
        raise JobTemplateError("horovodrun on more than one node needs --hosts "
                               "(e.g. node1:8,node2:8) or a HOSTFILE at run time")


TARGET = LaunchTarget(
    name="horovodrun", description="horovodrun --mpi, on this machine or the hosts named",
    argv=horovodrun_argv, templates={"train": "horovodrun/train.sh"},
    words=("a horovodrun launch", "horovodrun --mpi (Horovod's launcher, over mpirun)"),
    usage=USAGE, tested=TESTED, prologue=PROLOGUE, launch_text=HOROVODRUN_LAUNCH,
    variables=variables, check=check, allocated=False)
