"""``mpsync cluster``: a virtual cluster of network-namespace nodes on this machine.

    mpsync cluster up --nodes 4 [--bandwidth 1gbit] [--slots 2]
    mpsync cluster status [--json]
    mpirun $(mpsync cluster mpirun-args) -np 5 python x.py
    mpsync cluster link node2 --down | --up | --bandwidth 100mbit | --unlimited
    eval "$(mpsync cluster env)"      # for horovodrun: ssh stand-in on PATH, Open MPI settings
    mpsync cluster down

Exit codes: 0 done, 1 failed (the message says why), 2 bad arguments, 3 namespaces are not
available here (not root, or the kernel/container forbids them).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from mpsync import cluster, transport
from mpsync.cluster import slurm
from mpsync.cluster.layout import ClusterError, format_rate, parse_rate, validate_name

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=None,
                   help=f"cluster name, prefix of its namespaces (default $MPSYNC_CLUSTER or "
                        f"{cluster.DEFAULT_NAME})")
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    s = sub.add_parser("up", help="create the nodes, the switch and the links")
    s.add_argument("--nodes", type=int, required=True)
    s.add_argument("--bandwidth", default=None, metavar="RATE",
                   help="rate limit of each node's link, both directions (e.g. 1gbit, "
                        "100mbit; default unlimited)")
    s.add_argument("--slots", type=int, default=2, help="MPI slots per node in the hostfile")
    s = sub.add_parser("status", help="nodes, addresses, link rates and states")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("mpirun-args", help="print mpirun options that place ranks on the nodes")
    s.add_argument("--np", type=int, default=None,
                   help="place exactly NP ranks: rank 0 alone on node1, the rest round-robin "
                        "over the other nodes (default: fill each node's slots in turn)")
    s.add_argument("--round-robin", action="store_true",
                   help="with --np: every rank round-robin over all nodes")
    _add_tuning(s)
    sub.add_parser("hosts", help="print addr:slots,... for -H (horovodrun)")
    _add_tuning(sub.add_parser(
        "env", help="print shell exports for horovodrun (ssh stand-in, MCA settings)"))
    s = sub.add_parser("link", help="cut, restore or re-rate one node's link")
    s.add_argument("node")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--down", action="store_true", help="cut the cable at the switch")
    g.add_argument("--up", action="store_true", help="reconnect it")
    g.add_argument("--bandwidth", default=None, metavar="RATE")
    g.add_argument("--unlimited", action="store_true", help="remove the rate limit")
    sub.add_parser("down", help="remove everything `up` made (and its Slurm, if started)")
    slurm.add_arguments(sub.add_parser(
        "slurm", help="a multi-node Slurm: slurmctld here, one slurmd per node"))


def _add_tuning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mpi-tuning", default=None, metavar="SPEC",
                   help="Open MPI transport settings: tuned (default, or $MPSYNC_MPI_TUNING), "
                        "none (Open MPI's defaults), or name=value,... (see mpsync.transport)")


def main(args) -> int:
    try:
        if args.name is not None:
            validate_name(args.name)
        if getattr(args, "bandwidth", None) is not None:
            parse_rate(args.bandwidth)
        transport.mca_pairs(getattr(args, "mpi_tuning", None))
    except (ClusterError, transport.TransportError) as e:
        print(f"mpsync cluster: error: {e}", file=sys.stderr)
        return 2
    action = args.action
    if action is None:
        print("mpsync cluster: error: choose an action: up, status, mpirun-args, hosts, env, "
              "link, down", file=sys.stderr)
        return 2
    try:
        return _ACTIONS[action](args)
    except cluster.NamespacesUnavailable as e:
        print(f"mpsync cluster: network namespaces unavailable: {e}", file=sys.stderr)
        return cluster.EXIT_UNAVAILABLE
    except ClusterError as e:
        print(f"mpsync cluster: error: {e}", file=sys.stderr)
        return 1


def _up(args) -> int:
    state, diff = cluster.up(args.nodes, bandwidth=args.bandwidth, slots=args.slots,
                             name=args.name)
    if diff:
        print(f"mpsync cluster: {state.name} is already up with other settings "
              f"({'; '.join(diff)}); run `mpsync cluster down` first", file=sys.stderr)
        return 1
    _print_summary(state)
    return 0


def _print_summary(state) -> None:
    rate = state.bandwidth or "unlimited"
    burst = f", tbf burst {state.burst} B" if state.burst else ""
    print(f"cluster {state.name}: {len(state.nodes)} nodes on {state.subnet}, links {rate}"
          f"{burst}; login (this host) {state.login_address} on {state.login_link}")
    for n in state.nodes:
        print(f"  {n.name:8s} {n.address:15s} netns {n.namespace}  slots {n.slots}")


def _status(args) -> int:
    st = cluster.status(args.name)
    if st is None:
        if args.json:
            print("null")
        else:
            print(f"cluster {args.name or cluster.default_name()}: not up")
        return 1
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print(f"cluster {st['name']}: {len(st['nodes'])} nodes on {st['subnet']}; login "
          f"{st['login_address']} ({st['login_link']}); agent {st['agent']}")
    for n in st["nodes"]:
        if not n["present"]:
            print(f"  {n['name']:8s} {n['address']:15s} MISSING (namespace gone)")
            continue
        port, eth0 = n["link"]["switch_port"], n["link"]["eth0"]
        link = "cut" if not port.get("admin_up") else eth0.get("state", "?").lower()
        rates = {port.get("tbf_rate_bps"), eth0.get("tbf_rate_bps")}
        rate = "unlimited" if rates == {None} else \
            "/".join(sorted(format_rate(r) if r else "none" for r in rates))
        print(f"  {n['name']:8s} {n['address']:15s} link {link:5s} rate {rate}")
    return 0


def _mpirun_args(args) -> int:
    opts = cluster.launch_options(args.np, name=args.name, server_alone=not args.round_robin,
                                  standalone=True, tuning=args.mpi_tuning)
    print(" ".join(shlex.quote(o) for o in opts))
    return 0


def _hosts(args) -> int:
    print(cluster.hosts_option(args.name))
    return 0


def _env(args) -> int:
    for k, v in cluster.shell_env(args.name, tuning=args.mpi_tuning).items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


def _link(args) -> int:
    if args.down or args.up:
        state = cluster.set_link(args.node, up=bool(args.up), name=args.name)
        print(f"{state.node(args.node).name}: link {'up' if args.up else 'cut'}")
    else:
        state = cluster.set_link(args.node, bandwidth=args.bandwidth, unlimited=args.unlimited,
                                 name=args.name)
        print(f"{state.node(args.node).name}: rate "
              f"{state.rate_of(state.node(args.node).name) or 'unlimited'}")
    return 0


def _down(args) -> int:
    if slurm.stop_for(args.name or cluster.default_name()):
        print("stopped the cluster's Slurm")
    state = cluster.down(args.name)
    if state is None:
        print(f"cluster {args.name or cluster.default_name()}: not up (nothing to remove)")
    else:
        print(f"cluster {state.name}: removed {len(state.nodes)} nodes, the switch and "
              f"{state.login_link}")
    return 0


def _slurm(args) -> int:
    return slurm.main(args)


_ACTIONS = {"up": _up, "status": _status, "mpirun-args": _mpirun_args, "hosts": _hosts,
            "env": _env, "link": _link, "down": _down, "slurm": _slurm}
