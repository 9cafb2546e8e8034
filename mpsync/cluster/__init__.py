"""A virtual cluster on one machine: network-namespace nodes joined by rate-limited links.

    mpsync cluster up --nodes 4 --bandwidth 1gbit
    mpirun $(mpsync cluster mpirun-args) -np 5 python train.py
    mpsync cluster link node3 --down          # cut node3's cable (--up restores it)
    mpsync cluster down

Python API (what ``mpsync cluster`` and the launchers use)::

    from mpsync import cluster
    state = cluster.load_state()              # ClusterState or None (not up)
    cluster.status()                          # dict: nodes, addresses, rates, link states
    cluster.launch_options(np=5)              # mpirun options placing 5 ranks on the nodes

Every kernel object is named after the cluster (``NAME-node1``, ``NAME-switch``,
``NAME-login``), so ``down`` removes exactly what ``up`` made.  The state (layout, rates, which
links are cut) lives in ``/run/mpsync-cluster/NAME/state.json`` beside the rsh agent and the
hostfiles; /run is cleared at boot, as are the namespaces.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from mpsync import transport
from mpsync.cluster.layout import (DEFAULT_NAME, ClusterError, ClusterState, Node, agent_script,
                                 choose_subnet, differences, down_commands, hostfile_text,
                                 link_state_commands, mpirun_options, placement, plan,
                                 rate_commands, shell_line, up_commands, validate_name)

__all__ = ["ClusterError", "ClusterState", "Node", "NamespacesUnavailable", "available",
           "default_name", "state_dir", "load_state", "status", "up", "down", "set_link",
           "launch_options", "hosts_option", "shell_env", "RUN_ROOT", "EXIT_UNAVAILABLE"]

RUN_ROOT = Path(os.environ.get("MPSYNC_CLUSTER_DIR", "/run/mpsync-cluster"))
EXIT_UNAVAILABLE = 3
_TOOLS = ("ip", "tc", "nsenter", "unshare")


class NamespacesUnavailable(ClusterError):
    """This machine (or this user) cannot make network namespaces; the message says why."""


def default_name() -> str:
    """``$MPSYNC_CLUSTER`` if set, else ``mpsync``."""
    return os.environ.get("MPSYNC_CLUSTER") or DEFAULT_NAME


def state_dir(name: str | None = None) -> Path:
    return RUN_ROOT / validate_name(name or default_name())


def available() -> tuple[bool, str]:
    """Whether network namespaces can be made here, and if not, why (one line)."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        return False, "network namespaces need root (run as root, e.g. in CI or with sudo)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return False, f"missing tools: {', '.join(missing)} (iproute2, util-linux)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return False, ("this kernel or container does not allow new network namespaces "
                       f"({probe.stderr.strip() or 'unshare --net failed'})")
    return True, ""


def _require_available() -> None:
    ok, why = available()
    if not ok:
        raise NamespacesUnavailable(why)


def load_state(name: str | None = None) -> ClusterState | None:
    """The running cluster's layout (None when it is not up)."""
    path = state_dir(name) / "state.json"
    try:
        return ClusterState.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def _save_state(state: ClusterState) -> None:
    d = Path(state.state_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "state.json.tmp"
    tmp.write_text(json.dumps(state.to_dict(), indent=1) + "\n")
    os.replace(tmp, d / "state.json")


@contextlib.contextmanager
def _locked():
    """One cluster operation at a time on this host (two ``up`` would pick the same subnet)."""
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    with open(RUN_ROOT / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise ClusterError(f"`{shell_line(argv)}` failed: {res.stderr.strip() or res.stdout.strip()}")
    return res


def _json(argv: list[str]):
    res = _run(argv, check=False)
    if res.returncode != 0 or not res.stdout.strip():
        return []
    return json.loads(res.stdout)


def _host_networks() -> list[str]:
    """Destinations of every IPv4 route in every table, and every interface's network."""
    nets = [r.get("dst", "") for r in _json(["ip", "-j", "-4", "route", "show", "table", "all"])]
    for link in _json(["ip", "-j", "-4", "addr"]):
        for a in link.get("addr_info", []):
            nets.append(f"{a['local']}/{a['prefixlen']}")
    return [n for n in nets if n and n != "default"]


def _namespaces() -> set[str]:
    return {ns.get("name") for ns in _json(["ip", "-j", "netns", "list"])}


def _other_subnets(name: str) -> list[str]:
    taken = []
    if RUN_ROOT.is_dir():
        for d in RUN_ROOT.iterdir():
            if d.name != name and (d / "state.json").is_file():
                with contextlib.suppress(ValueError, KeyError, OSError):
                    taken.append(json.loads((d / "state.json").read_text())["subnet"])
    return taken


def _complete(state: ClusterState) -> list[str]:
    """What of ``state`` is missing from the kernel (empty: all there)."""
    have = _namespaces()
    missing = [ns for ns in [state.switch_namespace] + [n.namespace for n in state.nodes]
               if ns not in have]
    if not _json(["ip", "-j", "link", "show", state.login_link]):
        missing.append(state.login_link)
    return missing


def _write_files(state: ClusterState) -> None:
    d = Path(state.state_dir)
    d.mkdir(parents=True, exist_ok=True)
    agent = d / "agent"
    agent.write_text(agent_script(state, python=sys.executable))
    agent.chmod(0o755)
    (d / "bin").mkdir(exist_ok=True)
    ssh = d / "bin" / "ssh"
    if not ssh.is_symlink():
        ssh.unlink(missing_ok=True)
        ssh.symlink_to(agent)
    (d / "hostfile").write_text(hostfile_text(state))


def up(nodes: int, *, bandwidth: str | None = None, slots: int = 2,
       name: str | None = None) -> tuple[ClusterState, list[str]]:
    """Build the cluster, or find it already up with these settings.

    Returns (state, differences): a cluster already up with other settings is left as it is
    and the differences say what was asked that it does not have (the caller reports them).
    A cluster whose state file exists but whose namespaces are gone (partly removed by hand)
    is rebuilt.
    """
    name = validate_name(name or default_name())
    _require_available()
    with _locked():
        current = load_state(name)
        if current is not None:
            wanted = plan(name, nodes, current.subnet, bandwidth=bandwidth, slots=slots,
                          state_dir=current.state_dir)
            diff = differences(current, wanted)
            if diff:
                return current, diff
            if not _complete(current):
                _write_files(current)
                return current, []
            _teardown(current)
        subnet = choose_subnet(_host_networks(), taken=_other_subnets(name))
        state = plan(name, nodes, subnet, bandwidth=bandwidth, slots=slots,
                     state_dir=str(state_dir(name)))
        leftovers = [ns for ns in _namespaces()
                     if ns in {state.switch_namespace} | {n.namespace for n in state.nodes}]
        if leftovers:
            raise ClusterError(f"namespaces {', '.join(sorted(leftovers))} exist but no state "
                               f"file says mpsync made them; remove them (ip netns del) or use "
                               f"another --name")
        try:
            for argv in up_commands(state):
                _run(argv)
            _write_files(state)
            _save_state(state)
        except BaseException:
            _teardown(state)
            raise
        return state, []


def _teardown(state: ClusterState) -> list[str]:
    """Delete every kernel object of ``state`` that exists; returns errors other than
    "not there"."""
    errors = []
    have = _namespaces()
    # Powering the nodes off: whatever still runs on them (ranks and daemons of a job that
    # lost its node) goes with them; a namespace with processes in it outlives its name.
    for ns in [n.namespace for n in state.nodes] + [state.switch_namespace]:
        if ns in have:
            for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
    for argv in down_commands(state):
        if argv[:3] == ["ip", "netns", "del"] and argv[3] not in have:
            continue
        if argv[:3] == ["ip", "link", "del"] and not _json(["ip", "-j", "link", "show", argv[3]]):
            continue
        res = _run(argv, check=False)
        if res.returncode != 0:
            errors.append(f"{shell_line(argv)}: {res.stderr.strip()}")
    shutil.rmtree(state.state_dir, ignore_errors=True)
    return errors


def down(name: str | None = None) -> ClusterState | None:
    """Remove the cluster (namespaces, links, qdiscs, files); None if it was not up."""
    _require_available()
    with _locked():
        state = load_state(name)
        if state is None:
            return None
        errors = _teardown(state)
        if errors:
            raise ClusterError("could not remove everything: " + "; ".join(errors))
        return state


def set_link(node: str, *, up: bool | None = None, bandwidth: str | None = None,
             unlimited: bool = False, name: str | None = None) -> ClusterState:
    """Cut (``up=False``) or restore a node's link, or change its rate (both directions)."""
    _require_available()
    with _locked():
        state = _running(name)
        n = state.node(node)
        if up is not None:
            for argv in link_state_commands(state, n, up):
                _run(argv)
            down_set = set(state.links_down)
            (down_set.discard if up else down_set.add)(n.name)
            state.links_down = sorted(down_set)
        if bandwidth is not None or unlimited:
            rate = None if unlimited else bandwidth
            for argv in rate_commands(state, n, rate):
                _run(argv, check=rate is not None)
            state.link_rates[n.name] = rate
        _save_state(state)
        return state


def _running(name: str | None) -> ClusterState:
    state = load_state(name)
    if state is None:
        raise ClusterError(f"cluster {name or default_name()!r} is not up "
                           f"(mpsync cluster up --nodes N)")
    return state


def _link_info(ns: str, dev: str) -> dict:
    links = _json(["ip", "-n", ns, "-j", "link", "show", dev])
    qdiscs = [q for q in _json(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev])
              if q.get("kind") == "tbf"]
    out = {"exists": bool(links)}
    if links:
        out["state"] = links[0].get("operstate", "UNKNOWN")
        out["admin_up"] = "UP" in links[0].get("flags", [])
    out["tbf_rate_bps"] = qdiscs[0]["options"]["rate"] * 8 if qdiscs and \
        isinstance(qdiscs[0].get("options", {}).get("rate"), int) else None
    if qdiscs and out["tbf_rate_bps"] is None:
        out["tbf"] = qdiscs[0].get("options", {})
    return out


def status(name: str | None = None) -> dict | None:
    """The cluster as saved plus what the kernel says now (None when not up).

    ``nodes[i]["link"]``: the switch port (``admin_up`` false after ``link --down``) and the
    node's ``eth0`` (its operstate), each with its tbf rate in bits per second (None: none).
    """
    state = load_state(name)
    if state is None:
        return None
    have = _namespaces()
    d = state.to_dict()
    for node, info in zip(state.nodes, d["nodes"]):
        present = node.namespace in have and state.switch_namespace in have
        info["present"] = present
        info["rate"] = state.rate_of(node.name)
        info["cut"] = node.name in state.links_down
        if present:
            info["link"] = {"switch_port": _link_info(state.switch_namespace, node.port),
                            "eth0": _link_info(node.namespace, "eth0")}
    d["agent"] = state.agent_path
    d["hostfile"] = f"{state.state_dir}/hostfile"
    return d


def launch_options(np: int | None = None, *, name: str | None = None, server_alone: bool = True,
                   standalone: bool = False, tuning: str | None = None) -> list[str]:
    """``mpirun`` options that run ranks on the cluster's nodes.

    With ``np``: rank 0 alone on node1 (mpsync's dedicated state server), the others round-robin
    over the remaining nodes (``server_alone=False``: all ranks round-robin), through a
    sequential hostfile written for that count.  Without: the per-node hostfile with slots.
    ``standalone`` adds ``--allow-run-as-root --oversubscribe`` for a bare ``mpirun``
    (``mpsync.launch.mpirun_argv`` adds them itself).  The transport settings are
    ``mpsync.transport``'s for ``tuning`` (None: ``$MPSYNC_MPI_TUNING``, else the tuned set).
    """
    mca = transport.mca_argv(tuning)
    state = _running(name)
    d = Path(state.state_dir)
    if np is None:
        return mpirun_options(state, hostfile=str(d / "hostfile"), standalone=standalone,
                              transport=mca)
    ranks = placement(state, np, server_alone=server_alone)
    path = d / f"hostfile-np{np}{'' if server_alone else '-rr'}"
    text = hostfile_text(state, ranks)
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return mpirun_options(state, hostfile=str(path), sequential=True, standalone=standalone,
                          transport=mca)


def hosts_option(name: str | None = None) -> str:
    """``addr:slots,...`` for ``-H`` (horovodrun's form)."""
    state = _running(name)
    return ",".join(f"{n.address}:{n.slots}" for n in state.nodes)


def shell_env(name: str | None = None, tuning: str | None = None) -> dict[str, str]:
    """Environment for launchers that call ``ssh`` and ``mpirun`` themselves (horovodrun): the
    agent first on PATH as ``ssh``, and Open MPI's interface choice and the transport settings
    (``mpsync.transport``, ``tuning`` as there) as MCA variables (given on horovodrun's
    command line they would repeat its own ``--mca`` options)."""
    mca = transport.mca_env(tuning)
    state = _running(name)
    path = os.environ.get("PATH", "/usr/bin:/bin")
    return {"PATH": f"{state.ssh_dir}:{path}", **mca,
            "OMPI_MCA_oob_tcp_if_include": state.subnet,
            "OMPI_MCA_btl_tcp_if_include": state.subnet,
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
