"""The text every job script shares, whatever its launch target: the opening comment, the
settings, their checks and the payload of each template (``train``, ``compare``,
``bench-kernels``).  What only one target knows (its scheduler's header, its prologue, the
lines that start its ranks) is in that target's module.

Pure data and pure functions of :class:`mpsync.launch.settings.JobSettings`;
:func:`mpsync.launch.jobs.render` assembles them.
"""

from __future__ import annotations

import textwrap

from mpsync import policies as registry
from mpsync.config import BACKENDS, SERVER_PLACEMENTS, TOPOLOGIES
from mpsync.launch.settings import JobSettings
from mpsync.launch.target import LaunchTarget, Variable
from mpsync.transport import ENV_VAR as TUNING_VAR
from mpsync.transport import mca_pairs as tuning_pairs

__all__ = ["WIDTH", "header", "doc", "variables", "settings_block", "PAYLOAD", "RUN"]

WIDTH = 96  # comment rule width in the scripts


# -- header and documentation ----------------------------------------------------------------

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

def header(target: LaunchTarget, template: str, s: JobSettings) -> str:
    return "\n".join(["#!/bin/bash", *target.header(template, s)])


def doc(target: LaunchTarget, template: str, s: JobSettings, variables,
        script: str | None = None) -> str:
    """The opening comment; ``script``: what its usage lines call the script (None: its path
    under ``jobs/``, run from the repository root)."""
    ranks = s.nodes * s.tasks_per_node
    what, launcher = target.words
    summary = textwrap.wrap(" ".join(SUMMARY[template]).format(
        what=what, launcher=launcher, ranks=ranks, workers=ranks - 1), width=WIDTH - 2)
    out = ["#", *("# " + line for line in summary), "#", "# Usage:"]
    usage = list(target.usage[template])
    if script is not None:
        default = "jobs/" + target.templates[template]
        usage = [u.replace(default, script).replace("# from the repository root", "").rstrip()
                 for u in usage]
    out += ["#   " + u for u in usage]
    out += ["#", "# Settings: environment variables, each read once below as ${NAME:-default}."]
    width = max(len(v[0]) for v in variables)
    for name, _default, text in variables:
        first, *rest = text.split("\n")
        out.append(f"#   {name:<{width}}  {first}")
        out += [f"#   {'':<{width}}  {more}" for more in rest]
    if template in NOT_APPLICABLE:
        out += ["#", *("# " + line for line in NOT_APPLICABLE[template])]
    out += ["#", *("# " + line for line in target.tested[template])]
    return "\n".join(out)


# -- variables -------------------------------------------------------------------------------
# (NAME, default as shell text, documentation).  The documentation states the default in words
# where it is computed at run time.

def variables(target: LaunchTarget, template: str, s: JobSettings) -> list[Variable]:
    venv = s.venv or "$REPO/.venv"
    venv_doc = (f"Python environment with mpsync (default: {s.venv})" if s.venv else
                "Python environment with mpsync (default: the repository's .venv)")
    out_doc = ("the run folder (default: mpsync-<template>-<job id> next to the job's log)"
               .replace("<template>", template))
    if not target.allocated:
        out_doc = f"the run folder (default: ./mpsync-{template}-<date-time>)"
    out_dir = s.out_dir or f"$LOG_DIR/mpsync-{template}-$JOB_ID"
    if s.out_dir:
        out_doc = f"the run folder (default: {s.out_dir})"
    ranks_doc = ("MPI ranks (default: all tasks of the job)" if target.allocated
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
        if target.allocated:
            variables += [
                ("MAX_RESTARTS", "0", "restarts after a lost rank, on the nodes that remain, "
                                      "from the newest\ncheckpoint (default: 0, a fault ends "
                                      "the job)"),
                ("CHECKPOINT_EVERY", "10", "with MAX_RESTARTS: checkpoint every K rounds "
                                           "(default: 10)"),
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
    variables += target.variables(template, s)
    if template != "bench-kernels":
        pairs = " ".join(f"{k}={v}" for k, v in tuning_pairs("tuned"))
        variables.append((TUNING_VAR, "tuned", "\n".join(textwrap.wrap(
            f"Open MPI transport settings (mpsync.transport): tuned (default: {pairs}), "
            f"none (Open MPI's defaults), or name=value,... pairs instead", width=70))))
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


# -- payloads: what the job does ---------------------------------------------------------------

CHECKS = """
# -- checks, before anything starts ------------------------------------------------------------
die() { echo "error: $*" >&2; exit 2; }
[ -x "$VENV/bin/python" ] ||
  die "VENV=$VENV has no bin/python; set VENV to the environment where mpsync is installed"
"""

# The transport settings as mpirun options, from the one function that decides them (it also
# names a bad MPSYNC_MPI_TUNING); exported, so mpsync compare's own launches use them too.
TUNING = """export """ + TUNING_VAR + """
tuning_text=$("$VENV/bin/python" -m mpsync.transport "$""" + TUNING_VAR + """") || exit 2
read -r -a tuning <<<"$tuning_text"
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
    "train": CHECKS + RANK_CHECKS + TUNING + TRAIN_ARGV,
    "compare": CHECKS + RANK_CHECKS + TUNING + """
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
