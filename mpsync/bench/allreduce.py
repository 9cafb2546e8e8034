"""``mpsync bench allreduce --np N --json``: mpsync's aggregation against raw Horovod and MPI.

Per buffer size (4 KB .. 256 MB of float32), in one ``mpirun`` job, each measured after a
warm-up as the median over repeats of the slowest rank's time (a barrier before each repeat):

* ``mpsync_ms``: BSP's data path with the horovod backend (``average_gradients``: pack the
  gradients of 8 parameter tensors into the fusion buffer, one Horovod allreduce polled with
  the deadline, unpack);
* ``mpsync_mpi_ms``: the same with the mpi backend (``Iallreduce`` polled with the deadline),
  measured with ``mpi_ms`` before Horovod starts;
* ``mpsync_copy_ms``: ``mpsync_ms`` when the gradients are not inside the fusion buffer (a
  script that sets them to None each step): pack and unpack copies included;
* ``horovod_ms``: raw ``hvd.allreduce_`` of one tensor of that size (in place, average);
* ``mpi_ms``: raw mpi4py ``Allreduce`` (blocking, in place) of the same buffer;
* ``mpsync_gloo_ms`` (ranks on one host only): BSP's data path with the gloo backend (a ``torch.distributed`` gloo
  group of the workers, rendezvous over MPI; the allreduce waited for with the deadline);
  ``gloo_ms``: the group's raw ``allreduce`` of one tensor of that size (sum, in place,
  ``wait()``); both measured with ``mpi_ms``, before Horovod starts;
* ``user_ms``: a script's ``mps.allreduce`` of one float32 tensor of that size (named
  negotiation: the request to member 0 and its answer with every worker's record, checked
  for shapes, dtypes and ops, then ``Iallreduce`` of a copy); ``user_unchecked_ms``: the
  same without negotiation; ``check_overhead``: their ratio and ``negotiation_us`` their
  difference (what Horovod-style matching by name and error checking cost per collective);
* ``fused_ms`` / ``unfused_ms`` (sizes up to 4 MB): the size split into 32 named async
  allreduces submitted together, with tensor fusion (one buffer for those ready together)
  and without; ``fusion_gain``: unfused / fused;
* ``server_thread_ms``: ``user_ms`` with member 0's coordinator on a polling thread of its
  own, as it would run inside the co-located state server (the alternative coordinator).

``--fp16`` adds ``Compression.fp16`` columns: ``horovod_fp16_ms`` (Horovod's own
``hvd.allreduce(t, compression=hvd.Compression.fp16)``), ``mpsync_fp16_ms`` (``mps.allreduce``
with ``Compression.fp16``: the script's collectives run on mpi4py whatever the backend), ``mpsync_opt_fp16_ms`` (DistributedOptimizer's
gradient path with ``compression=Compression.fp16``), ``mpsync_mpi_fp16_ms`` (``mps.allreduce``
fp16 on the mpi backend: alltoall + allgather of the halves, next to ``mpi_ms``), and
``fp16_wire_bytes`` / ``fp32_wire_bytes`` (bytes of the tensor handed to the collective).

``--osp`` adds a job timing BSP and OSP steps (half the layers in In-Computation Sync) on an
MLP, raw and over an emulated 2 Gbit/s link (OSP's target: faster when communication shows).

A second job (skip it with ``--no-ps``) with one extra rank as a dedicated state server times
the PS topology's exchange (:mod:`mpsync.bench.ps_exchange`): ``ps_ms`` (``SyncClient.push``
of the delta + ``pull`` of the weights over the shard servers, policy asp, float32) at the same
sizes, next to the ring's ``mpsync_ms`` (ring vs PS); ``ps_shard_ms``, the shard exchange
without the state server's round trips; their baseline ``ps_raw_ms``, a plain mpi4py program
sending the same slices between the same ranks to echo threads (the faster of a blocking
and a polling receiver), taking turns with the PS's calls in the same session
(``ps_vs_raw``, ``ps_shard_vs_raw``); the same after 20 ms of computing, as a trainer does
between exchanges (``*_paced_ms``; ``--pace idle``: of sleeping); and the data bytes
one worker's exchange moved (``ps_wire_bytes``) beside the analytic minima (``ps_min_bytes``,
``ring_min_bytes``).

``--json`` prints only the list of rows, one per size, with the keys above (``ps_ms`` and
``ps_vs_ring`` when the PS job ran; ``np`` and the ratios ``mpsync_vs_horovod``,
``mpsync_mpi_vs_mpi``).  The OSP result is not a row: it goes to ``--out`` (``osp_npN.json``)
and, with ``--json``, to stderr.  Memory per policy is ``mpsync bench memory``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from mpsync import policies as registry
from mpsync.bench._timing import byte_sizes, timed

__all__ = ["add_arguments", "run", "DEFAULT_SIZES"]

KB, MB = 1 << 10, 1 << 20
LINK_BANDWIDTH = 2.5e8  # bytes/s of the emulated link in the OSP comparison (2 Gbit/s)
DEFAULT_SIZES = (4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="worker ranks (default 2)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated buffer sizes in bytes (default 4 KB..256 MB, x4 steps)")
    p.add_argument("--max-repeats", type=int, default=100)
    p.add_argument("--seconds-per-point", type=float, default=2.0,
                   help="stop repeating a measurement after this long (at least 3 repeats)")
    p.add_argument("--ps", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the PS topology's push+pull at the same sizes (ps_ms; on by "
                        "default: ring vs PS at the same sizes; --no-ps skips the extra job)")
    p.add_argument("--pace", choices=("compute", "idle"), default="compute",
                   help="what the PS job's workers do for 20 ms before each *_paced_ms exchange: "
                        "compute on their main thread, as a trainer does (default), or sleep")
    p.add_argument("--fp16", action="store_true",
                   help="also time Compression.fp16 allreduces (mpsync vs Horovod's own)")
    p.add_argument("--osp", action="store_true",
                   help="also time BSP vs OSP steps (half the layers in In-Computation Sync)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list of rows (bytes, mpsync_ms, horovod_ms, mpi_ms, ps_ms "
                        "...) whatever else is measured; --osp's result goes to stderr and --out")
    p.add_argument("--out", default=None,
                   help="write rows_npN.json (and osp_npN.json with --osp) into this dir")
    p.add_argument("--timeout", type=float, default=1800.0)
    from mpsync.bench.nodes import add_cluster_arguments

    # --cluster: one rank per node of a virtual cluster, swept over link rates and node counts
    # (mpsync.bench.nodes); --sizes then defaults to 256 KB..64 MB.
    add_cluster_arguments(p, rates="1gbit,10gbit", nodes="2,4")
    p.add_argument("--probe-variants", default="links2,ring",
                   help="with --cluster: Open MPI settings the link probe also runs with "
                        "(links2, ring, links2+ring; empty: defaults only)")
    p.add_argument("--job-variants", default="",
                   help="with --cluster: run the whole ring job (mpsync, Horovod, MPI) again "
                        "with these Open MPI settings (same names as --probe-variants)")


def run(args: argparse.Namespace) -> int:
    from mpsync.launch import mpirun_argv, python_argv, run_with_deadline

    if args.cluster is not None:
        from mpsync.bench.nodes import run_allreduce

        return run_allreduce(args)
    if args.np < 1:
        raise SystemExit(f"--np must be >= 1, got {args.np}")
    sizes = byte_sizes(args.sizes, DEFAULT_SIZES)
    common = ["--sizes", ",".join(map(str, sizes)), "--max-repeats", str(args.max_repeats),
              "--seconds-per-point", str(args.seconds_per_point),
              "--pace", getattr(args, "pace", "compute")] + \
        (["--fp16"] if getattr(args, "fp16", False) else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = [("ring", args.np)] + ([("ps", args.np + 1)] if args.ps else []) \
        + ([("two_stage", args.np)] if args.osp else [])
    osp: dict = {}
    rows: dict[int, dict] = {s: {"bytes": s} for s in sizes}
    for mode, nprocs in jobs:
        argv = mpirun_argv(nprocs, python_argv("mpsync.bench.allreduce", "--child", mode, *common),
                           forward_env=("OMP_NUM_THREADS", "PYTHONPATH"))
        res = run_with_deadline(argv, args.timeout, env=env)
        if res.returncode != 0:
            sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
            raise SystemExit(f"bench allreduce ({mode}, np={nprocs}) failed: "
                             f"{'timeout' if res.timed_out else f'exit {res.returncode}'}")
        for line in res.stdout.splitlines():
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                rows[row["bytes"]].update(row)
            elif line.startswith("OSP "):
                osp = json.loads(line[4:])
    table = [dict(rows[s], np=args.np) for s in sizes]
    for row in table:
        if row.get("horovod_ms"):
            row["mpsync_vs_horovod"] = row["mpsync_ms"] / row["horovod_ms"]
        if row.get("mpi_ms"):
            row["mpsync_mpi_vs_mpi"] = row["mpsync_mpi_ms"] / row["mpi_ms"]
        if row.get("gloo_ms"):
            row["gloo_vs_mpi"] = row["gloo_ms"] / row["mpi_ms"]
        if row.get("user_unchecked_ms"):
            row["check_overhead"] = row["user_ms"] / row["user_unchecked_ms"]
            row["negotiation_us"] = 1e3 * (row["user_ms"] - row["user_unchecked_ms"])
        if row.get("fused_ms"):
            row["fusion_gain"] = row["unfused_ms"] / row["fused_ms"]
        if row.get("ps_ms"):
            row["ps_vs_ring"] = row["ps_ms"] / row["mpsync_ms"]
        if row.get("horovod_fp16_ms"):
            row["mpsync_fp16_vs_horovod_fp16"] = row["mpsync_fp16_ms"] / row["horovod_fp16_ms"]
            row["fp16_vs_fp32_bytes"] = row["fp16_wire_bytes"] / row["fp32_wire_bytes"]
    if osp:
        osp["np"] = args.np
        for link in ("raw", "link"):
            osp[f"osp_vs_bsp_{link}"] = osp[f"osp_{link}_step_ms"] / osp[f"bsp_{link}_step_ms"]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rows_np{args.np}.json"), "w") as f:
            json.dump(table, f, indent=1)
        if osp:
            with open(os.path.join(args.out, f"osp_np{args.np}.json"), "w") as f:
                json.dump(osp, f, indent=1)
    if args.json:
        # stdout is the row list and nothing else, so its shape does not depend on which
        # extra jobs ran.
        print(json.dumps(table, indent=1))
        if osp:
            print("OSP vs BSP step time: " + json.dumps(osp), file=sys.stderr)
    else:
        _print_table(table)
        if osp:
            print("OSP vs BSP step time:", json.dumps(osp))
    return 0


def _print_table(table: list[dict]) -> None:
    cols = ["bytes", "mpsync_ms", "horovod_ms", "mpsync_vs_horovod", "mpsync_copy_ms",
            "mpsync_mpi_ms", "mpi_ms",
            "mpsync_mpi_vs_mpi", "mpsync_gloo_ms", "gloo_ms", "gloo_vs_mpi", "ps_ms", "ps_shard_ms", "ps_raw_ms", "ps_vs_raw",
            "ps_shard_vs_raw", "ps_paced_ms", "ps_shard_paced_ms", "ps_raw_paced_ms",
            "ps_paced_vs_raw", "ps_shard_paced_vs_raw", "ps_ssp_ms", "ps_ssp_asked_ms",
            "ps_ssp_vs_raw", "ps_ssp_asked_vs_raw", "ps_ssp_paced_ms", "ps_ssp_asked_paced_ms",
            "ps_ssp_paced_vs_raw", "ps_ssp_asked_paced_vs_raw", "ps_ssp_sure_share",
            "ps_raw_apply_ms", "ps_ssp_raw_ms", "ps_vs_raw_apply", "ps_ssp_vs_raw_apply",
            "ps_ssp_asked_vs_raw_apply",
            "ps_vs_ring", "ps_shards", "ps_pace",
            "ps_wire_bytes",
            "ps_min_bytes", "ring_min_bytes", "horovod_fp16_ms", "mpsync_fp16_ms",
            "mpsync_fp16_vs_horovod_fp16", "mpsync_opt_fp16_ms", "mpsync_mpi_fp16_ms",
            "fp16_vs_fp32_bytes", "user_ms", "user_unchecked_ms", "check_overhead",
            "negotiation_us", "server_thread_ms", "fused_ms", "unfused_ms", "fusion_gain"]
    cols = [c for c in cols if any(c in r for r in table)]
    print("  ".join(f"{c:>17}" for c in cols))
    for r in table:
        print("  ".join(f"{r[c]:>17.4g}" if isinstance(r.get(c), float) else f"{r.get(c, ''):>17}"
                        for c in cols))


# -- rank side ---------------------------------------------------------------------------------
def _fake_model(nbytes: int, bind: bool):
    """A "model" of 8 float32 parameters adding up to ``nbytes``, gradients filled in, and its
    fusion buffer (``bind``: gradients inside the buffer, the steady state under
    DistributedOptimizer; otherwise a script that sets them to None each step: pack + unpack)."""
    import torch

    from mpsync.torch.dataplane.fusion import FusionBuffer

    n = max(1, nbytes // 4)
    parts = [n // 8 + (1 if i < n % 8 else 0) for i in range(8)]
    params = [torch.zeros(p, dtype=torch.float32) for p in parts if p > 0]
    for p in params:
        p.grad = torch.ones_like(p)
    buf = FusionBuffer(params, [f"layer{i}.weight" for i in range(len(params))])
    if bind:
        buf.bind_grads()
    return buf


def _ring_child(sizes, max_repeats, budget, fp16=False) -> None:
    """Two phases over all sizes: MPI before Horovod starts (its background thread runs a
    small allreduce every cycle and would slow every other MPI call down), then Horovod."""
    import torch
    from mpi4py import MPI

    from mpsync.torch.dataplane.backends import HorovodAggregator, MPIAggregator
    from mpsync.torch.dataplane.compression import Compression, WireSum
    from mpsync.torch.dataplane.process_group import ProcessGroupAggregator
    from mpsync.torch._moves import start_allreduce
    from mpsync.torch.mpi_ops import Average, UserOps
    from mpsync.torch.strategies import average_gradients

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    mpi_agg = MPIAggregator(world.Dup(), deadline=600.0)
    checked = UserOps(world.Dup(), 600.0)
    unchecked = UserOps(world.Dup(), 600.0, checked=False)
    # gloo's rendezvous across nodes resolves worker 0's host name, which the virtual
    # cluster's nodes cannot: its columns are measured on one host only.
    gloo_agg = ProcessGroupAggregator.start(world.Dup(), "gloo", deadline=600.0,
                                            longest_wait=600.0, one_host=True) \
        if _one_host(world) else None
    rows = {s: {"bytes": s} for s in sizes}
    for nbytes in sizes:
        buf = _fake_model(nbytes, bind=True)
        arr = torch.ones(max(1, nbytes // 4), dtype=torch.float32).numpy()
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        g = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        points = {
            "mpi_ms": lambda: world.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM),
            "mpsync_mpi_ms": lambda: average_gradients([buf], mpi_agg),
            "user_ms": lambda: start_allreduce(checked, t, Average, 1.0, 1.0, None, None).wait(),
            "user_unchecked_ms": lambda: start_allreduce(
                unchecked, t, Average, 1.0, 1.0, None, None).wait(),
        }
        if gloo_agg is not None:
            points.update({
                "gloo_ms": lambda: gloo_agg.group.allreduce([g]).wait(),
                "mpsync_gloo_ms": lambda: average_gradients([buf], gloo_agg)})
        rows[nbytes].update(timed(world, points, max_repeats, budget))
        if fp16:
            ops = UserOps(world.Dup(), 600.0)
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            rows[nbytes].update(timed(world, {"mpsync_mpi_fp16_ms": lambda: start_allreduce(
                ops, t, Average, 1.0, 1.0, Compression.fp16, "fp16").wait()}, max_repeats, budget))
        del buf, arr, g
    if gloo_agg is not None:
        gloo_agg.close()
    _fusion_rows(world, rows, sizes, max_repeats, budget)

    import horovod.torch as hvd

    hvd.init(comm=world)
    hvd_agg = HorovodAggregator(hvd, deadline=600.0)
    for nbytes in sizes:
        raw = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        buf = _fake_model(nbytes, bind=True)
        copy_buf = _fake_model(nbytes, bind=False)
        rows[nbytes].update(timed(world, {
            "horovod_ms": lambda: hvd.allreduce_(raw, op=hvd.Average, name="raw"),
            "mpsync_ms": lambda: average_gradients([buf], hvd_agg),
            "mpsync_copy_ms": lambda: average_gradients([copy_buf], hvd_agg),
        }, max_repeats, budget))
        if fp16:
            ops = UserOps(world.Dup(), 600.0, hvd)
            wire = WireSum(hvd_agg, Compression.fp16)
            rows[nbytes]["fp16_wire_bytes"] = Compression.fp16.compress(raw)[0].nbytes
            rows[nbytes]["fp32_wire_bytes"] = Compression.none.compress(raw)[0].nbytes
            rows[nbytes].update(timed(world, {
                "horovod_fp16_ms": lambda: hvd.allreduce(
                    raw, op=hvd.Average, compression=hvd.Compression.fp16, name="raw16"),
                "mpsync_fp16_ms": lambda: start_allreduce(
                    ops, raw, Average, 1.0, 1.0, Compression.fp16, "fp16").wait(),
                "mpsync_opt_fp16_ms": lambda: (
                    buf.pack_grads(),
                    wire.sum_(buf.wire, "gradients", divisor=lambda _h: float(wire.size)),
                    buf.unpack_to_grads()),
            }, max_repeats, budget))
        if world.Get_rank() == 0:
            print("ROW " + json.dumps(rows[nbytes]), flush=True)
        del raw, buf, copy_buf
    hvd.shutdown()


def _one_host(comm) -> bool:
    """Every rank of ``comm`` on this node (the gloo group then stays on loopback)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


FUSION_TENSORS = 32


def _fusion_rows(world, rows, sizes, max_repeats, budget) -> None:
    """Tensor fusion: ``FUSION_TENSORS`` named async allreduces splitting each size, submitted
    together and then synchronized, with fusion (``fused_ms``: member 0 answers the ones
    that became ready together as one buffer) and without (``unfused_ms``: one data step
    each); the negotiation is the same in both."""
    import torch

    from mpsync.torch._moves import start_allreduce
    from mpsync.torch.mpi_ops import Sum, UserOps

    fused, unfused = UserOps(world.Dup(), 600.0), UserOps(world.Dup(), 600.0, fusion_bytes=0)
    threaded = UserOps(world.Dup(), 600.0)
    stop = _coordinate_on_a_thread(threaded)

    def burst(ops, parts):
        handles = [start_allreduce(ops, t, Sum, 1.0, 1.0, None, f"part.{i}")
                   for i, t in enumerate(parts)]
        for h in handles:
            h.wait()

    for nbytes in sizes:
        if nbytes > 4 << 20:
            continue  # fusion is for many small tensors
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        rows[nbytes].update(timed(world, {"server_thread_ms": lambda: start_allreduce(
            threaded, t, Sum, 1.0, 1.0, None, "one").wait()}, max_repeats, budget))
        each = max(1, nbytes // 4 // FUSION_TENSORS)
        parts = [torch.ones(each, dtype=torch.float32) for _ in range(FUSION_TENSORS)]
        rows[nbytes].update(timed(world, {
            "fused_ms": lambda: burst(fused, parts),
            "unfused_ms": lambda: burst(unfused, parts),
        }, max_repeats, budget))
    stop()


def _coordinate_on_a_thread(ops):
    """Member 0's coordinator on a thread of its own that polls, as the co-located state
    server's loop would run it: what choosing the server as coordinator would cost (a
    hand-off between threads of rank 0 for every answer) against the inline coordinator.
    Returns the function that stops it."""
    import threading

    coordinator, ops.coordinator = ops.coordinator, None
    if coordinator is None:
        return lambda: None
    done = threading.Event()

    def loop():
        while not done.is_set():
            coordinator.step()
            time.sleep(5e-5)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return lambda: (done.set(), thread.join())


def _every_step_policies() -> list[str]:
    """The ring policies whose strategies aggregate at every step (BSP's gradient averaging
    and OSP's two-stage sync): their step times compare directly."""
    return [s.name for s in registry.specs() if "ring" in s.topologies
            and s.strategy_class("ring").aggregates_every_step]


def _osp_child(sizes, max_repeats, budget) -> None:
    """Step time (forward + backward + aggregation + update) of BSP and of OSP with every other
    layer in In-Computation Sync, on an MLP of 8 Linear(512, 512) layers (8.4 MB of float32
    gradients), with the raw shared-memory transport and with an emulated 2 Gbit/s link."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from mpsync.config import SyncConfig
    from mpsync.torch.strategies.counters import LocalCounters
    from mpsync.torch.dataplane.backends import EmulatedLink, MPIAggregator
    from mpsync.torch.dataplane.fusion import group_by_dtype
    from mpsync.torch.strategies.two_stage import TwoStageSync

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    raw = MPIAggregator(world.Dup(), deadline=600.0)
    links = {"raw": raw, "link": EmulatedLink(raw, latency=5e-5, bandwidth=LINK_BANDWIDTH)}
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    n_steps = max(8, min(max_repeats, 40))
    row: dict = {"model_bytes": sum(p.numel() * 4 for p in model.parameters()),
                 "link_bandwidth_Bps": LINK_BANDWIDTH, "link_latency_s": 5e-5}
    for link_name, agg in links.items():
        for policy in _every_step_policies():
            config = SyncConfig(policy=policy, backend="mpi", server="colocated")
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            bufs = group_by_dtype(list(model.named_parameters()))
            cls = registry.get(policy).strategy_class("ring")
            strat = cls(opt, bufs, agg, None, LocalCounters(), config)
            if isinstance(strat, TwoStageSync):
                strat.bitmap = np.arange(strat.n_layers) % 2 == 1
            times = np.zeros(n_steps)
            for i in range(-3, n_steps):
                world.Barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                strat.step(0.0)
                if i >= 0:
                    times[i] = time.perf_counter() - t0
            strat.synchronize()
            strat.close()
            for buf in bufs:
                buf.grads_bound = False
            world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
            row[f"{policy}_{link_name}_step_ms"] = 1e3 * float(np.median(times))
    if world.Get_rank() == 0:
        print("OSP " + json.dumps(row), flush=True)


def _child_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=("ring", "ps", "two_stage"))
    p.add_argument("--sizes")
    # The parent's defaults, so that a job started by hand (bench/psopt/README.md) runs as
    # the parent's does.
    p.add_argument("--max-repeats", type=int, default=100)
    p.add_argument("--seconds-per-point", type=float, default=2.0)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--pace", choices=("compute", "idle"), default="compute")
    a = p.parse_args(argv)
    if a.child == "ring":
        _ring_child(byte_sizes(a.sizes, DEFAULT_SIZES), a.max_repeats, a.seconds_per_point,
                    fp16=a.fp16)
        return
    sizes = byte_sizes(a.sizes, DEFAULT_SIZES)
    if a.child == "ps":
        from mpsync.bench.ps_exchange import ps_child

        ps_child(sizes, a.max_repeats, a.seconds_per_point, a.pace)
        return
    _osp_child(sizes, a.max_repeats, a.seconds_per_point)


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child_main(sys.argv[1:])
    else:
        parser = argparse.ArgumentParser(prog="mpsync bench allreduce")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
