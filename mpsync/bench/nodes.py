"""The benchmarks across the nodes of a virtual cluster (``--cluster`` on ``bench allreduce``
and ``bench server``).

``mpsync bench allreduce --cluster`` runs, for each link rate and each node count, one rank per
node:

1. the ring job of ``bench allreduce`` (mpsync's BSP path vs raw ``hvd.allreduce`` vs raw
   mpi4py ``Allreduce``, interleaved, in one ``mpirun``), as on one host;
2. a link probe (:func:`_probe_child`): raw ``Allreduce`` beside a ring shift (every rank
   sends the whole buffer to its right neighbour while receiving from its left, i.e. every
   link carries the buffer once in each direction: what the links give MPI, the ceiling of any
   allreduce), once with Open MPI's defaults and once per variant of ``--probe-variants``
   (e.g. two TCP connections per peer pair, the ring algorithm forced), each its own
   ``mpirun``.

Bus bandwidth is the NCCL-tests convention for a ring allreduce: ``busbw = algbw * 2(n-1)/n``
with ``algbw = bytes / time``: every link must carry 2(n-1)/n of the buffer each way, so busbw
equals the link rate when the links are the only limit, whatever n.  ``link_fraction`` is
busbw over the configured rate.

The cluster is the one named by ``--cluster NAME`` (default ``$MPSYNC_CLUSTER`` or ``mpsync``):
made here with the most nodes asked for and removed at the end, or, when one of that name is
already up with enough nodes, used as it is and left up (its link rates are changed for the
sweep and restored).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time

from mpsync import cluster
from mpsync.bench._timing import byte_sizes, report_json, timed
from mpsync.cluster.layout import parse_rate
from mpsync.launch import forwarded_env, launch_argv, python_argv, run_with_deadline

__all__ = ["bus_bandwidth", "derive_row", "check_targets", "link_fraction", "cluster_at_rate",
           "run_allreduce", "cluster_argv", "PROBE_VARIANTS", "add_cluster_arguments", "parse_list",
           "run_job", "set_rate"]

KB, MB = 1 << 10, 1 << 20
CLUSTER_SIZES = (256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB)
# Open MPI settings the link probe compares with the defaults.
PROBE_VARIANTS = {
    # Two TCP connections per pair of ranks, messages striped over both.
    "links2": ("--mca", "btl_tcp_links", "2"),
    # The ring allreduce (tuned's algorithm 4) instead of the size-based default choice.
    "ring": ("--mca", "coll_tuned_use_dynamic_rules", "1",
             "--mca", "coll_tuned_allreduce_algorithm", "4"),
    "links2+ring": ("--mca", "btl_tcp_links", "2", "--mca", "coll_tuned_use_dynamic_rules", "1",
                    "--mca", "coll_tuned_allreduce_algorithm", "4"),
}


def bus_bandwidth(nbytes: int, seconds: float, n: int) -> float:
    """Bytes per second each link carries in each direction during a ring allreduce of
    ``nbytes`` over ``n`` ranks that took ``seconds``."""
    if n < 2:
        raise ValueError(f"bus bandwidth needs at least 2 ranks, got {n}")
    return nbytes / seconds * 2 * (n - 1) / n


def link_fraction(nbytes: int, seconds: float, n: int, rate_bits: int) -> float:
    """Bus bandwidth over the link rate (bits per second)."""
    return bus_bandwidth(nbytes, seconds, n) * 8 / rate_bits


def add_cluster_arguments(p: argparse.ArgumentParser, *, rates: str, nodes: str) -> None:
    p.add_argument("--cluster", nargs="?", const="", default=None, metavar="NAME",
                   help="run across the nodes of the virtual cluster NAME (default "
                        "$MPSYNC_CLUSTER or mpsync): used as it is when up (its link rates "
                        "are set for the run and restored), else made and removed after")
    p.add_argument("--cluster-rates", default=rates,
                   help=f"with --cluster: link rates to sweep (default {rates})")
    p.add_argument("--cluster-nodes", default=nodes,
                   help=f"with --cluster: node counts to sweep (default {nodes})")


def parse_list(text: str, what: str) -> list[str]:
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise SystemExit(f"--cluster-{what}: empty list")
    return items


@contextlib.contextmanager
def cluster_at_rate(nodes: int, rate: str, name: str | None):
    """The cluster ``name`` with at least ``nodes`` nodes at ``rate``; yields its state.

    Made here (and removed on exit, also on error) unless already up, in which case its
    nodes' rates are set to ``rate`` and restored on exit.
    """
    name = name or cluster.default_name()
    ok, why = cluster.available()
    if not ok:
        raise SystemExit(f"--cluster: network namespaces unavailable: {why}")
    state = cluster.load_state(name)
    created = state is None
    saved = {}
    if created:
        state, _ = cluster.up(nodes, bandwidth=rate, name=name)
    elif len(state.nodes) < nodes:
        raise SystemExit(f"--cluster: cluster {name!r} is up with {len(state.nodes)} nodes, "
                         f"{nodes} needed (mpsync cluster down --name {name}, or another "
                         f"--cluster-name)")
    else:
        saved = {n.name: state.rate_of(n.name) for n in state.nodes}
    # A SIGTERM (a batch system's or a user's kill) must still remove what was made here.
    previous = _raise_on_sigterm()
    try:
        set_rate(name, rate)
        yield cluster.load_state(name)
    finally:
        _restore_sigterm(previous)
        if created:
            cluster.down(name)
        else:
            for node, old in saved.items():
                cluster.set_link(node, bandwidth=old, unlimited=old is None, name=name)


def _raise_on_sigterm():
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def set_rate(name: str | None, rate: str | None) -> None:
    """Every node's link of cluster ``name`` at ``rate`` (None: unlimited)."""
    for n in cluster.load_state(name).nodes:
        if cluster.load_state(name).rate_of(n.name) != rate:
            cluster.set_link(n.name, bandwidth=rate, unlimited=rate is None, name=name)


def cluster_argv(n: int, command: list[str], name: str | None, *, server_alone: bool = False,
                 extra: tuple = (), tuning: str = "none") -> list[str]:
    """``mpirun`` of ``command`` on ``n`` ranks over the nodes of cluster ``name`` (rank i on
    node i+1 unless ``server_alone``: rank 0 alone on node1).  ``tuning``: the transport
    settings (``mpsync.transport`` spec); Open MPI's defaults unless given, because the sweep
    adds each variant's options itself (Open MPI refuses a parameter given twice)."""
    return launch_argv(n, command, cluster=name or "", forward_env=forwarded_env(), extra=extra,
                       placement="server-alone" if server_alone else "round-robin",
                       tuning=tuning)


def run_job(argv: list[str], timeout: float, what: str) -> list[dict]:
    res = run_with_deadline(argv, timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-3000:] + res.stderr[-3000:])
        raise SystemExit(f"bench allreduce --cluster ({what}) failed: "
                         f"{'timeout' if res.timed_out else f'exit {res.returncode}'}")
    return [json.loads(line[4:]) for line in res.stdout.splitlines() if line.startswith("ROW ")]


def run_allreduce(args: argparse.Namespace) -> int:
    rates = parse_list(args.cluster_rates, "rates")
    counts = sorted({int(x) for x in parse_list(args.cluster_nodes, "nodes")})
    if counts[0] < 2:
        raise SystemExit(f"--cluster-nodes: at least 2 nodes per run, got {counts}")
    for r in rates:
        parse_rate(r)
    sizes = byte_sizes(args.sizes, CLUSTER_SIZES)
    common = ["--sizes", ",".join(map(str, sizes)), "--max-repeats", str(args.max_repeats),
              "--seconds-per-point", str(args.seconds_per_point)]
    variants = [v for v in parse_list(args.probe_variants, "variants")] \
        if args.probe_variants else []
    unknown = [v for v in variants if v not in PROBE_VARIANTS]
    if unknown:
        raise SystemExit(f"--probe-variants: unknown {unknown}; choose from "
                         f"{', '.join(PROBE_VARIANTS)}")
    job_variants = parse_list(args.job_variants, "variants") if args.job_variants else []
    unknown = [v for v in job_variants if v not in PROBE_VARIANTS]
    if unknown:
        raise SystemExit(f"--job-variants: unknown {unknown}; choose from "
                         f"{', '.join(PROBE_VARIANTS)}")
    results = []
    started = time.time()
    with cluster_at_rate(max(counts), rates[0], args.cluster) as state:
        for rate in rates:
            set_rate(args.cluster, rate)
            for n in counts:
                print(f"[cluster {state.name}] {n} nodes at {rate}: ring job",
                      file=sys.stderr, flush=True)
                rows = {s: {"bytes": s} for s in sizes}
                for variant in ["defaults"] + job_variants:
                    if variant != "defaults":
                        print(f"[cluster {state.name}] {n} nodes at {rate}: ring job "
                              f"({variant})", file=sys.stderr, flush=True)
                    suffix = "" if variant == "defaults" else f"_{variant}"
                    for row in run_job(cluster_argv(n, python_argv(
                            "mpsync.bench.allreduce", "--child", "ring", *common),
                            args.cluster, extra=PROBE_VARIANTS.get(variant, ())),
                            args.timeout, f"ring {variant}, {n} nodes at {rate}"):
                        rows[row["bytes"]].update({f"{k[:-3]}{suffix}_ms": v
                                                   for k, v in row.items() if k != "bytes"})
                for variant in ["defaults"] + variants:
                    print(f"[cluster {state.name}] {n} nodes at {rate}: link probe "
                          f"({variant})", file=sys.stderr, flush=True)
                    extra = PROBE_VARIANTS.get(variant, ())
                    for row in run_job(cluster_argv(n, python_argv(
                            "mpsync.bench.nodes", "--child", "probe", *common),
                            args.cluster, extra=extra), args.timeout,
                            f"probe {variant}, {n} nodes at {rate}"):
                        suffix = "" if variant == "defaults" else f"_{variant}"
                        rows[row["bytes"]].update({f"{k[:-3]}{suffix}_ms": v
                                                   for k, v in row.items() if k != "bytes"})
                table = [derive_row(rows[s], n, rate, job_variants) for s in sizes]
                results.append({"rate": rate, "nodes": n, "rows": table})
    summary = {"cluster": {"name": state.name, "subnet": state.subnet,
                           "tbf_burst_bytes_at_first_rate": state.burst,
                           "mpirun_options": cluster_options_text(state)},
               "probe_variants": {v: " ".join(PROBE_VARIANTS[v]) for v in variants},
               "job_variants": {v: " ".join(PROBE_VARIANTS[v]) for v in job_variants},
               "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
               "elapsed_s": time.time() - started, "runs": results,
               "targets": check_targets(results)}
    if not report_json(summary, args.out, "cluster.json", args.json):
        for run in results:
            print(f"\n{run['nodes']} nodes, links at {run['rate']}")
            print(format_table(run["rows"], variants, job_variants))
        print("\ntargets:", json.dumps(summary["targets"], indent=1))
    return 0


def cluster_options_text(state) -> str:
    return (f"--mca btl tcp,self --mca btl_tcp_if_include {state.subnet} "
            f"--mca oob_tcp_if_include {state.subnet} (rsh agent of cluster {state.name})")


def derive_row(row: dict, n: int, rate: str, job_variants=()) -> dict:
    """Ratios, bus bandwidths and link fractions of one size's row."""
    bits = parse_rate(rate)
    out = dict(row, nodes=n, rate=rate)
    if row.get("horovod_ms"):
        out["mpsync_vs_horovod"] = row["mpsync_ms"] / row["horovod_ms"]
    for v in job_variants:
        if row.get(f"horovod_{v}_ms"):
            out[f"mpsync_vs_horovod_{v}"] = row[f"mpsync_{v}_ms"] / row[f"horovod_{v}_ms"]
    if row.get("mpi_ms"):
        out["mpsync_mpi_vs_mpi"] = row["mpsync_mpi_ms"] / row["mpi_ms"]
    for key in list(row):
        if key.endswith("_ms") and row[key]:
            method = key[:-3]
            if method.startswith("shift"):
                # A shift moves the buffer once over each link in each direction.
                out[f"{method}_link_fraction"] = row["bytes"] / (row[key] / 1e3) * 8 / bits
            else:
                out[f"{method}_link_fraction"] = link_fraction(row["bytes"], row[key] / 1e3, n,
                                                               bits)
    return out


def check_targets(results: list[dict]) -> dict:
    """The two figures the cluster benchmark is judged by, where they were measured."""
    out = {}
    for run in results:
        key = f"{run['nodes']}nodes_{run['rate']}"
        big = [r["mpsync_vs_horovod"] for r in run["rows"]
               if r["bytes"] >= MB and "mpsync_vs_horovod" in r]
        at64 = next((r for r in run["rows"] if r["bytes"] == 64 * MB), None)
        out[key] = {
            "mpsync_vs_horovod_median_ge_1MB": statistics.median(big) if big else None,
            **{f"mpsync_vs_horovod_{v}_median_ge_1MB": statistics.median(
                [r[f"mpsync_vs_horovod_{v}"] for r in run["rows"]
                 if r["bytes"] >= MB and f"mpsync_vs_horovod_{v}" in r] or [float("nan")])
               for v in variants_of(run)},
            "link_fraction_64MB": None if at64 is None else {
                k[:-len("_link_fraction")]: v for k, v in at64.items()
                if k.endswith("_link_fraction")},
        }
    return out


def variants_of(run: dict) -> list[str]:
    """The ring-job variants measured in ``run`` (from its column names)."""
    keys = set().union(*(r.keys() for r in run["rows"]))
    return sorted(k[len("mpsync_vs_horovod_"):] for k in keys
                  if k.startswith("mpsync_vs_horovod_"))


def format_table(rows: list[dict], variants: list[str], job_variants=()) -> str:
    cols = [("bytes", "bytes", "d"), ("mpsync_ms", "mpsync ms", ".2f"),
            ("horovod_ms", "hvd ms", ".2f"), ("mpsync_vs_horovod", "ratio", ".2f"),
            ("mpi_ms", "mpi4py ms", ".2f"),
            ("mpsync_link_fraction", "mpsync busbw/link", ".2f"),
            ("horovod_link_fraction", "hvd busbw/link", ".2f"),
            ("mpi_link_fraction", "mpi busbw/link", ".2f"),
            ("shift_link_fraction", "shift/link", ".2f"),
            ("ps_alltoall_link_fraction", "PS all-to-all/link", ".2f"),
            ("ps_pairwise_link_fraction", "PS pairwise/link", ".2f")]
    for v in job_variants:
        cols += [(f"mpsync_vs_horovod_{v}", f"ratio {v}", ".2f"),
                 (f"mpsync_{v}_link_fraction", f"mpsync {v}", ".2f"),
                 (f"horovod_{v}_link_fraction", f"hvd {v}", ".2f")]
    for v in variants:
        cols += [(f"probe_mpi_{v}_link_fraction", f"mpi {v}", ".2f"),
                 (f"shift_{v}_link_fraction", f"shift {v}", ".2f"),
                 (f"ps_alltoall_{v}_link_fraction", f"PS all-to-all {v}", ".2f"),
                 (f"ps_pairwise_{v}_link_fraction", f"PS pairwise {v}", ".2f")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |",
             "|" + "---:|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[k], f) if k in r else "" for k, _, f in cols)
                     + " |")
    return "\n".join(lines)


# -- rank side ---------------------------------------------------------------------------------
def _probe_child(sizes, max_repeats, budget) -> None:
    """Raw mpi4py, interleaved, per size: ``Allreduce``; a ring shift (``Sendrecv`` of the
    whole buffer to the right neighbour, from the left one); and the sharded parameter
    server's traffic with one shard per node, without the parameter server: every node sends
    a 1/n slice to each other node and gets one back from each, twice (a push and its pull's
    reply), all at once (``ps_alltoall``) or scheduled pairwise (``ps_pairwise``: in step k a
    node pushes to node i+k and answers node i-k, one flow each way per link).  Both move
    2(n-1)/n of the buffer each way per node, as a ring allreduce does, so their link
    fractions compare with the ring's on the network alone."""
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    for nbytes in sizes:
        arr = np.ones(max(1, nbytes // 4), dtype=np.float32)
        send, recv = np.ones_like(arr), np.empty_like(arr)
        part = max(1, nbytes // n)
        out_slice = np.ones(part, dtype=np.uint8)
        pushes, replies = np.empty((n, part), dtype=np.uint8), np.empty((n, part), dtype=np.uint8)
        peers = [p for p in range(n) if p != rank]

        def alltoall():
            reqs = [world.Irecv(pushes[p], source=p, tag=1) for p in peers]
            reqs += [world.Irecv(replies[p], source=p, tag=2) for p in peers]
            reqs += [world.Isend(out_slice, dest=p, tag=t) for p in peers for t in (1, 2)]
            MPI.Request.Waitall(reqs)

        def pairwise():
            for k in range(1, n):
                to, frm = (rank + k) % n, (rank - k) % n
                MPI.Request.Waitall([
                    world.Irecv(pushes[frm], source=frm, tag=1),
                    world.Irecv(replies[to], source=to, tag=2),
                    world.Isend(out_slice, dest=to, tag=1),
                    world.Isend(out_slice, dest=frm, tag=2)])

        row = timed(world, {
            "probe_mpi_ms": lambda: world.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM),
            "shift_ms": lambda: world.Sendrecv(send, dest=(rank + 1) % n, recvbuf=recv,
                                               source=(rank - 1) % n),
            "ps_alltoall_ms": alltoall,
            "ps_pairwise_ms": pairwise,
        }, max_repeats, budget)
        if rank == 0:
            print("ROW " + json.dumps(dict(row, bytes=nbytes)), flush=True)


if __name__ == "__main__" and "--child" in sys.argv:
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=("probe",))
    p.add_argument("--sizes")
    p.add_argument("--max-repeats", type=int)
    p.add_argument("--seconds-per-point", type=float)
    a = p.parse_args()

    _probe_child(byte_sizes(a.sizes, CLUSTER_SIZES), a.max_repeats, a.seconds_per_point)
