"""The virtual cluster as data: names, addresses, rates and the ``ip``/``tc`` command lines.

Everything here is pure (no root, no subprocess; the only file read is the agent's own source),
so the layout and every command line can be tested on any machine.  ``mpsync.cluster`` runs what these functions build.

Layout of a cluster called NAME with N nodes on subnet S (a /24):

* a switch: network namespace ``NAME-switch`` holding the bridge ``br0``;
* node k: namespace ``NAME-nodek`` with ``eth0`` at S.(10+k), joined to the switch by a veth
  pair whose switch end is ``nodek`` (inside the switch namespace, so names never clash with
  the host's or another cluster's);
* the login node: the host itself, joined to the switch by the veth ``NAME-login`` at S.1,
  where ``mpirun`` (and ``sbatch``) run; its link is never rate-limited (it carries only the
  launcher's control traffic);
* a rate limit: ``tbf`` on both ends of each node's link (the node's ``eth0`` limits what it
  sends, the switch's ``nodek`` what it receives), like a full-duplex port of that speed.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["ClusterError", "Node", "ClusterState", "parse_rate", "format_rate", "tbf_burst",
           "choose_subnet", "plan", "up_commands", "down_commands", "link_state_commands",
           "rate_commands", "agent_script", "hostfile_text", "placement", "mpirun_options",
           "differences", "validate_name", "DEFAULT_NAME", "CANDIDATE_SUBNETS", "MAX_NODES"]

DEFAULT_NAME = "mpsync"
MAX_NODES = 200
# Private /24s tried in order; the first that overlaps no host route or address is used.
CANDIDATE_SUBNETS = tuple(f"10.213.{i}.0/24" for i in range(0, 32)) + \
    tuple(f"172.29.{i}.0/24" for i in range(0, 32))
# tbf's queue in time: packets that would wait longer are dropped.  A switch port buffers a
# few milliseconds; much less makes TCP's bursts lose packets at the limit and never reach the
# rate, much more only adds delay.
TBF_LATENCY = "20ms"


class ClusterError(RuntimeError):
    """A cluster operation cannot be done; the message says what and why."""


@dataclass
class Node:
    name: str            # the node's hostname inside its namespace: node1, node2, ...
    namespace: str       # NAME-node1
    address: str         # its eth0 address on the cluster subnet
    slots: int           # MPI slots offered to a hostfile
    port: str            # the switch-side end of its link (inside the switch namespace)


@dataclass
class ClusterState:
    name: str
    subnet: str                      # e.g. 10.213.0.0/24
    login_address: str               # the host's address on the switch
    login_link: str                  # the host's end of its link to the switch
    switch_namespace: str
    bridge: str
    nodes: list[Node]
    bandwidth: str | None            # per node link, both directions; None: unlimited
    burst: int | None                # tbf burst in bytes (None when unlimited)
    slots: int
    state_dir: str = ""              # where state.json, the hostfile and the agent live
    link_rates: dict = field(default_factory=dict)   # node -> rate set by `link --bandwidth`
    links_down: list = field(default_factory=list)   # nodes cut by `link --down`

    @property
    def agent_path(self) -> str:
        return f"{self.state_dir}/agent"

    @property
    def ssh_dir(self) -> str:
        """A folder holding ``ssh`` (the agent): put it first on PATH for horovodrun."""
        return f"{self.state_dir}/bin"

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if name in (n.name, n.namespace, n.address):
                return n
        raise ClusterError(f"no node {name!r} in cluster {self.name!r}; nodes: "
                           f"{', '.join(n.name for n in self.nodes)}")

    def rate_of(self, node: str) -> str | None:
        return self.link_rates.get(node, self.bandwidth)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterState":
        d = dict(d)
        d["nodes"] = [Node(**n) for n in d["nodes"]]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,8}$")


def validate_name(name: str) -> str:
    """Cluster names prefix kernel objects: short (the host link ``NAME-login`` must fit
    Linux's 15-character interface names), lower-case letters and digits."""
    if not _NAME_RE.match(name or ""):
        raise ClusterError(f"cluster name {name!r}: use 1-9 lower-case letters or digits, "
                           f"starting with a letter")
    return name


_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.I)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 bits per second (tc's units, decimal)."""
    m = _RATE_RE.match(str(text))
    if not m:
        raise ClusterError(f"bandwidth {text!r}: expected a number and a unit, e.g. 100mbit, "
                           f"1gbit, 10gbit (units: bit, kbit, mbit, gbit, tbit)")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if bits < 8_000:
        raise ClusterError(f"bandwidth {text!r}: below 8kbit, nothing would get through")
    return int(bits)


def format_rate(bits: int) -> str:
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= _RATE_UNITS[unit] and bits % _RATE_UNITS[unit] == 0:
            return f"{bits // _RATE_UNITS[unit]}{unit}"
    return f"{bits}bit"


def tbf_burst(rate_bits: int) -> int:
    """The tbf bucket for a rate, in bytes: 2 ms of the rate, at least 128 KiB.

    The bucket must hold the largest packet the link sees: veth passes TSO/GSO segments of up
    to 64 KiB, and a bucket smaller than a segment drops it outright.  It must also cover the
    gap between two dequeues (a timer tick, or a descheduled sender on a loaded host), or the
    link idles while tokens overflow and never reaches its rate.  2 ms at the rate covers both
    from 1gbit up (250 KB at 1gbit); the floor covers slower links.  The price is a burst of
    that size above the rate, 2 ms worth: invisible next to transfers of megabytes.
    """
    return max(128 * 1024, rate_bits // 8 * 2 // 1000)


def _networks(items) -> list:
    nets = []
    for item in items:
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            continue
    return nets


def choose_subnet(host_networks, taken=(), candidates=CANDIDATE_SUBNETS) -> str:
    """The first candidate /24 overlapping none of the host's routes or addresses.

    ``host_networks``: destinations of the host's routes and its interface networks (strings
    like ``192.0.2.0/24``; ``default`` and other non-networks are ignored).  ``taken``: subnets
    of other mpsync clusters on this host (their login link's route is among the host's
    routes anyway).
    """
    used = [n for n in _networks(list(host_networks) + list(taken)) if n.version == 4
            and n.prefixlen > 0]  # a default route (0.0.0.0/0) does not claim addresses
    for cand in candidates:
        net = ipaddress.ip_network(cand)
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise ClusterError("no free private subnet: every candidate overlaps a host route "
                       f"({', '.join(candidates[:3])}, ...)")


def plan(name: str, nodes: int, subnet: str, *, bandwidth: str | None = None, slots: int = 2,
         state_dir: str = "") -> ClusterState:
    """The cluster's layout: names and addresses of every piece (nothing is created)."""
    validate_name(name)
    if not 1 <= nodes <= MAX_NODES:
        raise ClusterError(f"--nodes must be between 1 and {MAX_NODES}, got {nodes}")
    if slots < 1:
        raise ClusterError(f"--slots must be >= 1, got {slots}")
    net = ipaddress.ip_network(subnet)
    if net.prefixlen > 24:
        raise ClusterError(f"subnet {subnet} is too small for {nodes} nodes")
    rate = burst = None
    if bandwidth is not None:
        bits = parse_rate(bandwidth)
        rate, burst = format_rate(bits), tbf_burst(bits)
    base = net.network_address
    return ClusterState(
        name=name, subnet=str(net), login_address=str(base + 1), login_link=f"{name}-login",
        switch_namespace=f"{name}-switch", bridge="br0",
        nodes=[Node(name=f"node{k}", namespace=f"{name}-node{k}", address=str(base + 10 + k),
                    slots=slots, port=f"node{k}") for k in range(1, nodes + 1)],
        bandwidth=rate, burst=burst, slots=slots, state_dir=state_dir)


def _prefix(state: ClusterState) -> int:
    return ipaddress.ip_network(state.subnet).prefixlen


def rate_commands(state: ClusterState, node: Node, rate: str | None) -> list[list[str]]:
    """Set (``replace``) or remove (``rate=None``) the tbf on both ends of ``node``'s link.

    ``tc qdisc del`` of a root qdisc that is not there fails: the caller runs removals with
    errors ignored.
    """
    sw, ns = state.switch_namespace, node.namespace
    if rate is None:
        return [["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"],
                ["tc", "-n", sw, "qdisc", "del", "dev", node.port, "root"]]
    bits = parse_rate(rate)
    tbf = ["tbf", "rate", format_rate(bits), "burst", str(tbf_burst(bits)),
           "latency", TBF_LATENCY]
    return [["tc", "-n", ns, "qdisc", "replace", "dev", "eth0", "root", *tbf],
            ["tc", "-n", sw, "qdisc", "replace", "dev", node.port, "root", *tbf]]


def up_commands(state: ClusterState) -> list[list[str]]:
    """Every command that builds the cluster from nothing, in order."""
    sw, br, plen = state.switch_namespace, state.bridge, _prefix(state)
    cmds = [["ip", "netns", "add", sw],
            ["ip", "-n", sw, "link", "set", "lo", "up"],
            ["ip", "-n", sw, "link", "add", br, "type", "bridge"],
            ["ip", "-n", sw, "link", "set", br, "up"]]
    for n in state.nodes:
        cmds += [["ip", "netns", "add", n.namespace],
                 ["ip", "-n", n.namespace, "link", "set", "lo", "up"],
                 # Created inside the switch with its peer moved into the node at once: no name
                 # ever appears in the host's namespace.
                 ["ip", "-n", sw, "link", "add", n.port, "type", "veth", "peer", "name", "eth0",
                  "netns", n.namespace],
                 ["ip", "-n", sw, "link", "set", n.port, "master", br],
                 ["ip", "-n", sw, "link", "set", n.port, "up"],
                 ["ip", "-n", n.namespace, "addr", "add", f"{n.address}/{plen}", "dev", "eth0"],
                 ["ip", "-n", n.namespace, "link", "set", "eth0", "up"]]
        if state.rate_of(n.name) is not None:
            cmds += rate_commands(state, n, state.rate_of(n.name))
    cmds += [["ip", "link", "add", state.login_link, "type", "veth", "peer", "name", "login",
              "netns", sw],
             ["ip", "-n", sw, "link", "set", "login", "master", br],
             ["ip", "-n", sw, "link", "set", "login", "up"],
             ["ip", "addr", "add", f"{state.login_address}/{plen}", "dev", state.login_link],
             ["ip", "link", "set", state.login_link, "up"]]
    return cmds


def down_commands(state: ClusterState) -> list[list[str]]:
    """Remove what ``up_commands`` made.  Deleting a namespace deletes its links, their veth
    peers and their qdiscs; the host's login link goes with its peer in the switch, and is
    deleted explicitly too in case the switch is already gone."""
    return ([["ip", "link", "del", state.login_link]]
            + [["ip", "netns", "del", n.namespace] for n in state.nodes]
            + [["ip", "netns", "del", state.switch_namespace]])


def link_state_commands(state: ClusterState, node: Node, up: bool) -> list[list[str]]:
    """Cut or restore a node's cable at the switch port (the node sees its carrier go)."""
    return [["ip", "-n", state.switch_namespace, "link", "set", node.port,
             "up" if up else "down"]]


def agent_script(state: ClusterState, python: str = "/usr/bin/python3") -> str:
    """The executable agent (``mpsync/cluster/agent.py``) with this cluster's node table: an
    ``ssh`` look-alike that runs a command on a node (see that module)."""
    table = {}
    for n in state.nodes:
        entry = {"name": n.name, "namespace": n.namespace, "address": n.address}
        for key in (n.address, n.name, n.namespace):
            table[key] = entry
    source = (Path(__file__).with_name("agent.py")).read_text()
    return (f"#!{python} -I\n# Written by `mpsync cluster up` for the cluster {state.name}; removed "
            f"by `mpsync cluster down`.\n" + source +
            f"\n\nNODES = {json.dumps(table, indent=1, sort_keys=True)}\n\n"
            f"if __name__ == \"__main__\":\n"
            f"    sys.exit(main(sys.argv[1:], NODES, {state.name!r}))\n")


def placement(state: ClusterState, np: int, *, server_alone: bool = True) -> list[str]:
    """The node (address) of each rank 0..np-1.

    With ``server_alone`` rank 0 (mpsync's dedicated state server) gets node1 to itself and the
    other ranks go round-robin over node2..nodeN, so every worker's traffic to the server and
    to its ring neighbours crosses a link.  A one-node cluster, or ``server_alone=False``, puts
    rank i on node (i mod N) + 1.
    """
    if np < 1:
        raise ClusterError(f"np must be >= 1, got {np}")
    addrs = [n.address for n in state.nodes]
    if server_alone and len(addrs) > 1:
        rest = addrs[1:]
        return [addrs[0]] + [rest[i % len(rest)] for i in range(np - 1)]
    return [addrs[i % len(addrs)] for i in range(np)]


def hostfile_text(state: ClusterState, ranks: list[str] | None = None) -> str:
    """An Open MPI hostfile: one line per node with its slots, or (``ranks`` given) one line per
    rank for ``--map-by seq`` (rank i on the host of line i)."""
    head = f"# mpsync virtual cluster {state.name}: " + \
        ", ".join(f"{n.name}={n.address}" for n in state.nodes) + "\n"
    if ranks is not None:
        return head + "".join(f"{a}\n" for a in ranks)
    return head + "".join(f"{n.address} slots={n.slots}\n" for n in state.nodes)


def mpirun_options(state: ClusterState, *, hostfile: str, sequential: bool = False,
                   standalone: bool = True, transport=()) -> list[str]:
    """The ``mpirun`` options that place ranks on the cluster's nodes.

    ``hostfile``: a file written from ``hostfile_text``; ``sequential``: it lists one line per
    rank (``--map-by seq``), else one line per node with slots (Open MPI fills each node's
    slots in turn).  ``standalone`` adds what a bare ``mpirun`` needs and mpsync's own launcher
    already passes (``--allow-run-as-root``, ``--oversubscribe``).

    Only TCP between ranks (``btl tcp,self``: ranks on one node talk over its loopback, ranks on
    two nodes over the link), and both Open MPI's runtime (oob) and MPI traffic (btl) are kept on
    the cluster subnet, or they would pick the host's own interface, which namespaces lack.
    ``transport``: the tuning options (``mpsync.transport.mca_argv``), last.
    """
    argv = ["--hostfile", hostfile]
    if sequential:
        argv += ["--map-by", "seq"]
    argv += ["--mca", "plm_rsh_agent", state.agent_path,
             "--mca", "btl", "tcp,self",
             "--mca", "oob_tcp_if_include", state.subnet,
             "--mca", "btl_tcp_if_include", state.subnet]
    if standalone:
        argv += ["--allow-run-as-root", "--oversubscribe"]
    return argv + list(transport)


def differences(current: ClusterState, wanted: ClusterState) -> list[str]:
    """What a second ``up`` asks for that the running cluster does not have (empty: same)."""
    out = []
    if len(current.nodes) != len(wanted.nodes):
        out.append(f"nodes: {len(current.nodes)} running, {len(wanted.nodes)} asked")
    if current.bandwidth != wanted.bandwidth:
        out.append(f"bandwidth: {current.bandwidth or 'unlimited'} running, "
                   f"{wanted.bandwidth or 'unlimited'} asked")
    if current.slots != wanted.slots:
        out.append(f"slots: {current.slots} running, {wanted.slots} asked")
    return out


def shell_line(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
