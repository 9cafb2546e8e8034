"""PBS (PBS Pro / OpenPBS): batch scripts whose ranks ``mpirun`` starts over
``$PBS_NODEFILE``.

Open MPI as packaged by Debian has no PBS (tm) support, so the script passes the node file as
the hostfile.
"""

from __future__ import annotations

from mpsync.launch.mpirun import MPIRUN_LAUNCH, script_variables
from mpsync.launch.settings import JobSettings
from mpsync.launch.target import LaunchTarget, reject_hosts

__all__ = ["TARGET", "header"]

USAGE = {
    "train": [
        "qsub jobs/pbs/train.pbs                             # from the repository root",
        "POLICY=esync SLOWDOWN=1,1,2,4 qsub jobs/pbs/train.pbs     # -V: the environment is passed",
        "qsub -l select=2:ncpus=8:mpiprocs=8 jobs/pbs/train.pbs",
        "mpsync jobs render --scheduler pbs --nodes 2 --tasks-per-node 8 > my.pbs",
    ],
}

TESTED = {
    "train": [
        "Tested: tests/test_jobs.py runs this script with the variables a PBS server sets",
        "(PBS_JOBID, PBS_O_WORKDIR, PBS_NODEFILE, ...) on one node and checks the outputs.",
        "Not tested: the #PBS directives against a real PBS server (none in Debian's",
        "packages), multi-node runs. On Torque, write -l nodes=N:ppn=K instead of -l select=..."],
}

PROLOGUE = """
set -euo pipefail

# -- where this job runs -----------------------------------------------------------------------
JOB_ID=${{PBS_JOBID:?not inside a PBS job: submit this script with qsub}}
JOB_ID=${{JOB_ID%%.*}}  # 1234.server -> 1234
# PBS starts a job in $HOME and copies its log (-j oe) to the submission directory.
cd -- "${{PBS_O_WORKDIR:?PBS_O_WORKDIR is not set}}"
LOG_DIR=$PBS_O_WORKDIR
REPO=$PBS_O_WORKDIR
# One line per MPI process: select=N:...:mpiprocs=K lists each node K times.  Open MPI as
# packaged by Debian has no PBS (tm) support, so the hostfile is passed explicitly.
HOSTFILE=${{PBS_NODEFILE:?PBS_NODEFILE is not set}}
TASKS=$(grep -c . "$HOSTFILE")
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}  # PBS sets it from ompthreads=
"""


def header(template: str, s: JobSettings) -> list[str]:
    select = (f"{s.nodes}:ncpus={s.tasks_per_node * s.cpus_per_task}"
              f":mpiprocs={s.tasks_per_node}:ompthreads={s.cpus_per_task}")
    if s.gpus_per_node:
        select += f":ngpus={s.gpus_per_node}"
    lines = [f"#PBS -N {s.job_name}",
             f"#PBS -l select={select}",
             "#PBS -l place=scatter",
             f"#PBS -l walltime={s.time}",
             "#PBS -j oe",
             "#PBS -V"]
    if s.partition:
        lines.append(f"#PBS -q {s.partition}")
    if s.account:
        lines.append(f"#PBS -A {s.account}")
    return lines


TARGET = LaunchTarget(
    name="pbs", description="a PBS batch job (qsub); mpirun over $PBS_NODEFILE",
    templates={"train": "pbs/train.pbs"},
    words=("a PBS (PBS Pro / OpenPBS) batch job", "mpirun over $PBS_NODEFILE"),
    usage=USAGE, tested=TESTED, header=header, prologue=PROLOGUE, launch_text=MPIRUN_LAUNCH,
    variables=script_variables, check=reject_hosts("pbs"))
