"""``mpsync bench server --np N [--json]``: state-server query latency and throughput.

Starts ``mpirun -np N`` itself.  In the same run, on the same ranks, in four interleaved
blocks (this VM's speed drifts from minute to minute, so each of 1-3 is measured in every
block and pooled rather than once at the start):

1. baseline: a raw mpi4py ``Send``/``Recv`` ping-pong of the same 64-byte buffer between
   rank 0 and rank 1 (round trip, µs);
2. the Python floor: rank 0 answers rank 1 from the smallest polling loop a Python server can
   have (``Iprobe``, ``Recv``, ``Send``, nothing else), rank 1 asks the way the client does
   (``Irecv``, ``Send``, poll ``Test``): what any Python server costs before it decides
   anything; and the polling floor: the same client against a blocking ``Recv``/``Send``
   (what a client that must not hang, so polls its reply with a deadline, costs by itself);
3. rank 0 serves (policy bsp), ranks 1..N-1 send ``--queries``/4 step queries each as fast
   as replies come back (round trip per query, p50/p99 µs; queries per second over all
   clients; the server's CPU while loaded).

Then, once:

4. idle: the clients sleep 2 s (the server's CPU while idle);
5. paced like training: each client sleeps ``--pace-ms`` (its "compute"), then queries,
   ``--paced-iters`` times (round trip p50/p99 and the server's CPU).  ``--no-wake-ahead``
   turns off the server's wake-up for reports that are due, to measure what it buys;
   ``--no-fast-path`` runs server and clients without their compiled path (Python only).

JSON keys: ``p50_us``, ``p99_us``, ``raw_p50_us``, ``queries_per_s`` (plus ``raw_p99_us``,
``python_floor_p50_us``, ``polling_floor_p50_us``, ``p50_ratio``, ``server_cpu_idle_pct``,
``server_cpu_load_pct``, ``paced_p50_us``, ``paced_p99_us``, ``server_cpu_paced_pct``, ``pace_ms``, ``wake_ahead``,
``fast_path``, ``clients``, ``queries_per_client``, ``blocks``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time

__all__ = ["add_arguments", "run"]

_IDLE_S = 2.0
_BLOCKS = 4   # interleaved baseline / floor / query blocks (_rank_program)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--np", type=int, default=5, help="ranks: 1 server + N-1 clients (default 5)")
    parser.add_argument("--queries", type=int, default=20000, help="queries per client")
    parser.add_argument("--pace-ms", type=float, default=5.0,
                        help="paced phase: each client's emulated iteration time (default 5)")
    parser.add_argument("--paced-iters", type=int, default=200,
                        help="paced phase: iterations per client (default 200)")
    parser.add_argument("--baseline-samples", type=int, default=3000,
                        help="raw and Python-floor round trips per block (default 3000; fewer "
                             "for hundreds of clients, where each one waits its turn on the "
                             "cores)")
    parser.add_argument("--no-wake-ahead", action="store_true",
                        help="the server does not wake up for reports that are due")
    parser.add_argument("--no-fast-path", action="store_true",
                        help="server and clients without their compiled path (Python only)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the mpirun")
    parser.add_argument("--cluster", nargs="?", const="", default=None, metavar="NAME",
                        help="one rank per node of the virtual cluster NAME (default "
                             "$MPSYNC_CLUSTER or mpsync; made for the run unless up), the "
                             "server alone on node1: every query and ping crosses a link")
    parser.add_argument("--cluster-rate", default="1gbit",
                        help="with --cluster: the links' rate during the run (default 1gbit)")


def run(args: argparse.Namespace) -> int:
    from mpsync.launch import launch_argv, python_argv, run_with_deadline

    if args.np < 2:
        print("mpsync bench server: --np must be >= 2 (a server and a client)", file=sys.stderr)
        return 2
    if args.pace_ms < 0 or args.paced_iters < 1 or args.baseline_samples < 10:
        print("mpsync bench server: --pace-ms must be >= 0, --paced-iters >= 1 and "
              "--baseline-samples >= 10",
              file=sys.stderr)
        return 2
    command = python_argv("mpsync.bench.server", "--rank-program", str(args.queries),
                          str(args.pace_ms), str(args.paced_iters),
                          str(int(not args.no_wake_ahead)), str(int(not args.no_fast_path)),
                          str(args.baseline_samples))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    where = {}
    with contextlib.ExitStack() as stack:
        on = None
        if args.cluster is not None:
            from mpsync.bench.nodes import cluster_at_rate

            state = stack.enter_context(cluster_at_rate(args.np, args.cluster_rate, args.cluster))
            on = state.name
            where = {"cluster": state.name, "nodes": args.np, "link_rate": args.cluster_rate,
                     "transport": "tcp across namespace links"}
        argv = launch_argv(args.np, command, cluster=on,
                           forward_env=("PYTHONPATH", "OMP_NUM_THREADS"))
        res = run_with_deadline(argv, args.timeout, env=env)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("{")), None)
    if res.timed_out or res.returncode != 0 or line is None:
        why = "timed out" if res.timed_out else f"exit {res.returncode}"
        print(f"mpsync bench server: the mpirun run failed ({why}):\n{res.stderr[-3000:]}",
              file=sys.stderr)
        return 1
    result = dict(json.loads(line), **where)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"state server, {result['clients']} client(s), {args.queries} queries each"
              + (f", one rank per node of cluster {where['cluster']} ({where['link_rate']} "
                 f"links)" if where else ""))
        print(f"  query round trip  p50 {result['p50_us']:.1f} µs  p99 {result['p99_us']:.1f} µs")
        print(f"  raw ping-pong     p50 {result['raw_p50_us']:.1f} µs  (same run)  "
              f"ratio {result['p50_ratio']:.2f}x")
        print(f"  Python floor      p50 {result['python_floor_p50_us']:.1f} µs  (empty polling "
              f"server, same run)")
        print(f"  polling floor     p50 {result['polling_floor_p50_us']:.1f} µs  (polling client, "
              f"blocking receiver, same run)")
        print(f"  throughput        {result['queries_per_s']:.0f} queries/s")
        print(f"  server CPU        idle {result['server_cpu_idle_pct']:.1f}%  "
              f"loaded {result['server_cpu_load_pct']:.1f}% of a core")
        wake = "on" if result["wake_ahead"] else "off"
        print(f"  compiled path     {'on' if result['fast_path'] else 'off'}")
        print(f"  paced {result['pace_ms']:g} ms     p50 {result['paced_p50_us']:.1f} µs  "
              f"p99 {result['paced_p99_us']:.1f} µs  server CPU "
              f"{result['server_cpu_paced_pct']:.1f}%  (wake-ahead {wake})")
        if "paced_floor_p50_us" in result:
            print(f"  paced floor       p50 {result['paced_floor_p50_us']:.1f} µs  p99 "
                  f"{result['paced_floor_p99_us']:.1f} µs  (raw receiver paced the same way)  "
                  f"ratio {result['paced_ratio_to_floor']:.2f}x")
        if result.get("server_decisions_per_s"):
            print(f"  one server thread {result['server_decisions_per_s']:.0f} decisions/s "
                  f"(queued steps drained in-process)")
    return 0


def _raw_block(world, rank: int, n: int, warm: int) -> list:
    """Raw buffer ping-pong, rank 0 <-> rank 1: round trips after ``warm`` (seconds)."""
    import numpy as np
    from mpi4py import MPI

    buf = np.zeros(8)
    rtts = []
    if rank in (0, 1):
        for i in range(warm + n):
            t0 = time.perf_counter()
            if rank == 1:
                world.Send([buf, MPI.DOUBLE], dest=0, tag=1)
                world.Recv([buf, MPI.DOUBLE], source=0, tag=2)
                if i >= warm:
                    rtts.append(time.perf_counter() - t0)
            else:
                world.Recv([buf, MPI.DOUBLE], source=1, tag=1)
                world.Send([buf, MPI.DOUBLE], dest=1, tag=2)
    world.Barrier()
    return rtts


def _floor_block(world, rank: int, n: int, warm: int, probing: bool = True) -> list:
    """Rank 1 asks as the client does (``Irecv``, ``Send``, poll ``Test``).  ``probing``:
    rank 0 answers from the smallest polling loop a Python server can have (``Iprobe``,
    ``Recv``, ``Send``): the Python floor.  Else a blocking ``Recv`` from rank 1 and a
    ``Send``: the polling floor, what the client's polling costs by itself."""
    import numpy as np
    from mpi4py import MPI

    buf, rep = np.zeros(8), np.zeros(8)
    floor = []
    if rank in (0, 1):
        status = MPI.Status()
        for i in range(warm + n):
            if rank == 1:
                t0 = time.perf_counter()
                req = world.Irecv([rep, MPI.DOUBLE], source=0, tag=4)
                world.Send([buf, MPI.DOUBLE], dest=0, tag=5)
                while not req.Test():
                    pass
                if i >= warm:
                    floor.append(time.perf_counter() - t0)
                continue
            if probing:
                while not world.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                    pass
            world.Recv([buf, MPI.DOUBLE], source=1, tag=5)
            world.Send([rep, MPI.DOUBLE], dest=1, tag=4)
    world.Barrier()
    return floor


def _paced_floor_block(world, rank: int, pace_ms: float, n: int) -> list:
    """The paced floor: a raw mpi4py receiver paced the same way as the clients.  Both
    ranks sleep ``pace_ms``, then rank 1 sends and waits for the answer, rank 0 receives and
    answers: what a round trip costs when either side has just woken from a sleep (the OS's
    wake-up), with nothing of the server in it."""
    import numpy as np
    from mpi4py import MPI

    buf = np.zeros(8)
    rtts = []
    if rank in (0, 1):
        for i in range(n):
            time.sleep(pace_ms * 1e-3)
            t0 = time.perf_counter()
            if rank == 1:
                world.Send([buf, MPI.DOUBLE], dest=0, tag=6)
                world.Recv([buf, MPI.DOUBLE], source=0, tag=7)
                if i >= 10:
                    rtts.append(time.perf_counter() - t0)
            else:
                world.Recv([buf, MPI.DOUBLE], source=1, tag=6)
                world.Send([buf, MPI.DOUBLE], dest=1, tag=7)
    world.Barrier()
    return rtts


def _decisions_per_s(cfg, batch: int = 2000, batches: int = 5) -> float | None:
    """What the server's one thread decides per second when it never waits for a message:
    ``batch`` steps queued on ``COMM_SELF``, then drained by the compiled loop (probe,
    receive, rules, reply to itself); the best of ``batches``.  None without the compiled
    path."""
    import dataclasses

    from mpi4py import MPI

    from mpsync.server import StateServer, wire as W

    comm = MPI.COMM_SELF.Dup()
    try:
        server = StateServer(comm, dataclasses.replace(cfg, server="colocated"), workers=[0])
        if server.fast is None:
            return None
        best = 0.0
        reply = W.new_msg()
        for b in range(batches):
            msgs = [W.new_msg() for _ in range(batch)]
            for i, m in enumerate(msgs):
                m[W.SEQ], m[W.ITER] = b * batch + i + 1, b * batch + i + 1
            sends = [comm.Isend([m, MPI.DOUBLE], dest=0, tag=W.STEP) for m in msgs]
            t0 = time.perf_counter()
            done = server.fast.serve(MPI.Wtime(), 1e-3, MPI.Wtime() + 60.0, batch)
            elapsed = time.perf_counter() - t0
            MPI.Request.Waitall(sends)
            for _ in range(batch):
                comm.Recv([reply, MPI.DOUBLE], source=0, tag=W.REPLY)
            best = max(best, done.handled / elapsed)
        return best
    finally:
        comm.Free()


def _rank_program(queries: int, pace_ms: float, paced_iters: int, wake_ahead: bool,
                  fast_path: bool, baseline_samples: int = 3000) -> None:
    from mpi4py import MPI

    from mpsync.config import SyncConfig
    from mpsync.policies import BASELINE
    from mpsync.server import StateServer, SyncClient

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    clients = world.Split(0 if rank == 0 else 1, rank)
    control = world.Dup()
    cfg = SyncConfig.from_options(env={}, policy=BASELINE, topology="ring", silent_timeout=600.0,
                                  deadline=600.0, server_fast_path=fast_path)
    samples = []
    done = threading.Event()
    if rank == 0:   # the server process's CPU time, sampled for the idle and paced phases
        def sample():
            while not done.is_set():
                samples.append((time.time(), time.process_time()))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
    blocks = _blocks(world, clients, control, cfg, wake_ahead, max(1, queries // _BLOCKS),
                     baseline_samples)
    blocks["decisions_per_s"] = _decisions_per_s(cfg) if rank == 0 else None
    world.Barrier()
    blocks["paced_floor"] = _paced_floor_block(world, rank, pace_ms, min(paced_iters, 200))
    # 4. Idle, then paced like training: an emulated iteration (a sleep: accelerator time,
    # the CPU is free), a query.
    if rank == 0:
        StateServer(control, cfg, wake_ahead=wake_ahead).serve()
        done.set()
        sampler.join()
        window = world.bcast(None, root=1)
        # Loaded: over the block servers' whole lives (a block is too short for the sampler).
        busy = blocks["busy"]
        world.send(dict(_cpu_pct(samples, window), load=100.0 * busy[0] / busy[1],
                        decisions_per_s=blocks["decisions_per_s"]), dest=1, tag=3)
        return
    client = SyncClient(control, cfg)
    paced = _paced(client, clients, pace_ms, paced_iters)
    paced["fast_path"] = client.compiled   # off where this MPI cannot be bound
    gathered = {k: clients.gather(v, root=0) for k, v in (
        ("paced", paced["latency"]), ("paced_span", paced["span"]),
        ("lat", blocks["lat"]), ("spans", blocks["spans"]))}
    client.shutdown()
    if rank == 1:
        _report(world, blocks, paced, gathered, pace_ms, wake_ahead)
    else:
        world.bcast(None, root=1)


def _blocks(world, clients, control, cfg, wake_ahead: bool, per_block: int,
            samples: int = 3000) -> dict:
    """1.-3. Baseline, Python floor and saturated queries in interleaved blocks: the speed of
    this VM drifts from one minute to the next, so each is measured in every block and pooled,
    not once at the start."""
    import numpy as np

    from mpsync.server import StateServer, SyncClient

    rank = world.Get_rank()
    out = {"rtts": [], "floor": [], "polling": [], "lat": [], "spans": [],
           "per_block": per_block,
           "busy": [0.0, 0.0]}   # rank 0: CPU and wall seconds of the block servers
    for block in range(_BLOCKS):
        warm = samples // 10 if block else min(2000, samples)
        out["rtts"] += _raw_block(world, rank, samples, warm)
        out["floor"] += _floor_block(world, rank, samples, warm)
        out["polling"] += _floor_block(world, rank, samples, warm, probing=False)
        if rank == 0:
            wall, cpu = time.time(), time.process_time()
            StateServer(control, cfg, wake_ahead=wake_ahead).serve()
            out["busy"][0] += time.process_time() - cpu
            out["busy"][1] += time.time() - wall
        else:
            client = SyncClient(control, cfg)
            for k in range(min(200, per_block)):  # warm-up
                client.step(k, 0.0)
            clients.Barrier()
            block_lat = np.empty(per_block)
            start = time.time()
            for k in range(per_block):
                t0 = time.perf_counter()
                client.step(k, 0.0)
                block_lat[k] = time.perf_counter() - t0
            out["spans"].append((start, time.time()))
            out["lat"].append(block_lat)
            client.shutdown()
        world.Barrier()
    if rank != 0:
        out["lat"] = np.concatenate(out["lat"])
    return out


def _paced(client, clients, pace_ms: float, paced_iters: int) -> dict:
    """An idle spell, then queries paced like training; latencies after the first ten (once
    the intervals are known) and the wall-clock spans of both phases."""
    import numpy as np

    t_idle0 = time.time()
    time.sleep(_IDLE_S)
    t_idle1 = time.time()
    clients.Barrier()
    paced = np.empty(paced_iters)
    paced_start = time.time()
    ready = time.perf_counter()
    for k in range(paced_iters):
        time.sleep(pace_ms * 1e-3)
        t0 = time.perf_counter()
        # The compute time as a worker measures it: since its last exchange with the server.
        decision = client.step(k, t0 - ready)
        paced[k] = time.perf_counter() - t0
        if decision.sync:   # as a BSP worker does after its allreduce (here: none)
            client.reset(decision.round + 1, 0.0)
        ready = time.perf_counter()
    return {"latency": paced[min(10, paced_iters - 1):], "span": (paced_start, time.time()),
            "idle": (t_idle0, t_idle1)}


def _report(world, blocks: dict, paced: dict, gathered: dict, pace_ms: float,
            wake_ahead: bool) -> None:
    """Rank 1: the CPU windows to the server, its CPU shares back, and the result line."""
    import numpy as np

    # Per block, from the first client's start to the last one's end.
    spans = [(min(s[b][0] for s in gathered["spans"]), max(s[b][1] for s in gathered["spans"]))
             for b in range(_BLOCKS)]
    paced_window = (max(s for s, _ in gathered["paced_span"]),
                    min(e for _, e in gathered["paced_span"]))
    t_idle0, t_idle1 = paced["idle"]
    world.bcast({"idle": [(t_idle0 + 0.3, t_idle1 - 0.2)], "paced": [paced_window]}, root=1)
    cpu = world.recv(source=0, tag=3)
    lat_all = np.concatenate(gathered["lat"]) * 1e6
    raw = np.array(blocks["rtts"]) * 1e6
    paced_all = np.concatenate(gathered["paced"]) * 1e6
    result = {
        "clients": world.Get_size() - 1, "queries_per_client": blocks["per_block"] * _BLOCKS,
        "blocks": _BLOCKS,
        "p50_us": float(np.percentile(lat_all, 50)),
        "p99_us": float(np.percentile(lat_all, 99)),
        "raw_p50_us": float(np.percentile(raw, 50)),
        "raw_p99_us": float(np.percentile(raw, 99)),
        "python_floor_p50_us": float(np.percentile(np.array(blocks["floor"]) * 1e6, 50)),
        "polling_floor_p50_us": float(np.percentile(np.array(blocks["polling"]) * 1e6, 50)),
        "queries_per_s": float(lat_all.size / sum(b - a for a, b in spans)),
        "server_cpu_idle_pct": cpu["idle"], "server_cpu_load_pct": cpu["load"],
        "pace_ms": pace_ms, "wake_ahead": wake_ahead, "fast_path": paced["fast_path"],
        "paced_p50_us": float(np.percentile(paced_all, 50)),
        "paced_p99_us": float(np.percentile(paced_all, 99)),
        "server_cpu_paced_pct": cpu["paced"],
        "server_decisions_per_s": cpu["decisions_per_s"],
    }
    result["p50_ratio"] = result["p50_us"] / result["raw_p50_us"]
    floor = np.array(blocks["paced_floor"]) * 1e6
    if floor.size:
        result["paced_floor_p50_us"] = float(np.percentile(floor, 50))
        result["paced_floor_p99_us"] = float(np.percentile(floor, 99))
        result["paced_ratio_to_floor"] = result["paced_p50_us"] / result["paced_floor_p50_us"]
    print(json.dumps(result), flush=True)


def _cpu_pct(samples, windows) -> dict:
    """Percent of one core used by the server process over each named list of wall-clock
    spans (their CPU time over their length, summed)."""
    out = {}
    for name, spans in windows.items():
        cpu = wall = 0.0
        for a, b in spans:
            inside = [(t, c) for t, c in samples if a <= t <= b]
            if len(inside) >= 2:
                (t0, c0), (t1, c1) = inside[0], inside[-1]
                cpu += c1 - c0
                wall += t1 - t0
        out[name] = 100.0 * cpu / wall if wall > 0 else float("nan")
    return out


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--rank-program":
        _rank_program(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]),
                      sys.argv[5] == "1", sys.argv[6] == "1", int(sys.argv[7]))
    else:
        parser = argparse.ArgumentParser(prog="python -m mpsync.bench.server")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
