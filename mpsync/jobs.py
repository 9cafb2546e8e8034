"""``mpsync jobs``: batch job scripts for Slurm, PBS and horovodrun, rendered for your settings.

    mpsync jobs list
    mpsync jobs render --scheduler slurm --nodes 2 --tasks-per-node 8 --policy esync > my.sbatch
    mpsync jobs sync [--check]     # (re)write jobs/ from the defaults; --check only compares

``render`` is a pure function of (scheduler, template, JobSettings): no environment, no clock,
no file system.  The files under ``jobs/`` are exactly what it renders for the default settings,
and a test keeps the two identical, so a user can copy a file from ``jobs/`` or render one and
get the same script.

Every script has the same three parts:

1. a scheduler header (``#SBATCH`` / ``#PBS`` lines; nothing for horovodrun) and a comment
   listing its ``${VAR:-default}`` settings;
2. a prologue that reads where it runs from the scheduler: job id, the directory of the job's
   log (the run folder goes beside it), the repository (for the default ``VENV``), the number
   of tasks and the hostfile;
3. a scheduler-neutral payload that checks the settings, builds the command as a bash array
   (never one formatted string) and starts it: ``mpirun`` over all the job's tasks for
   ``train`` (with a dedicated server, rank 0 serves and the rest train), ``horovodrun --mpi``
   for the horovodrun form, one process for ``compare`` (which starts its own ``mpirun`` per
   policy inside the allocation) and for the kernel benchmarks.

Settings given to ``render`` become the defaults after ``:-``; environment variables still
override them at submission time (``POLICY=esync sbatch train.sbatch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from mpsync.apps.train import default_topology
from mpsync.config import (BACKENDS, POLICIES, SERVER_PLACEMENTS, TOPOLOGIES, ConfigError,
                           SyncConfig, parse_float_list)

__all__ = ["JobSettings", "JobTemplateError", "TEMPLATES", "SCHEDULERS", "render",
           "default_path", "sync_jobs_dir", "add_arguments", "main"]

SCHEDULERS = ("slurm", "pbs", "horovodrun")

# (scheduler, template) -> path under the repository's jobs/ directory.
TEMPLATES: dict[tuple[str, str], str] = {
    ("slurm", "train"): "slurm/train.sbatch",
    ("slurm", "compare"): "slurm/compare.sbatch",
    ("slurm", "bench-kernels"): "slurm/bench-kernels.sbatch",
    ("pbs", "train"): "pbs/train.pbs",
    ("horovodrun", "train"): "horovodrun/train.sh",
}

# Per template: tasks per node (train: 4 workers + the dedicated server) and wall time.
_TEMPLATE_DEFAULTS = {
    "train": (5, "01:00:00"),
    "compare": (5, "02:00:00"),
    "bench-kernels": (1, "01:00:00"),
}

# Characters that would end or expand a ``${VAR:-default}`` word or a directive.
_UNSAFE = re.compile(r"[$`\\\"'}\n\r]")
_TIME = re.compile(r"^(\d+-)?\d{1,3}:\d{2}:\d{2}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


_WIDTH = 96  # comment rule width in the scripts


class JobTemplateError(ValueError):
    """A setting that cannot go into a job script; the message names it."""


@dataclass(frozen=True)
class JobSettings:
    """What a user picks when rendering a script.  ``None`` means the template's default."""

    # allocation
    nodes: int = 1
    tasks_per_node: int | None = None
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    time: str | None = None          # wall time, [D-]HH:MM:SS
    job_name: str | None = None      # default: mpsync-<template>
    partition: str = ""              # Slurm partition / PBS queue
    account: str = ""
    hosts: str = ""                  # horovodrun: host1:K,host2:K (default localhost:<ranks>)
    # run (defaults of the scripts' ${VAR:-default} settings)
    policy: str = "bsp"
    # Empty: the policy's own topology (ps for asp/ssp/dssp, ring otherwise), chosen by mpsync
    # train / compare, so that POLICY=ssp alone is a valid submission.
    topology: str = ""
    backend: str = "horovod"
    server: str = "dedicated"
    epochs: int = 5
    dataset: str = "digits"
    slowdown: str = ""
    target_acc: str = ""
    policies: str = "bsp,ebsp,esync,osp"  # compare
    venv: str = ""                   # default: <repository>/.venv
    out_dir: str = ""                # default: beside the job's log

    def resolved(self, template: str) -> "JobSettings":
        tasks, time = _TEMPLATE_DEFAULTS[template]
        return dataclasses.replace(
            self,
            tasks_per_node=tasks if self.tasks_per_node is None else self.tasks_per_node,
            time=time if self.time is None else self.time,
            job_name=f"mpsync-{template}" if self.job_name is None else self.job_name)


def default_path(scheduler: str, template: str) -> str:
    """Path of the default script under ``jobs/``, e.g. ``slurm/train.sbatch``."""
    _check_choice(scheduler, template)
    return TEMPLATES[(scheduler, template)]


def render(scheduler: str, template: str = "train", settings: JobSettings | None = None) -> str:
    """The job script for ``scheduler``/``template`` with ``settings``; pure."""
    _check_choice(scheduler, template)
    s = _validated((settings or JobSettings()).resolved(template), scheduler, template)
    variables = _variables(scheduler, template, s)
    parts = [
        _header(scheduler, template, s) + "\n" + _doc(scheduler, template, s, variables),
        _PROLOGUE[scheduler].format(ranks=s.nodes * s.tasks_per_node),
        _settings_block(variables),
        _PAYLOAD[template],
    ]
    if template == "train":
        parts.append(_HOROVODRUN_LAUNCH if scheduler == "horovodrun" else _MPIRUN_LAUNCH)
        parts.append(_RUN)
    return "\n\n".join(p.strip("\n") for p in parts) + "\n"


def sync_jobs_dir(jobs_dir: str | Path, *, check: bool = False) -> list[str]:
    """Write every default script under ``jobs_dir``; return the paths that differed.

    With ``check`` nothing is written (a CI check that jobs/ matches the renderer).
    """
    changed = []
    for (scheduler, template), rel in TEMPLATES.items():
        path = Path(jobs_dir) / rel
        text = render(scheduler, template)
        if not path.exists() or path.read_text() != text:
            changed.append(str(path))
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        if not check:
            path.chmod(0o755)
    return changed


# -- validation ------------------------------------------------------------------------------

def _check_choice(scheduler: str, template: str) -> None:
    if scheduler not in SCHEDULERS:
        raise JobTemplateError(f"unknown scheduler {scheduler!r}; choose one of: {', '.join(SCHEDULERS)}")
    if (scheduler, template) not in TEMPLATES:
        have = sorted(t for sch, t in TEMPLATES if sch == scheduler)
        raise JobTemplateError(f"no {template!r} template for {scheduler}; {scheduler} has: {', '.join(have)}")


def _validated(s: JobSettings, scheduler: str, template: str) -> JobSettings:
    for name in ("nodes", "tasks_per_node", "cpus_per_task", "epochs"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise JobTemplateError(f"{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if isinstance(s.gpus_per_node, bool) or not isinstance(s.gpus_per_node, int) or s.gpus_per_node < 0:
        raise JobTemplateError(f"gpus-per-node must be an integer >= 0, got {s.gpus_per_node!r}")
    if not _TIME.match(s.time):
        raise JobTemplateError(f"time must look like HH:MM:SS or D-HH:MM:SS, got {s.time!r}")
    if not _NAME.match(s.job_name):
        raise JobTemplateError(f"job-name must be letters, digits, '.', '_' or '-', got {s.job_name!r}")
    for name in ("partition", "account", "hosts", "dataset", "slowdown", "target_acc", "policies",
                 "venv", "out_dir"):
        value = getattr(s, name)
        if _UNSAFE.search(value):
            raise JobTemplateError(f"{name.replace('_', '-')} must not contain quotes, '$', '`', "
                                   f"'\\', '}}' or newlines, got {value!r}")
    for name in ("partition", "account", "hosts"):
        if " " in getattr(s, name):
            raise JobTemplateError(f"{name} must not contain spaces, got {getattr(s, name)!r}")
    try:
        SyncConfig(policy=s.policy, topology=s.topology or default_topology(s.policy),
                   backend=s.backend, server=s.server).validate()
        if s.slowdown:
            parse_float_list("slowdown", s.slowdown)
        for p in s.policies.split(","):
            if p not in POLICIES:
                raise ConfigError(f"policies: unknown policy {p!r}; choose from: {', '.join(POLICIES)}")
            if template == "compare" and s.topology:  # one topology for every compared policy
                SyncConfig(policy=p, topology=s.topology).validate()
    except ConfigError as e:
        raise JobTemplateError(str(e)) from None
    if s.target_acc:
        try:
            ok = 0.0 < float(s.target_acc) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            raise JobTemplateError(f"target-acc must be a number in (0, 1], got {s.target_acc!r}")
    ranks = s.nodes * s.tasks_per_node
    if template in ("train", "compare") and s.server == "dedicated" and ranks < 2:
        raise JobTemplateError(f"a dedicated server needs at least 2 ranks (server + 1 worker); "
                               f"nodes x tasks-per-node = {ranks}")
    if scheduler == "horovodrun" and s.nodes > 1 and not s.hosts:
        raise JobTemplateError("horovodrun on more than one node needs --hosts "
                               "(e.g. node1:8,node2:8) or a HOSTFILE at run time")
    if s.hosts and scheduler != "horovodrun":
        raise JobTemplateError(f"--hosts is for horovodrun; {scheduler} takes the hosts from its allocation")
    return s


# -- header and documentation ----------------------------------------------------------------

_USAGE = {
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

_SUMMARY = {
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
_NOT_APPLICABLE = {
    "bench-kernels": [
        "Not settings of this script: POLICY, TOPOLOGY, BACKEND, SERVER, EPOCHS, DATASET and",
        "SLOWDOWN (those of the train and compare scripts) do not apply to a kernel",
        "microbenchmark: it runs one process, with no mpirun, no state server, no aggregation",
        "and no model or data set; the kernels are timed on the ZipLine paper's synthetic",
        "iteration timings.",
    ],
}

_LAUNCHER_WORDS = {
    "slurm": ("a Slurm batch job", "mpirun that reads the allocation from Slurm"),
    "pbs": ("a PBS (PBS Pro / OpenPBS) batch job", "mpirun over $PBS_NODEFILE"),
    "horovodrun": ("a horovodrun launch", "horovodrun --mpi (Horovod's launcher, over mpirun)"),
}

_TESTED = {
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


def _header(scheduler: str, template: str, s: JobSettings) -> str:
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


def _doc(scheduler: str, template: str, s: JobSettings, variables) -> str:
    ranks = s.nodes * s.tasks_per_node
    what, launcher = _LAUNCHER_WORDS[scheduler]
    summary = textwrap.wrap(" ".join(_SUMMARY[template]).format(
        what=what, launcher=launcher, ranks=ranks, workers=ranks - 1), width=_WIDTH - 2)
    out = ["#", *("# " + line for line in summary), "#", "# Usage:"]
    out += ["#   " + u for u in _USAGE[(scheduler, template)]]
    out += ["#", "# Settings: environment variables, each read once below as ${NAME:-default}."]
    width = max(len(v[0]) for v in variables)
    for name, _default, doc in variables:
        first, *rest = doc.split("\n")
        out.append(f"#   {name:<{width}}  {first}")
        out += [f"#   {'':<{width}}  {more}" for more in rest]
    if template in _NOT_APPLICABLE:
        out += ["#", *("# " + line for line in _NOT_APPLICABLE[template])]
    out += ["#", *("# " + line for line in _TESTED[(scheduler, template)])]
    return "\n".join(out)


# -- variables -------------------------------------------------------------------------------
# (NAME, default as shell text, documentation).  The documentation states the default in words
# where it is computed at run time.

def _variables(scheduler: str, template: str, s: JobSettings) -> list[tuple[str, str, str]]:
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
    topology_doc = (f"{' | '.join(TOPOLOGIES)} (default: {s.topology})" if s.topology else
                    f"{' | '.join(TOPOLOGIES)} (default: empty, the policy's own: ps for "
                    "asp, ssp, dssp;\nring for the others; --topology is passed only when set)")
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
            ("POLICY", s.policy, f"{' | '.join(POLICIES)} (default: {s.policy})"),
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


def _settings_block(variables) -> str:
    lines = [("# -- settings ").ljust(_WIDTH, "-")]
    for name, default, _doc in variables:
        lines.append(f"{name}=${{{name}:-{default}}}")
    return "\n".join(lines)


# -- prologues: where the job runs -----------------------------------------------------------

_PROLOGUE = {
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

_CHECKS = """
# -- checks, before anything starts ------------------------------------------------------------
die() { echo "error: $*" >&2; exit 2; }
[ -x "$VENV/bin/python" ] ||
  die "VENV=$VENV has no bin/python; set VENV to the environment where mpsync is installed"
"""

_RANK_CHECKS = """case $TOPOLOGY in
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

def _run_shape_flags(array: str) -> str:
    """Shell lines adding the run-length and heterogeneity flags shared by train and compare."""
    return (f'if [ -n "$TIME_BUDGET" ]; then\n  {array}+=(--time-budget "$TIME_BUDGET")\n'
            f'else\n  {array}+=(--epochs "$EPOCHS")\nfi\n'
            f'[ -z "$SLOWDOWN" ] || {array}+=(--slowdown "$SLOWDOWN")\n'
            f'[ -z "$TARGET_ACC" ] || {array}+=(--target-acc "$TARGET_ACC")\n')


_TRAIN_ARGV = """
# -- the command -------------------------------------------------------------------------------
export PYTHONUNBUFFERED=1
train=("$VENV/bin/python" -m mpsync.cli train --policy "$POLICY")
# Empty TOPOLOGY: mpsync train picks the policy's own (ps for asp/ssp/dssp, ring otherwise).
[ -z "$TOPOLOGY" ] || train+=(--topology "$TOPOLOGY")
train+=(--backend "$BACKEND" --server "$SERVER" --dataset "$DATASET" --out "$OUT_DIR")
""" + _run_shape_flags("train") + """[ -z "$SEED" ] || train+=(--seed "$SEED")
read -r -a more <<<"$TRAIN_ARGS"
train+=("${more[@]}")
"""

_RUN = """
# -- run ---------------------------------------------------------------------------------------
echo "mpsync: job $JOB_ID, run folder $OUT_DIR"
echo "mpsync: $(printf '%q ' "${command[@]}")"
[ "$DRY_RUN" != 1 ] || exit 0
mkdir -p -- "$OUT_DIR"
printf '%q ' "${command[@]}" >"$OUT_DIR/command.sh"
echo >>"$OUT_DIR/command.sh"
"${command[@]}"
"""

_PAYLOAD = {
    "train": _CHECKS + _RANK_CHECKS + _TRAIN_ARGV,
    "compare": _CHECKS + _RANK_CHECKS + """
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
""" + _run_shape_flags("compare") + """read -r -a more <<<"$COMPARE_ARGS"
compare+=("${more[@]}")
command=("${compare[@]}")
""" + _RUN,
    "bench-kernels": _CHECKS + """
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
""" + _RUN,
}

_MPIRUN_LAUNCH = """
# Ranks are placed by slot: rank 0 (the dedicated server) is the first task of the first node.
launch=(mpirun -np "$NP" --bind-to none --mca mpi_yield_when_idle 1 --tag-output)
[ "$(id -u)" != 0 ] || launch+=(--allow-run-as-root)  # Open MPI refuses root without it
[ -z "$HOSTFILE" ] || launch+=(--hostfile "$HOSTFILE")
# Open MPI passes no environment to remote nodes unless named with -x (names, not patterns).
for name in PATH LD_LIBRARY_PATH PYTHONPATH OMP_NUM_THREADS PYTHONUNBUFFERED \\
            $(compgen -e | grep -E '^(MPSYNC|HOROVOD|NCCL)_' || true); do
  [ -z "${!name+set}" ] || launch+=(-x "$name")
done
read -r -a more <<<"$MPIRUN_ARGS"
launch+=("${more[@]}")
command=("${launch[@]}" "${train[@]}")
"""

_HOROVODRUN_LAUNCH = """
# horovodrun --mpi: mpsync's state server talks over MPI, so Horovod must start the ranks with
# mpirun (not Gloo).  horovodrun forwards the whole environment (-x for every variable) itself.
launch=("$VENV/bin/horovodrun" --mpi -np "$NP")
if [ -n "$HOSTFILE" ]; then launch+=(--hostfile "$HOSTFILE"); else launch+=(-H "$HOSTS"); fi
launch+=(--mpi-args="--mca mpi_yield_when_idle 1")
read -r -a more <<<"$HOROVODRUN_ARGS"
launch+=("${more[@]}")
command=("${launch[@]}" "${train[@]}")
"""

# -- command line ------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    sub.add_parser("list", help="the available scheduler/template pairs")
    r = sub.add_parser("render", help="print a job script for your settings")
    r.add_argument("--scheduler", required=True, choices=SCHEDULERS)
    r.add_argument("--template", default="train", help="train | compare | bench-kernels (default train)")
    r.add_argument("-o", "--output", help="write to this file (executable) instead of stdout")
    d = JobSettings()
    alloc = r.add_argument_group("allocation")
    alloc.add_argument("--nodes", type=int, default=d.nodes)
    alloc.add_argument("--tasks-per-node", type=int, default=None,
                       help="MPI ranks per node (default: 5 for train/compare = 4 workers + "
                            "server; 1 for bench-kernels)")
    alloc.add_argument("--cpus-per-task", type=int, default=d.cpus_per_task)
    alloc.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    alloc.add_argument("--time", default=None, help="wall time [D-]HH:MM:SS")
    alloc.add_argument("--job-name", default=None)
    alloc.add_argument("--partition", default="", help="Slurm partition / PBS queue")
    alloc.add_argument("--account", default="")
    alloc.add_argument("--hosts", default="", help="horovodrun: host1:K,host2:K")
    run = r.add_argument_group("run (defaults of the script's settings)")
    run.add_argument("--policy", default=d.policy)
    run.add_argument("--topology", default=d.topology)
    run.add_argument("--backend", default=d.backend)
    run.add_argument("--server", default=d.server)
    run.add_argument("--epochs", type=int, default=d.epochs)
    run.add_argument("--dataset", default=d.dataset)
    run.add_argument("--slowdown", default=d.slowdown)
    run.add_argument("--target-acc", default=d.target_acc)
    run.add_argument("--policies", default=d.policies, help="compare: policies to run")
    run.add_argument("--venv", default=d.venv, help="default: <repository>/.venv")
    run.add_argument("--out-dir", default=d.out_dir, help="default: beside the job's log")
    s = sub.add_parser("sync", help="rewrite jobs/ from the defaults (maintainers)")
    s.add_argument("--jobs-dir", default=str(Path(__file__).resolve().parent.parent / "jobs"))
    s.add_argument("--check", action="store_true", help="only report files that differ (exit 1)")


def main(args: argparse.Namespace) -> int:
    if args.jobs_command == "list":
        for (scheduler, template), rel in TEMPLATES.items():
            print(f"{scheduler:<11} {template:<14} jobs/{rel}")
        return 0
    if args.jobs_command == "sync":
        changed = sync_jobs_dir(args.jobs_dir, check=args.check)
        for path in changed:
            print(("differs: " if args.check else "wrote: ") + path)
        return 1 if (args.check and changed) else 0
    fields = {f.name for f in dataclasses.fields(JobSettings)}
    settings = JobSettings(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        text = render(args.scheduler, args.template, settings)
    except JobTemplateError as e:
        print(f"mpsync jobs render: {e}", file=sys.stderr)
        return 2
    if args.output:
        out = Path(args.output)
        out.write_text(text)
        out.chmod(0o755)
    else:
        sys.stdout.write(text)
    return 0
