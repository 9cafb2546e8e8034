#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for testing the job templates (root).
#
#   bash .ci/slurm.sh install   # install slurm-wlm + munge only (also used by the virtual
#                               # cluster's multi-node Slurm, mpsync/cluster/slurm.py)
#   bash .ci/slurm.sh start     # install (first time), start munged + slurmctld + slurmd
#   bash .ci/slurm.sh status    # daemons, node state
#   bash .ci/slurm.sh env       # prints `export SLURM_CONF=...` for sbatch/squeue/scontrol
#   bash .ci/slurm.sh stop [munged slurmctld slurmd]   # stop the daemons this script started
#
# `start` is idempotent: it installs slurm-wlm and munge from Debian's packages only when they
# are missing, starts only the daemons that are not already running, and ends when the node is
# idle.  Its last line is `MPSYNC_SLURM_STARTED=<daemons it started, comma-separated>`, so a
# caller (the pytest fixture in tests/test_slurm.py) stops exactly those and leaves a cluster
# that was already up alone.
#
# Everything lives in one private directory ($MPSYNC_SLURM_DIR, default /var/lib/mpsync-slurm):
# its own slurm.conf (clients find it through SLURM_CONF), its own munge key and socket, state,
# spool, logs and pid files, and ports away from Slurm's defaults.  A system Slurm or munge on
# the machine is never reconfigured or stopped.  The configuration is the smallest that runs
# here without cgroups (proctrack/linuxproc, task/none, cons_tres, one partition), plus:
#   - MinJobAge=3600: finished jobs stay visible to `scontrol show job` for an hour; without
#     slurmdbd `sacct` has no data, so the job's final state is read from scontrol and from the
#     jobcomp/filetxt log ($MPSYNC_SLURM_DIR/log/jobcomp.txt).
#   - NodeAddr=127.0.0.1: the machine's hostname need not resolve.
#   - The node advertises max(real CPUs, $MPSYNC_SLURM_CPUS, default 8) CPUs
#     (SlurmdParameters=config_overrides): Slurm rejects --ntasks-per-node above a node's CPU
#     count even with --overcommit, and the job templates ask for 5 tasks per node (4 workers +
#     server).  On a 2-core machine the ranks then share the cores, as in the mpirun tests.
#
# Exit codes: 0 ok, 1 failure (message on stderr), 3 this machine cannot run Slurm (not root and
# Slurm not usable; message says why).
set -euo pipefail
# The daemons live in /usr/sbin, which a non-login PATH (cron, some CI runners) may lack.
export PATH=$PATH:/usr/sbin:/sbin

DIR=${MPSYNC_SLURM_DIR:-/var/lib/mpsync-slurm}
CTLD_PORT=${MPSYNC_SLURMCTLD_PORT:-16817}
SLURMD_PORT=${MPSYNC_SLURMD_PORT:-16818}
START_TIMEOUT=${MPSYNC_SLURM_START_TIMEOUT:-90}
CONF=$DIR/etc/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket.2
NODE=$(hostname -s)

log() { printf '[slurm] %s\n' "$*" >&2; }
die() { printf '[slurm] ERROR: %s\n' "$*" >&2; exit 1; }
cannot() { printf '[slurm] CANNOT RUN SLURM HERE: %s\n' "$*" >&2; exit 3; }

pid_alive() {  # pid_alive PIDFILE: the process named in PIDFILE is running
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

install_packages() {
  local missing=()
  for cmd in slurmctld slurmd sbatch scontrol munged; do
    command -v "$cmd" >/dev/null || missing+=("$cmd")
  done
  ((${#missing[@]})) || return 0
  [ "$(id -u)" = 0 ] || cannot "Slurm is not installed (missing: ${missing[*]}) and installing it needs root"
  command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get to install it"
  log "installing slurm-wlm and munge from Debian's packages (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  # The packages' maintainer scripts try to start their services; we start our own daemons with
  # a private configuration, so keep the package scripts from starting anything.
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && created_policy=1
  fi
  local rc=0
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; } || rc=$?
  ((created_policy)) && rm -f "$policy"
  ((rc == 0)) || die "apt-get install slurm-wlm munge failed (exit $rc)"
  for cmd in slurmctld slurmd sbatch scontrol munged; do
    command -v "$cmd" >/dev/null || die "$cmd not found after installing slurm-wlm and munge"
  done
}

write_config() {
  mkdir -p "$DIR"/{etc,state,spool/slurmd,log,run,munge}
  chmod 700 "$DIR/munge"
  local cpus mem_mb new
  # Not nproc: GNU nproc obeys OMP_NUM_THREADS, which test runners set to 1.
  cpus=$(getconf _NPROCESSORS_ONLN)
  ((cpus >= ${MPSYNC_SLURM_CPUS:-8})) || cpus=${MPSYNC_SLURM_CPUS:-8}
  # Leave 512 MB to the system; slurmd drains a node that reports less than RealMemory.
  mem_mb=$(awk '/MemTotal/ {m = int($2 / 1024) - 512; print (m > 256 ? m : 256)}' /proc/meminfo)
  new=$(cat <<EOF
# Written by .ci/slurm.sh: a single-node test cluster (see the comments there).
ClusterName=mpsync
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=3600
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
)
  if [ "$(cat "$CONF" 2>/dev/null)" != "$new" ]; then
    printf '%s\n' "$new" > "$CONF"
    echo changed
  fi
}

start_munged() {
  if pid_alive "$DIR/run/munged.pid"; then return 1; fi
  local key=$DIR/munge/munge.key
  if [ ! -s "$key" ]; then
    head -c 1024 /dev/urandom > "$key"
    chmod 400 "$key"
  fi
  rm -f "$MUNGE_SOCKET"
  # --force: munged refuses to run as root without it.
  env -i PATH="$PATH" munged --force --key-file="$key" --socket="$MUNGE_SOCKET" \
         --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
         --seed-file="$DIR/munge/munged.seed" \
    || die "munged did not start; see $DIR/log/munged.log"
  local i
  for i in $(seq 50); do
    munge -n --socket="$MUNGE_SOCKET" 2>/dev/null | unmunge --socket="$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  die "munged started but does not answer on $MUNGE_SOCKET; see $DIR/log/munged.log"
}

start_daemon() {  # start_daemon slurmctld|slurmd
  if pid_alive "$DIR/run/$1.pid"; then return 1; fi
  # A clean environment: the daemons must not inherit the caller's (e.g. a test runner's).
  env -i PATH="$PATH" LANG=C.UTF-8 "$1" -f "$CONF" || die "$1 did not start; see $DIR/log/$1.log"
  local i
  for i in $(seq 50); do
    pid_alive "$DIR/run/$1.pid" && return 0
    sleep 0.2
  done
  die "$1 exited right after starting; see $DIR/log/$1.log"
}

stop_daemon() {  # stop_daemon NAME: SIGTERM the pid in our pid file, wait, then SIGKILL
  local pidfile=$DIR/run/$1.pid pid i
  pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; log "stopped $1 (pid $pid)"; return 0; }
    sleep 0.2
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$pidfile"
  log "killed $1 (pid $pid) after 10 s"
}

node_state() {
  SLURM_CONF=$CONF sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -n1
}

wait_idle() {
  local deadline=$((SECONDS + START_TIMEOUT)) state=""
  while ((SECONDS < deadline)); do
    state=$(node_state)
    case "$state" in
      idle|mixed|allocated|completing) return 0 ;;
      down*|drain*|drained*)
        # A node left down by an earlier run (state is saved) comes back once slurmd answers.
        SLURM_CONF=$CONF scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node $NODE not idle after ${START_TIMEOUT}s (state: ${state:-unknown}); see $DIR/log/slurmctld.log and slurmd.log"
}

cmd_start() {
  if [ "$(id -u)" != 0 ]; then
    cannot "starting slurmctld/slurmd needs root (running as uid $(id -u))"
  fi
  install_packages
  local changed started=()
  changed=$(write_config)
  if [ -n "$changed" ] && { pid_alive "$DIR/run/slurmctld.pid" || pid_alive "$DIR/run/slurmd.pid"; }; then
    log "configuration changed: restarting slurmctld and slurmd"
    stop_daemon slurmd
    stop_daemon slurmctld
  fi
  if start_munged; then started+=(munged); log "started munged"; fi
  if start_daemon slurmctld; then started+=(slurmctld); log "started slurmctld"; fi
  if start_daemon slurmd; then started+=(slurmd); log "started slurmd"; fi
  wait_idle
  log "node $NODE is $(node_state); use: export SLURM_CONF=$CONF"
  local IFS=,
  echo "MPSYNC_SLURM_STARTED=${started[*]}"
}

cmd_stop() {
  local names=("$@")
  ((${#names[@]})) || names=(slurmd slurmctld munged)
  local n
  for n in slurmd slurmctld munged; do  # this order: clients of munge first
    case " ${names[*]} " in *" $n "*) stop_daemon "$n" ;; esac
  done
}

cmd_status() {
  local n rc=0
  for n in munged slurmctld slurmd; do
    if pid_alive "$DIR/run/$n.pid"; then echo "$n: running (pid $(cat "$DIR/run/$n.pid"))"
    else echo "$n: stopped"; rc=1; fi
  done
  echo "node $NODE: $(node_state || true)"
  echo "SLURM_CONF=$CONF"
  return $rc
}

case "${1:-}" in
  install)
    [ "$(id -u)" = 0 ] || command -v slurmd >/dev/null || cannot "installing Slurm needs root"
    install_packages ;;
  start) shift; cmd_start "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 install | start | stop [munged slurmctld slurmd] | status | env" >&2; exit 2 ;;
esac
