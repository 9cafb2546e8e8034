#!/bin/bash
#
# mpsync train as a horovodrun launch: every task is one MPI rank, all started by one horovodrun
# --mpi (Horovod's launcher, over mpirun); with SERVER=dedicated rank 0 is the state server and
# the other ranks train (5 ranks = 4 workers + server by default).
#
# Usage:
#   bash jobs/horovodrun/train.sh                       # 5 ranks on this machine
#   NP=9 HOSTS=node1:5,node2:4 POLICY=esync bash jobs/horovodrun/train.sh
#   NP=16 HOSTFILE=hosts.txt bash jobs/horovodrun/train.sh   # lines: node1 slots=8
#
# Settings: environment variables, each read once below as ${NAME:-default}.
#   POLICY             bsp | asp | ssp | dssp | ebsp | esync | osp | auto (default: bsp)
#   TOPOLOGY           ring | ps (default: empty, the policy's own: ps for asp, ssp, dssp;
#                      ring for the others; --topology is passed only when set)
#   BACKEND            mpi | horovod | gloo | nccl (default: mpi)
#   SERVER             dedicated | colocated (default: dedicated): dedicated = rank 0 serves,
#                      the rest train; colocated = a server thread on rank 0, every rank trains
#   EPOCHS             epochs per worker (default: 5); ignored if TIME_BUDGET is set
#   TIME_BUDGET        seconds of training instead of EPOCHS (default: empty)
#   DATASET            digits | synthetic | npz:PATH (default: digits)
#   SLOWDOWN           per-worker slowdown factors, e.g. 1,1,2,4 (default: empty, none)
#   TARGET_ACC         accuracy for the time-to-accuracy report (default: empty, none)
#   SEED               random seed (default: empty, mpsync train's own)
#   TRAIN_ARGS         more mpsync train flags, e.g. "--staleness 3 --lookahead 15"
#   NP                 MPI ranks (default: 5)
#   HOSTS              host:slots list (default: localhost:NP)
#   HOSTFILE           Horovod hostfile, lines 'host slots=K' (default: empty; used instead of HOSTS)
#   HOROVODRUN_ARGS    more horovodrun options
#   MPSYNC_MPI_TUNING  Open MPI transport settings (mpsync.transport): tuned (default:
#                      btl_tcp_links=2 coll_tuned_use_dynamic_rules=1
#                      coll_tuned_allreduce_algorithm=4), none (Open MPI's defaults), or
#                      name=value,... pairs instead
#   OUT_DIR            the run folder (default: ./mpsync-train-<date-time>)
#   VENV               Python environment with mpsync (default: the repository's .venv)
#   DRY_RUN            1: print the command and exit without running it
#
# Tested: tests/test_jobs.py runs this script on one node (HOSTS=localhost:NP) and
# checks the outputs. Multi-node runs (ssh between hosts) were not tested.

set -euo pipefail

# -- where this runs ---------------------------------------------------------------------------
# Started in place (no scheduler): the repository is two levels above this file.
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)
JOB_ID=$(date +%Y%m%d-%H%M%S)
LOG_DIR=$PWD
TASKS=5
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# -- settings ----------------------------------------------------------------------------------
POLICY=${POLICY:-bsp}
TOPOLOGY=${TOPOLOGY:-}
BACKEND=${BACKEND:-mpi}
SERVER=${SERVER:-dedicated}
EPOCHS=${EPOCHS:-5}
TIME_BUDGET=${TIME_BUDGET:-}
DATASET=${DATASET:-digits}
SLOWDOWN=${SLOWDOWN:-}
TARGET_ACC=${TARGET_ACC:-}
SEED=${SEED:-}
TRAIN_ARGS=${TRAIN_ARGS:-}
NP=${NP:-$TASKS}
HOSTS=${HOSTS:-localhost:$NP}
HOSTFILE=${HOSTFILE:-}
HOROVODRUN_ARGS=${HOROVODRUN_ARGS:-}
MPSYNC_MPI_TUNING=${MPSYNC_MPI_TUNING:-tuned}
OUT_DIR=${OUT_DIR:-$LOG_DIR/mpsync-train-$JOB_ID}
VENV=${VENV:-$REPO/.venv}
DRY_RUN=${DRY_RUN:-0}

# -- checks, before anything starts ------------------------------------------------------------
die() { echo "error: $*" >&2; exit 2; }
[ -x "$VENV/bin/python" ] ||
  die "VENV=$VENV has no bin/python; set VENV to the environment where mpsync is installed"
case $TOPOLOGY in
  ''|ring|ps) ;;
  *) die "TOPOLOGY must be ring, ps or empty (the policy's own), got '$TOPOLOGY'" ;;
esac
[[ $NP =~ ^[0-9]+$ ]] && ((NP >= 1)) || die "NP must be a positive integer, got '$NP'"
case $SERVER in
  dedicated) ((NP >= 2)) || die "SERVER=dedicated needs 2 ranks or more (server + workers), NP=$NP" ;;
  colocated) ;;
  *) die "SERVER must be dedicated or colocated, got '$SERVER'" ;;
esac
export MPSYNC_MPI_TUNING
tuning_text=$("$VENV/bin/python" -m mpsync.transport "$MPSYNC_MPI_TUNING") || exit 2
read -r -a tuning <<<"$tuning_text"

# -- the command -------------------------------------------------------------------------------
export PYTHONUNBUFFERED=1
train=("$VENV/bin/python" -m mpsync.cli train --policy "$POLICY")
# Empty TOPOLOGY: mpsync train picks the policy's own (ps for asp/ssp/dssp, ring otherwise).
[ -z "$TOPOLOGY" ] || train+=(--topology "$TOPOLOGY")
train+=(--backend "$BACKEND" --server "$SERVER" --dataset "$DATASET" --out "$OUT_DIR")
if [ -n "$TIME_BUDGET" ]; then
  train+=(--time-budget "$TIME_BUDGET")
else
  train+=(--epochs "$EPOCHS")
fi
[ -z "$SLOWDOWN" ] || train+=(--slowdown "$SLOWDOWN")
[ -z "$TARGET_ACC" ] || train+=(--target-acc "$TARGET_ACC")
[ -z "$SEED" ] || train+=(--seed "$SEED")
read -r -a more <<<"$TRAIN_ARGS"
train+=("${more[@]}")

# horovodrun --mpi: mpsync's state server talks over MPI, so Horovod must start the ranks with
# mpirun (not Gloo).  horovodrun forwards the whole environment (-x for every variable) itself.
launch=("$VENV/bin/horovodrun" --mpi -np "$NP")
if [ -n "$HOSTFILE" ]; then launch+=(--hostfile "$HOSTFILE"); else launch+=(-H "$HOSTS"); fi
launch+=(--mpi-args="--mca mpi_yield_when_idle 1 ${tuning[*]}")
read -r -a more <<<"$HOROVODRUN_ARGS"
launch+=("${more[@]}")
command=("${launch[@]}" "${train[@]}")

# -- run ---------------------------------------------------------------------------------------
echo "mpsync: job $JOB_ID, run folder $OUT_DIR"
echo "mpsync: $(printf '%q ' "${command[@]}")"
[ "$DRY_RUN" != 1 ] || exit 0
mkdir -p -- "$OUT_DIR"
printf '%q ' "${command[@]}" >"$OUT_DIR/command.sh"
echo >>"$OUT_DIR/command.sh"
"${command[@]}"
