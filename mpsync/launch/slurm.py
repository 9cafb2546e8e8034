"""Slurm: batch scripts whose ranks ``mpirun`` starts over the job's allocation.

Open MPI reads the nodes and tasks per node from Slurm itself (and starts its daemons with
``srun``), so the script needs no hostfile.
"""

from __future__ import annotations

from mpsync.launch.mpirun import MPIRUN_LAUNCH, script_variables
from mpsync.launch.settings import JobSettings
from mpsync.launch.target import LaunchTarget, reject_hosts

__all__ = ["TARGET", "header"]

USAGE = {
    "train": [
        "sbatch jobs/slurm/train.sbatch                      # from the repository root",
        "POLICY=esync SLOWDOWN=1,1,2,4 sbatch jobs/slurm/train.sbatch",
        "sbatch --nodes=2 --ntasks-per-node=8 jobs/slurm/train.sbatch",
        "mpsync jobs render --scheduler slurm --nodes 2 --tasks-per-node 8 --policy esync > my.sbatch",
    ],
    "compare": [
        "sbatch jobs/slurm/compare.sbatch                    # from the repository root",
        "POLICIES=bsp,esync SLOWDOWN=1,1,2,4 TARGET_ACC=0.9 sbatch jobs/slurm/compare.sbatch",
        "POLICIES=bsp,ssp,esync TOPOLOGY=ps sbatch jobs/slurm/compare.sbatch   # all on the PS",
    ],
    "bench-kernels": [
        "sbatch jobs/slurm/bench-kernels.sbatch              # from the repository root",
        "BENCH_SIZES=4,100,1000 BENCH_RS=15 sbatch jobs/slurm/bench-kernels.sbatch",
    ],
}

TESTED = {
    "train": [
        "Tested: tests/test_slurm.py submits this script to a real single-node Slurm 22.05",
        "(slurmctld + slurmd started by .ci/slurm.sh) with a small run and checks the job's",
        "final state and the metrics.json it wrote. tests/test_cluster_slurm.py submits it",
        "with sbatch -N 2 to a two-node Slurm on the virtual cluster (mpsync cluster slurm:",
        "one slurmd per network-namespace node) and checks that ranks ran on both nodes."],
    "compare": [
        "Tested: tests/test_slurm.py submits this script to a real single-node Slurm 22.05,",
        "once with DRY_RUN=1 (the command built from the allocation) and once for real with",
        "POLICIES=bsp, 2 workers and a few seconds of training, and checks compare.json.",
        "Longer comparisons and multi-node runs were not tested."],
    "bench-kernels": [
        "Tested: tests/test_slurm.py submits this script to a real single-node Slurm 22.05",
        "with a small sweep and checks the job's final state, zipline.csv and zipline.png."],
}

PROLOGUE = """
set -euo pipefail

# -- where this job runs -----------------------------------------------------------------------
JOB_ID=${{SLURM_JOB_ID:?not inside a Slurm job: submit this script with sbatch}}
# Slurm runs a copy of this script from its spool directory; scontrol names the submitted file
# (the repository is two levels above it) and the job's log (the run folder goes beside it).
job_info=$(timeout 30 scontrol show job "$JOB_ID" 2>/dev/null || true)
submitted=$(sed -n 's/^ *Command=//p' <<<"$job_info")
job_log=$(sed -n 's/^ *StdOut=//p' <<<"$job_info")
LOG_DIR=$(dirname -- "${{job_log:-$SLURM_SUBMIT_DIR/log}}")
REPO=$SLURM_SUBMIT_DIR
if [ -f "$submitted" ] && [ -d "$(dirname -- "$submitted")/../../mpsync" ]; then
  REPO=$(cd -- "$(dirname -- "$submitted")/../.." && pwd)
fi
TASKS=$SLURM_NTASKS
HOSTFILE=""  # mpirun reads the nodes and tasks per node from Slurm itself
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-${{SLURM_CPUS_PER_TASK:-1}}}}
"""


def header(template: str, s: JobSettings) -> list[str]:
    lines = [f"#SBATCH --job-name={s.job_name}",
             f"#SBATCH --nodes={s.nodes}",
             f"#SBATCH --ntasks-per-node={s.tasks_per_node}",
             f"#SBATCH --cpus-per-task={s.cpus_per_task}"]
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    if template == "bench-kernels":
        lines.append("#SBATCH --exclusive")
    lines.append(f"#SBATCH --time={s.time}")
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    lines.append(f"#SBATCH --output={s.job_name}-%j.out")
    return lines


TARGET = LaunchTarget(
    name="slurm", description="a Slurm batch job (sbatch); mpirun over the allocation",
    templates={"train": "slurm/train.sbatch", "compare": "slurm/compare.sbatch",
               "bench-kernels": "slurm/bench-kernels.sbatch"},
    words=("a Slurm batch job", "mpirun that reads the allocation from Slurm"),
    usage=USAGE, tested=TESTED, header=header, prologue=PROLOGUE, launch_text=MPIRUN_LAUNCH,
    variables=script_variables, check=reject_hosts("slurm"))
