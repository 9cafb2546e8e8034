"""A multi-node Slurm on the virtual cluster (``mpsync cluster slurm up|status|env|down``).

    mpsync cluster up --nodes 2 --bandwidth 1gbit
    mpsync cluster slurm up                  # prints export SLURM_CONF=...
    sbatch -N 2 jobs/slurm/train.sbatch
    mpsync cluster down                      # stops this Slurm too

slurmctld runs on the login node (the host, which holds an address on the cluster's switch);
one slurmd runs inside each node's network namespace under that node's hostname, so a job
allocated two nodes has its batch script and its ``srun`` steps on two network stacks, and
``mpirun`` inside the job launches its daemons through ``srun`` exactly as on a real cluster.

Why the slurmds are started with ``nsenter --net=/var/run/netns/NODE unshare --uts`` and not
``ip netns exec``: the latter remounts /sys for the namespace, the cgroup mounts of the host
vanish from the daemon's view and slurmd refuses to start ("Unable to initialize cgroup
plugin"); ``nsenter --net`` switches only the network stack, ``unshare --uts`` only the
hostname.

Everything lives in one private directory (default /var/lib/mpsync-slurm-cluster/<cluster>):
its own slurm.conf (clients find it through ``SLURM_CONF``), munge key and socket, state, one
spool folder per node, logs and pid files, on ports apart from Slurm's defaults and from the
single-node test cluster of ``.ci/slurm.sh`` (which stays the way to run the job templates on a
machine without network namespaces).  ``down`` cancels the cluster's jobs, stops the daemons it
started (by the pids in its pid files) and removes the directory; a system Slurm or munge is
never touched.

The configuration is pure (:func:`slurm_conf`) and unit-tested; :func:`start` and :func:`stop`
run the daemons.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mpsync import cluster

__all__ = ["SlurmNode", "slurm_conf", "slurmd_argv", "start", "stop", "status", "client_env",
           "SlurmError", "DEFAULT_DIR", "nodes_from_cluster", "directory_of", "stop_for",
           "add_arguments", "main"]

DEFAULT_DIR = Path("/var/lib/mpsync-slurm-cluster")
# Apart from Slurm's defaults (6817/6818) and from .ci/slurm.sh's single-node cluster (16817/8):
# both clusters may run at once on one machine.
CTLD_PORT = 16837
SLURMD_PORT = 16838
# Slurm rejects --ntasks-per-node above a node's CPU count even with --overcommit; the job
# templates ask for 5 tasks per node.  Every node shares the host's cores, as ranks do.
NODE_CPUS = 8
NODE_MEMORY_MB = 1024
START_TIMEOUT = 90.0
DAEMONS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SlurmError(RuntimeError):
    """The cluster's Slurm could not be started or stopped; the message says why."""


@dataclass(frozen=True)
class SlurmNode:
    name: str     # Slurm NodeName and the hostname its slurmd runs under
    addr: str     # its address on the cluster's switch
    netns: str    # path of its network namespace, e.g. /var/run/netns/node1


def slurm_conf(*, login_host: str, login_addr: str, nodes: list[SlurmNode], directory: Path,
               ctld_port: int = CTLD_PORT, slurmd_port: int = SLURMD_PORT,
               cpus: int = NODE_CPUS, memory_mb: int = NODE_MEMORY_MB) -> str:
    """The slurm.conf of the virtual cluster (pure).

    ``SlurmctldHost`` is the login node's own hostname (slurmctld checks it against
    ``gethostname``) with its switch address in parentheses, which is where the nodes reach it.
    ``%n`` in the slurmd paths expands to each slurmd's node name, so all slurmds share the
    file.  proctrack/linuxproc and task/none: no cgroups, which this VM cannot give each node.
    """
    if not nodes:
        raise ValueError("slurm_conf: no nodes")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"slurm_conf: node names repeat: {names}")
    d = directory
    lines = [
        "# Written by mpsync cluster slurm: the virtual cluster's Slurm (see mpsync/cluster/slurm.py).",
        "ClusterName=mpsync-cluster",
        f"SlurmctldHost={login_host}({login_addr})",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={d / 'munge' / 'munge.socket.2'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={d / 'log' / 'jobcomp.txt'}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        # Finished jobs stay visible to `scontrol show job` (there is no accounting database).
        "MinJobAge=3600",
        # A node whose link is cut is noticed within a minute, not five.
        "SlurmdTimeout=60",
        f"StateSaveLocation={d / 'state'}",
        f"SlurmdSpoolDir={d / 'spool' / '%n'}",
        f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
    ]
    for n in nodes:
        lines.append(f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} CPUs={cpus} "
                     f"Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 "
                     f"RealMemory={memory_mb} State=UNKNOWN")
    lines.append(f"PartitionName=cluster Nodes={','.join(names)} Default=YES MaxTime=INFINITE "
                 "State=UP OverSubscribe=FORCE:4")
    return "\n".join(lines) + "\n"


def slurmd_argv(node: SlurmNode, conf: Path) -> list[str]:
    """The command that starts ``node``'s slurmd in its namespace under its hostname (pure)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", node.name):
        raise ValueError(f"node name {node.name!r}: letters, digits and '-' only")
    return ["nsenter", f"--net={node.netns}", "unshare", "--uts", "sh", "-c",
            f"hostname {node.name} && exec slurmd -f '{conf}' -N {node.name}"]


def client_env(directory: Path = DEFAULT_DIR, environ=None) -> dict:
    """``environ`` (default os.environ) with SLURM_CONF naming this cluster's configuration."""
    env = dict(os.environ if environ is None else environ)
    env["SLURM_CONF"] = str(Path(directory) / "etc" / "slurm.conf")
    return env


# -- the daemons -------------------------------------------------------------------------------
def _pid(path: Path) -> int | None:
    """The pid in ``path`` if that process is alive."""
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _clean_env() -> dict:
    # The daemons must not inherit the caller's environment (a test runner's SLURM_*, OMPI_*).
    return {"PATH": DAEMONS_PATH, "LANG": "C.UTF-8"}


def _run(argv: list[str], what: str, timeout: float = 30.0) -> None:
    try:
        res = subprocess.run(argv, env=_clean_env(), capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{what} did not start: {e}") from e
    if res.returncode != 0:
        raise SlurmError(f"{what} did not start (exit {res.returncode}): "
                         f"{(res.stderr or res.stdout).strip()[-500:]}")


def _wait_pid(path: Path, what: str, log: Path) -> int:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        pid = _pid(path)
        if pid:
            return pid
        time.sleep(0.1)
    raise SlurmError(f"{what} exited right after starting; see {log}:\n{_tail(log)}")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _check_tools() -> None:
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "munged",
                           "nsenter", "unshare")
               if shutil.which(t, path=DAEMONS_PATH) is None]
    if missing:
        raise SlurmError(f"missing {', '.join(missing)}: install Slurm with "
                         "`bash .ci/slurm.sh install` (Debian's slurm-wlm and munge)")


def _start_munged(d: Path) -> bool:
    pidfile = d / "run" / "munged.pid"
    if _pid(pidfile):
        return False
    key = d / "munge" / "munge.key"
    if not key.exists() or key.stat().st_size == 0:
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    socket = d / "munge" / "munge.socket.2"
    socket.unlink(missing_ok=True)
    # --force: munged refuses to run as root without it.
    _run(["munged", "--force", f"--key-file={key}", f"--socket={socket}",
          f"--pid-file={pidfile}", f"--log-file={d / 'log' / 'munged.log'}",
          f"--seed-file={d / 'munge' / 'munged.seed'}"], "munged")
    _wait_pid(pidfile, "munged", d / "log" / "munged.log")
    return True


def _node_states(d: Path) -> dict[str, str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=client_env(d),
                             capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)


def start(nodes: list[SlurmNode], *, login_host: str, login_addr: str,
          directory: Path = DEFAULT_DIR, ctld_port: int = CTLD_PORT,
          timeout: float = START_TIMEOUT) -> dict:
    """Start munged, slurmctld and one slurmd per node; wait until every node is idle.

    Idempotent: daemons already running with the same configuration are left alone (a changed
    configuration restarts them).  ``ctld_port``: slurmctld's port on the login node (the
    slurmds listen in their own namespaces and never clash).  Returns ``{"conf": path, "started": [daemons]}``.  On any
    failure everything this call started is stopped again before the error is raised.
    """
    if os.geteuid() != 0:
        raise SlurmError("the cluster's Slurm needs root (slurmd enters the node namespaces)")
    _check_tools()
    d = Path(directory)
    for sub in ("etc", "state", "log", "run", "munge"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "munge").chmod(0o700)
    for n in nodes:
        (d / "spool" / n.name).mkdir(parents=True, exist_ok=True)
        if not Path(n.netns).exists():
            raise SlurmError(f"node {n.name}: no network namespace at {n.netns} "
                             "(is the cluster up? `mpsync cluster up`)")
    conf = d / "etc" / "slurm.conf"
    text = slurm_conf(login_host=login_host, login_addr=login_addr, nodes=nodes, directory=d,
                      ctld_port=ctld_port)
    if conf.exists() and conf.read_text() != text:
        _stop_daemons(d)  # a different cluster: its daemons go, munged stays
    conf.write_text(text)
    started: list[str] = []
    try:
        if _start_munged(d):
            started.append("munged")
        if not _pid(d / "run" / "slurmctld.pid"):
            _run(["slurmctld", "-f", str(conf)], "slurmctld")
            _wait_pid(d / "run" / "slurmctld.pid", "slurmctld", d / "log" / "slurmctld.log")
            started.append("slurmctld")
        for n in nodes:
            pidfile = d / "run" / f"slurmd-{n.name}.pid"
            if _pid(pidfile):
                continue
            _run(slurmd_argv(n, conf), f"slurmd of {n.name}")
            _wait_pid(pidfile, f"slurmd of {n.name}", d / "log" / f"slurmd-{n.name}.log")
            started.append(f"slurmd-{n.name}")
        _wait_idle(d, [n.name for n in nodes], timeout)
    except BaseException:
        stop(d, remove=False)
        raise
    return {"conf": str(conf), "started": started}


def _wait_idle(d: Path, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = _node_states(d)
        if states and all(states.get(n, "").rstrip("*") in ("idle", "mixed", "allocated")
                          for n in names):
            return
        down = [n for n in names if states.get(n, "").startswith(("down", "drain"))]
        if down:  # a node left down by an earlier run comes back once its slurmd answers
            subprocess.run(["scontrol", "update", f"nodename={','.join(down)}", "state=resume"],
                           env=client_env(d), capture_output=True, timeout=15)
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name} ---\n{_tail(p)}" for p in sorted((d / "log").glob("*.log")))
    raise SlurmError(f"nodes not idle after {timeout:.0f} s: {states or 'sinfo answered nothing'}"
                     f"\n{logs}")


def _stop_pid(pidfile: Path, grace: float = 10.0) -> None:
    pid = _pid(pidfile)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _pid(pidfile) == pid:
            time.sleep(0.1)
        if _pid(pidfile) == pid:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
    pidfile.unlink(missing_ok=True)


def _stop_daemons(d: Path) -> None:
    for pidfile in sorted((d / "run").glob("slurmd-*.pid")):
        _stop_pid(pidfile)
    _stop_pid(d / "run" / "slurmctld.pid")


def _cancel_jobs(d: Path, timeout: float = 30.0) -> None:
    """scancel every job of this cluster and wait for them to leave their nodes, so that no
    job step (slurmstepd and the ranks under it) outlives the slurmds."""
    if not _pid(d / "run" / "slurmctld.pid"):
        return
    env = client_env(d)
    subprocess.run(["scancel", "--full", "--quiet", "--state=PENDING,RUNNING,SUSPENDED"],
                   env=env, capture_output=True, timeout=15)
    subprocess.run(["scancel", "--full", "--quiet"], env=env, capture_output=True, timeout=15)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True,
                             text=True, timeout=15).stdout
        if not out.strip():
            return
        time.sleep(0.5)


def stop(directory: Path = DEFAULT_DIR, *, remove: bool = True) -> None:
    """Cancel the cluster's jobs, stop its slurmds, slurmctld and munged; with ``remove``
    delete its directory (configuration, state, logs).  Safe to call when nothing runs."""
    d = Path(directory)
    if not d.exists():
        return
    try:
        _cancel_jobs(d)
    except (OSError, subprocess.TimeoutExpired):
        pass  # the daemons are stopped below all the same
    _stop_daemons(d)
    _stop_pid(d / "run" / "munged.pid")
    if remove:
        shutil.rmtree(d, ignore_errors=True)


def status(directory: Path = DEFAULT_DIR) -> dict:
    """Which of the cluster's daemons run, and each node's state as slurmctld sees it."""
    d = Path(directory)
    daemons = {"munged": _pid(d / "run" / "munged.pid"),
               "slurmctld": _pid(d / "run" / "slurmctld.pid")}
    for pidfile in sorted((d / "run").glob("slurmd-*.pid")):
        daemons[pidfile.stem] = _pid(pidfile)
    return {"dir": str(d), "conf": str(d / "etc" / "slurm.conf"), "daemons": daemons,
            "nodes": _node_states(d) if daemons["slurmctld"] else {}}


# -- from the virtual cluster's state ------------------------------------------------------------
def nodes_from_cluster(state) -> tuple[list[SlurmNode], str]:
    """The Slurm nodes and the login node's switch address, from ``mpsync.cluster``'s state
    (a ``ClusterState``)."""
    nodes = [SlurmNode(n.name, n.address, f"/run/netns/{n.namespace}") for n in state.nodes]
    return nodes, state.login_address


# -- command line (``mpsync cluster [--name NAME] slurm ACTION``) ------------------------------
def directory_of(cluster_name: str) -> Path:
    """The Slurm directory of the virtual cluster ``cluster_name``."""
    return DEFAULT_DIR / cluster_name


def stop_for(cluster_name: str) -> bool:
    """Stop and remove the Slurm of cluster ``cluster_name`` if it has one (``mpsync cluster
    down`` calls this first: a slurmd would outlive its namespace's removal)."""
    d = directory_of(cluster_name)
    if not d.exists():
        return False
    stop(d)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("slurm_action", choices=("up", "status", "env", "down"),
                   help="up: start Slurm on the running cluster; status; env: print "
                        "`export SLURM_CONF=...`; down: cancel its jobs, stop and remove it")
    p.add_argument("--dir", default=None,
                   help=f"private directory (default {DEFAULT_DIR}/<cluster name>)")
    p.add_argument("--port", type=int, default=CTLD_PORT,
                   help=f"slurmctld's port on this host (default {CTLD_PORT})")
    p.add_argument("--json", action="store_true", help="status as JSON")


def main(args: argparse.Namespace) -> int:
    name = getattr(args, "name", None) or cluster.default_name()
    d = Path(args.dir) if args.dir else directory_of(name)
    action = args.slurm_action
    try:
        if action == "up":
            state = cluster.load_state(name)
            if state is None:
                print(f"mpsync cluster slurm: cluster {name!r} is not up (mpsync cluster up "
                      f"--nodes N)", file=sys.stderr)
                return 1
            nodes, login_addr = nodes_from_cluster(state)
            res = start(nodes, login_host=os.uname().nodename.split(".")[0],
                        login_addr=login_addr, directory=d, ctld_port=args.port)
            print(f"Slurm on {', '.join(n.name for n in nodes)} "
                  f"(started: {', '.join(res['started']) or 'nothing, all running'})")
            print(f"export SLURM_CONF={res['conf']}")
        elif action == "down":
            stop(d)
            print(f"Slurm of cluster {name} stopped; {d} removed")
        elif action == "env":
            print(f"export SLURM_CONF={d / 'etc' / 'slurm.conf'}")
        else:
            st = status(d)
            if args.json:
                print(json.dumps(st))
            else:
                for daemon, pid in st["daemons"].items():
                    print(f"{daemon}: {'running (pid %d)' % pid if pid else 'stopped'}")
                for node, node_state in st["nodes"].items():
                    print(f"{node}: {node_state}")
            return 0 if st["daemons"]["slurmctld"] else 1
    except SlurmError as e:
        print(f"mpsync cluster slurm: {e}", file=sys.stderr)
        return 1
    return 0
