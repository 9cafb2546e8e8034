"""The text of the job scripts that ``mpsync.launch.jobs.render`` assembles: header,
documentation, settings, the prologue of each scheduler and the payload of each template.

Pure data and pure functions of :class:`mpsync.launch.settings.JobSettings`; kept apart from the
renderer so that ``mpsync/launch/jobs.py`` reads as the API (validation, render, sync, CLI).
"""

from __future__ import annotations

import shlex
import textwrap

from mpsync import policies as registry
from mpsync.config import BACKENDS, SERVER_PLACEMENTS, TOPOLOGIES
from mpsync.launch.mpirun import (FORWARDED_ENV, FORWARDED_PREFIXES, YIELD_WHEN_IDLE,
                                  mpirun_options)
from mpsync.launch.settings import JobSettings

__all__ = ["WIDTH", "header", "doc", "variables", "settings_block", "PROLOGUE", "PAYLOAD",
           "MPIRUN_LAUNCH", "HOROVODRUN_LAUNCH", "RUN"]

WIDTH = 96  # comment rule width in the scripts


# -- header and documentation ----------------------------------------------------------------

USAGE = {
    ("slurm", "train"): [
        "sbatch jobs/slurm/train.sbatch                      # from the repository root",
        "POLICY=esync SLOWDOWN=1,1,2,4 sbatch jobs/slurm/train.sbatch",
        "sbatch --nodes=2 --ntasks-per-node=8 jobs/slurm/train.sbatch",
        "mpsync jobs render --scheduler slurm --nodes 2 --tasks-per-node 8 --policy esync > my.sbatch",
    ],
    ("slurm", "compare"): [
        "sbatch jobs/slurm/compare.sbatch                    # from the repository root",
        "POLICIES=bsp,esync SLOWDOWN=1,1,2,4 TARGET_ACC=0.9 sbatch jobs/slurm/compare.sbatch",
        "POLICIES=bsp,ssp,esync TOPOLOGY=ps sbatch jobs/slurm/compare.sbatch   # all on the PS",
    ],
    ("slurm", "bench-kernels"): [
        "sbatch jobs/slurm/bench-kernels.sbatch              # from the repository root",
        "BENCH_SIZES=4,100,1000 BENCH_RS=15 sbatch jobs/slurm/bench-kernels.sbatch",
    ],
    ("pbs", "train"): [
        "qsub jobs/pbs/train.pbs                             # from the repository root",
        "POLICY=esync SLOWDOWN=1,1,2,4 qsub jobs/pbs/train.pbs     # -V: the environment is passed",
        "qsub -l select=2:ncpus=8:mpiprocs=8 jobs/pbs/train.pbs",
        "mpsync jobs render --scheduler pbs --nodes 2 --tasks-per-node 8 > my.pbs",
    ],
    ("horovodrun", "train"): [
        "bash jobs/horovodrun/train.sh                       # 5 ranks on this machine",
        "NP=9 HOSTS=node1:5,node2:4 POLICY=esync bash jobs/horovodrun/train.sh",
        "NP=16 HOSTFILE=hosts.txt bash jobs/horovodrun/train.sh   # lines: node1 slots=8",
    ],
}

SUMMARY = {
    "train": [
        "mpsync train as {what}: every task is one MPI rank, all started by one",
        "{launcher}; with SERVER=dedicated rank 0 is the state server and the other ranks",
        "train ({ranks} ranks = {workers} workers + server by default).",
    ],
    "compare": [
        "mpsync compare as a Slurm batch job: one process runs every policy in POLICIES in",
        "turn, each as its own mpirun over the job's tasks (WORKERS workers + the server), and",
        "writes the comparison (time to TARGET_ACC, plots, one metrics.json per policy) to OUT_DIR.",
    ],
    "bench-kernels": [
        "The Numba decision kernels' microbenchmarks (mpsync bench zipline: every ZipLine",
        "variant vs np.sort of the same data, ZipLine paper §6.1) on a compute node, as one",
        "process on a whole node (--exclusive: neighbours would disturb the timings).",
        "zipline.csv, zipline.png and summary.json go to OUT_DIR.",
    ],
}

# Standard settings of the other scripts that a template does not read, and why.
NOT_APPLICABLE = {
    "bench-kernels": [
        "Not settings of this script: POLICY, TOPOLOGY, BACKEND, SERVER, EPOCHS, DATASET and",
        "SLOWDOWN (those of the train and compare scripts) do not apply to a kernel",
        "microbenchmark: it runs one process, with no mpirun, no state server, no aggregation",
        "and no model or data set; the kernels are timed on the ZipLine paper's synthetic",
        "iteration timings.",
    ],
}

LAUNCHER_WORDS = {
    "slurm": ("a Slurm batch job", "mpirun that reads the allocation from Slurm"),
    "pbs": ("a PBS (PBS Pro / OpenPBS) batch job", "mpirun over $PBS_NODEFILE"),
    "horovodrun": ("a horovodrun launch", "horovodrun --mpi (Horovod's launcher, over mpirun)"),
}

TESTED = {
    ("slurm", "train"): [
        "Tested: tests/test_slurm.py submits this script to a real single-node Slurm 22.05",
        "(slurmctld + slurmd started by .ci/slurm.sh) with a small run and checks the job's",
        "final state and the metrics.json it wrote. tests/test_cluster_slurm.py submits it",
        "with sbatch -N 2 to a two-node Slurm on the virtual cluster (mpsync cluster slurm:",
        "one slurmd per network-namespace node) and checks that ranks ran on both nodes."],
    ("slurm", "compare"): [
        "Tested: tests/test_slurm.py submits this script to a real single-node Slurm 22.05,",
        "once with DRY_RUN=1 (the command built from the allocation) and once for real with",
        "POLICIES=bsp, 2 workers and a few seconds of training, and checks compare.json.",
        "Longer comparisons and multi-node runs were not tested."],
    ("slurm", "bench-kernels"): [
        "Tested: tests/test_slurm.py submits this script to a real single-node Slurm 22.05",
        "with a small sweep and checks the job's final state, zipline.csv and zipline.png."],
    ("pbs", "train"): [
        "Tested: tests/test_jobs.py runs this script with the variables a PBS server sets",
        "(PBS_JOBID, PBS_O_WORKDIR, PBS_NODEFILE, ...) on one node and checks the outputs.",
        "Not tested: the #PBS directives against a real PBS server (none in Debian's",
        "packages), multi-node runs. On Torque, write -l nodes=N:ppn=K instead of -l select=..."],
    ("horovodrun", "train"): [
        "Tested: tests/test_jobs.py runs this script on one node (HOSTS=localhost:NP) and",
        "checks the outputs. Multi-node runs (ssh between hosts) were not tested."],
}


def header(scheduler: str, template: str, s: JobSettings) -> str:
    lines = ["#!/bin/bash"]
    if scheduler == "slurm":
        lines += [f"#SBATCH --job-name={s.job_name}",
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
    elif scheduler == "pbs":
        select = (f"{s.nodes}:ncpus={s.tasks_per_node * s.cpus_per_task}"
                  f":mpiprocs={s.tasks_per_node}:ompthreads={s.cpus_per_task}")
        if s.gpus_per_node:
            select += f":ngpus={s.gpus_per_node}"
        lines += [f"#PBS -N {s.job_name}",
                  f"#PBS -l select={select}",
                  "#PBS -l place=scatter",
                  f"#PBS -l walltime={s.time}",
                  "#PBS -j oe",
                  "#PBS -V"]
        if s.partition:
            lines.append(f"#PBS -q {s.partition}")
        if s.account:
            lines.append(f"#PBS -A {s.account}")
    return "\n".join(lines)


def doc(scheduler: str, template: str, s: JobSettings, variables) -> str:
    ranks = s.nodes * s.tasks_per_node
    what, launcher = LAUNCHER_WORDS[scheduler]
    summary = textwrap.wrap(" ".join(SUMMARY[template]).format(
        what=what, launcher=launcher, ranks=ranks, workers=ranks - 1), width=WIDTH - 2)
    out = ["#", *("# " + line for line in summary), "#", "# Usage:"]
    out += ["#   " + u for u in USAGE[(scheduler, template)]]
    out += ["#", "# Settings: environment variables, each read once below as ${NAME:-default}."]
    width = max(len(v[0]) for v in variables)
    for name, _default, text in variables:
        first, *rest = text.split("\n")
        out.append(f"#   {name:<{width}}  {first}")
        out += [f"#   {'':<{width}}  {more}" for more in rest]
    if template in NOT_APPLICABLE:
        out += ["#", *("# " + line for line in NOT_APPLICABLE[template])]
    out += ["#", *("# " + line for line in TESTED[(scheduler, template)])]
    return "\n".join(out)


# -- variables -------------------------------------------------------------------------------
# (NAME, default as shell text, documentation).  The documentation states the default in words
# where it is computed at run time.

def variables(scheduler: str, template: str, s: JobSettings) -> list[tuple[str, str, str]]:
    venv = s.venv or "$REPO/.venv"
    venv_doc = (f"Python environment with mpsync (default: {s.venv})" if s.venv else
                "Python environment with mpsync (default: the repository's .venv)")
    out_doc = ("the run folder (default: mpsync-<template>-<job id> next to the job's log)"
               .replace("<template>", template))
    if scheduler == "horovodrun":
        out_doc = f"the run folder (default: ./mpsync-{template}-<date-time>)"
    out_dir = s.out_dir or f"$LOG_DIR/mpsync-{template}-$JOB_ID"
    if s.out_dir:
        out_doc = f"the run folder (default: {s.out_dir})"
    ranks_doc = ("MPI ranks (default: all tasks of the job)" if scheduler != "horovodrun"
                 else f"MPI ranks (default: {s.nodes * s.tasks_per_node})")
    ps_own = ", ".join(p.name for p in registry.specs() if p.default_topology == "ps")
    topology_doc = (f"{' | '.join(TOPOLOGIES)} (default: {s.topology})" if s.topology else
                    f"{' | '.join(TOPOLOGIES)} (default: empty, the policy's own: ps for "
                    f"{ps_own};\nring for the others; --topology is passed only when set)")
    if template == "compare" and not s.topology:
        topology_doc = topology_doc.replace("the policy's own", "each policy's own")
    common_run = [
        ("EPOCHS", str(s.epochs), f"epochs per worker (default: {s.epochs}); ignored if TIME_BUDGET is set"),
        ("TIME_BUDGET", "", "seconds of training instead of EPOCHS (default: empty)"),
        ("DATASET", s.dataset, f"digits | synthetic | npz:PATH (default: {s.dataset})"),
        ("SLOWDOWN", s.slowdown, "per-worker slowdown factors, e.g. 1,1,2,4 (default: "
                                 f"{s.slowdown or 'empty, none'})"),
        ("TARGET_ACC", s.target_acc, "accuracy for the time-to-accuracy report (default: "
                                     f"{s.target_acc or 'empty, none'})"),
    ]
    if template == "train":
        variables = [
            ("POLICY", s.policy, f"{' | '.join(registry.names())} (default: {s.policy})"),
            ("TOPOLOGY", s.topology, topology_doc),
            ("BACKEND", s.backend, f"{' | '.join(BACKENDS)} (default: {s.backend})"),
            ("SERVER", s.server, f"{' | '.join(SERVER_PLACEMENTS)} (default: {s.server}): "
                                 "dedicated = rank 0 serves,\nthe rest train; colocated = "
                                 "a server thread on rank 0, every rank trains"),
            *common_run,
            ("SEED", "", "random seed (default: empty, mpsync train's own)"),
            ("TRAIN_ARGS", "", "more mpsync train flags, e.g. \"--staleness 3 --lookahead 15\""),
        ]
    elif template == "compare":
        variables = [
            ("POLICIES", s.policies, f"policies to compare, comma-separated (default: {s.policies})"),
            ("TOPOLOGY", s.topology, topology_doc),
            ("BACKEND", s.backend, f"{' | '.join(BACKENDS)} (default: {s.backend})"),
            ("SERVER", s.server, f"{' | '.join(SERVER_PLACEMENTS)} (default: {s.server})"),
            ("WORKERS", "", "training ranks (default: all tasks, less one for a dedicated server)"),
            *common_run,
            ("COMPARE_ARGS", "", "more mpsync compare flags"),
        ]
    else:
        variables = [
            ("BENCH_SIZES", "4,10,100,200,400,600,800,1000,2000,5000",
             "numbers of workers n of the sweep (default: the paper's)"),
            ("BENCH_RS", "15,150", "lookaheads R of the sweep (default: 15,150)"),
            ("BENCH_SAMPLES", "9", "timed samples per point, median reported (default: 9)"),
            ("BENCH_VARIANTS", "", "ZipLine variants, comma-separated (default: empty, all)"),
            ("BENCH_ARGS", "", "more mpsync bench zipline flags"),
        ]
    if template != "bench-kernels":
        variables.append(("NP", "$TASKS", ranks_doc))
    if scheduler == "horovodrun":
        hosts = s.hosts or "localhost:$NP"
        variables += [
            ("HOSTS", hosts, f"host:slots list (default: {s.hosts or 'localhost:NP'})"),
            ("HOSTFILE", "", "Horovod hostfile, lines 'host slots=K' (default: empty; used instead of HOSTS)"),
            ("HOROVODRUN_ARGS", "", "more horovodrun options"),
        ]
    elif template == "train":
        variables.append(("MPIRUN_ARGS", "", "more mpirun options, e.g. \"--map-by ppr:4:node\""))
    variables += [
        ("OUT_DIR", out_dir, out_doc),
        ("VENV", venv, venv_doc),
        ("DRY_RUN", "0", "1: print the command and exit without running it"),
    ]
    return variables


def settings_block(variables) -> str:
    lines = [("# -- settings ").ljust(WIDTH, "-")]
    for name, default, doc in variables:
        lines.append(f"{name}=${{{name}:-{default}}}")
    return "\n".join(lines)


# -- prologues: where the job runs -----------------------------------------------------------

PROLOGUE = {
    "slurm": """
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
""",
    "pbs": """
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
""",
    "horovodrun": """
set -euo pipefail

# -- where this runs ---------------------------------------------------------------------------
# Started in place (no scheduler): the repository is two levels above this file.
REPO=$(cd -- "$(dirname -- "${{BASH_SOURCE[0]}}")/../.." && pwd)
JOB_ID=$(date +%Y%m%d-%H%M%S)
LOG_DIR=$PWD
TASKS={ranks}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}
""",
}


# -- payloads: what the job does ---------------------------------------------------------------

CHECKS = """
# -- checks, before anything starts ------------------------------------------------------------
die() { echo "error: $*" >&2; exit 2; }
[ -x "$VENV/bin/python" ] ||
  die "VENV=$VENV has no bin/python; set VENV to the environment where mpsync is installed"
"""

RANK_CHECKS = """case $TOPOLOGY in
  ''|ring|ps) ;;
  *) die "TOPOLOGY must be ring, ps or empty (the policy's own), got '$TOPOLOGY'" ;;
esac
[[ $NP =~ ^[0-9]+$ ]] && ((NP >= 1)) || die "NP must be a positive integer, got '$NP'"
case $SERVER in
  dedicated) ((NP >= 2)) || die "SERVER=dedicated needs 2 ranks or more (server + workers), NP=$NP" ;;
  colocated) ;;
  *) die "SERVER must be dedicated or colocated, got '$SERVER'" ;;
esac
"""

def run_shape_flags(array: str) -> str:
    """Shell lines adding the run-length and heterogeneity flags shared by train and compare."""
    return (f'if [ -n "$TIME_BUDGET" ]; then\n  {array}+=(--time-budget "$TIME_BUDGET")\n'
            f'else\n  {array}+=(--epochs "$EPOCHS")\nfi\n'
            f'[ -z "$SLOWDOWN" ] || {array}+=(--slowdown "$SLOWDOWN")\n'
            f'[ -z "$TARGET_ACC" ] || {array}+=(--target-acc "$TARGET_ACC")\n')


TRAIN_ARGV = """
# -- the command -------------------------------------------------------------------------------
export PYTHONUNBUFFERED=1
train=("$VENV/bin/python" -m mpsync.cli train --policy "$POLICY")
# Empty TOPOLOGY: mpsync train picks the policy's own (ps for asp/ssp/dssp, ring otherwise).
[ -z "$TOPOLOGY" ] || train+=(--topology "$TOPOLOGY")
train+=(--backend "$BACKEND" --server "$SERVER" --dataset "$DATASET" --out "$OUT_DIR")
""" + run_shape_flags("train") + """[ -z "$SEED" ] || train+=(--seed "$SEED")
read -r -a more <<<"$TRAIN_ARGS"
train+=("${more[@]}")
"""

RUN = """
# -- run ---------------------------------------------------------------------------------------
echo "mpsync: job $JOB_ID, run folder $OUT_DIR"
echo "mpsync: $(printf '%q ' "${command[@]}")"
[ "$DRY_RUN" != 1 ] || exit 0
mkdir -p -- "$OUT_DIR"
printf '%q ' "${command[@]}" >"$OUT_DIR/command.sh"
echo >>"$OUT_DIR/command.sh"
"${command[@]}"
"""

PAYLOAD = {
    "train": CHECKS + RANK_CHECKS + TRAIN_ARGV,
    "compare": CHECKS + RANK_CHECKS + """
if [ -z "$WORKERS" ]; then
  WORKERS=$NP
  [ "$SERVER" = colocated ] || WORKERS=$((NP - 1))
fi

# -- the command -------------------------------------------------------------------------------
# One process: mpsync compare starts one mpirun per policy, which takes its slots from the
# job's allocation.
export PYTHONUNBUFFERED=1
# With SERVER=colocated it starts WORKERS ranks per policy, else WORKERS + 1.
compare=("$VENV/bin/python" -m mpsync.cli compare --np "$WORKERS" --policies "$POLICIES"
         --backend "$BACKEND" --server "$SERVER" --dataset "$DATASET" --out "$OUT_DIR" --json)
# Empty TOPOLOGY: each policy on its own (ps for asp/ssp/dssp, ring otherwise).
[ -z "$TOPOLOGY" ] || compare+=(--topology "$TOPOLOGY")
# Empty SLOWDOWN means no slowdown, as in the train scripts: compare's own default (the demo's
# 1,1,2,4) fits only 4 workers.
[ -n "$SLOWDOWN" ] || compare+=(--slowdown "")
""" + run_shape_flags("compare") + """read -r -a more <<<"$COMPARE_ARGS"
compare+=("${more[@]}")
command=("${compare[@]}")
""" + RUN,
    "bench-kernels": CHECKS + """
# -- the command -------------------------------------------------------------------------------
# One process: the kernels are single-threaded Numba code measured against np.sort in the same
# run, so the numbers are ratios that compare across nodes.
export PYTHONUNBUFFERED=1
bench=("$VENV/bin/python" -m mpsync.bench zipline --out "$OUT_DIR" --sizes "$BENCH_SIZES"
       --Rs "$BENCH_RS" --samples "$BENCH_SAMPLES")
[ -z "$BENCH_VARIANTS" ] || bench+=(--variants "$BENCH_VARIANTS")
read -r -a more <<<"$BENCH_ARGS"
bench+=("${more[@]}")
command=("${bench[@]}")
""" + RUN,
}

# The fixed mpirun options are mpsync.launch.mpirun's (the same builder as mpsync compare, the
# benchmarks and the tests); root, the hostfile and the forwarded names are known only when
# the job runs, so the script adds them, from the same lists.
MPIRUN_LAUNCH = """
# Ranks are placed by slot: rank 0 (the dedicated server) is the first task of the first node.
launch=(mpirun -np "$NP" """ + shlex.join(mpirun_options(
    oversubscribe=False, allow_run_as_root=False, tag_output=True)) + """)
[ "$(id -u)" != 0 ] || launch+=(--allow-run-as-root)  # Open MPI refuses root without it
[ -z "$HOSTFILE" ] || launch+=(--hostfile "$HOSTFILE")
# Open MPI passes no environment to remote nodes unless named with -x (names, not patterns).
for name in """ + " ".join(FORWARDED_ENV) + """ \\
            $(compgen -e | grep -E '^(""" + "|".join(p.rstrip("_") for p in FORWARDED_PREFIXES) + """)_' || true); do
  [ -z "${!name+set}" ] || launch+=(-x "$name")
done
read -r -a more <<<"$MPIRUN_ARGS"
launch+=("${more[@]}")
command=("${launch[@]}" "${train[@]}")
"""

HOROVODRUN_LAUNCH = """
# horovodrun --mpi: mpsync's state server talks over MPI, so Horovod must start the ranks with
# mpirun (not Gloo).  horovodrun forwards the whole environment (-x for every variable) itself.
launch=("$VENV/bin/horovodrun" --mpi -np "$NP")
if [ -n "$HOSTFILE" ]; then launch+=(--hostfile "$HOSTFILE"); else launch+=(-H "$HOSTS"); fi
launch+=(--mpi-args=\"""" + " ".join(YIELD_WHEN_IDLE) + """\")
read -r -a more <<<"$HOROVODRUN_ARGS"
launch+=("${more[@]}")
command=("${launch[@]}" "${train[@]}")
"""
