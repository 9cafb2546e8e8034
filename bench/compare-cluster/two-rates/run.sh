#!/bin/bash
# The policy comparison across nodes at two link rates: every policy, 4 worker nodes + the
# state server's node, the default straggler profile (compare's 1,1,2,4), 2 interleaved
# repeats, 20 s of training each, the wide MLP (8.7 MB of float32 gradients), mpi backend.
# Needs root (network namespaces).  Results: <rate>/compare.json, table.md, one folder per run.
#
#   bash bench/compare-cluster/two-rates/run.sh            # from the repository root
#   RATES=1gbit BUDGET=30 bash bench/compare-cluster/two-rates/run.sh
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/../../.."
PY=${PY:-.venv/bin/python}
NAME=${CLUSTER:-cmp2}
OUT=${OUT:-bench/compare-cluster/two-rates}
RATES=${RATES:-100mbit 1gbit}
BUDGET=${BUDGET:-20}
EXTRA=${EXTRA:-}
up=0
if ! "$PY" -m mpsync.cli cluster --name "$NAME" status >/dev/null 2>&1; then
  "$PY" -m mpsync.cli cluster --name "$NAME" up --nodes 5
  up=1
fi
trap '[ "$up" = 0 ] || "$PY" -m mpsync.cli cluster --name "$NAME" down' EXIT
for rate in $RATES; do
  # One timing benchmark at a time on this machine (others use the same lock).
  flock /tmp/mpsync-bench.lock "$PY" -m mpsync.cli compare --cluster "$NAME" --bandwidth "$rate" \
    --np 4 --repeats 2 --time-budget "$BUDGET" --backend mpi \
    --train-args "--model wide-mlp $EXTRA" --out "$OUT/$rate"
done
