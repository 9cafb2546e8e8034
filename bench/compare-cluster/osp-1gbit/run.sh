#!/bin/bash
# OSP's acceptance run across nodes: BSP and OSP in one comparison, 4 equal workers (100 ms of
# emulated device time per iteration), 40 s each, the wide MLP, 1gbit links, mpi backend.
# Needs root (network namespaces); makes the cluster if it is not up and removes it after.
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/../../.."
PY=${PY:-.venv/bin/python}
NAME=${CLUSTER:-osp}
up=0
if ! "$PY" -m mpsync.cli cluster --name "$NAME" status >/dev/null 2>&1; then
  "$PY" -m mpsync.cli cluster --name "$NAME" up --nodes 5
  up=1
fi
trap '[ "$up" = 0 ] || "$PY" -m mpsync.cli cluster --name "$NAME" down' EXIT
flock /tmp/mpsync-bench.lock "$PY" -m mpsync.cli compare --cluster "$NAME" --bandwidth 1gbit \
  --np 4 --policies bsp,osp --slowdown 1,1,1,1 --iter-time 0.1 --time-budget 40 --backend mpi \
  --train-args "--model wide-mlp" --out bench/compare-cluster/osp-1gbit
