"""Rank programs for the state-server tests (run through tests/mpi_harness.py).

Workers emulate heterogeneous devices by sleeping ``base * speed[w]`` per local iteration; the
ring "aggregation" is a real ``Allreduce`` among the workers, so a wrong SYNC decision shows up
as a deadlock (caught by the harness's timeout) or as a failed check below.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from mpsync.config import SyncConfig
from mpsync.server import SyncClient, StateServer


def program_args():
    opts = {}
    for a in sys.argv[1:]:
        k, _, v = a.partition("=")
        opts[k] = v
    return opts


def policy_run() -> None:
    """args: policy=.. topology=.. iters=N base=S speeds=1,1,2,4 [options as key=value]."""
    o = program_args()
    world = MPI.COMM_WORLD
    control = world.Dup()
    rank = world.Get_rank()
    workers = world.Split(0 if rank == 0 else 1, rank)
    extra = {}
    for key, cast in (("staleness", int), ("staleness_low", int), ("staleness_high", int),
                      ("lookahead", int), ("esync_slack", float), ("silent_timeout", float),
                      ("deadline", float)):
        if key in o:
            extra[key] = cast(o[key])
    cfg = SyncConfig.from_options(env={}, policy=o["policy"], topology=o.get("topology", "ring"),
                                  **extra)
    if o.get("colocated") == "1":
        return _colocated(world, control, cfg, o)
    if rank == 0:
        logs = []
        stats = StateServer(control, cfg, log=lambda line: (logs.append(line),
                                                             print(line, file=sys.stderr))).serve()
        stats["log"] = logs
        with open(o["out"], "w") as f:
            json.dump(stats, f)
        return
    w = rank - 1
    speeds = [float(s) for s in o.get("speeds", "1,1,1,1").split(",")]
    base = float(o.get("base", "0.001"))
    iters = int(o.get("iters", "50"))
    duration = float(o.get("duration", "0"))
    rounds = int(o.get("rounds", "0"))  # local-SGD policies: a budget of rounds, not iterations
    stall_worker, stall_at, stall_s = (int(x) if i < 2 else float(x) for i, x in
                                       enumerate(o.get("stall", "-1,0,0").split(",")))
    client = SyncClient(control, cfg)
    # overrun: per round, the most any iteration (sleep plus query) took beyond its nominal
    # time: what the machine, not the policy, held this worker up.
    record = {"sync_iters": [], "local_before_sync": [], "slowest_wait": [], "rounds": 0,
              "gaps": [], "overrun": []}
    round_overrun = 0.0
    model = np.zeros(4) if cfg.topology == "ps" else None
    if model is not None and w == 0:
        client.ps_init(model)
    if model is not None:
        client.pull(model, 0)
    k = 0
    since_sync = 0
    start = time.perf_counter()
    def more() -> bool:
        if rounds:
            return record["rounds"] < rounds
        if duration:
            return time.perf_counter() - start < duration
        return k < iters

    while more():
        t0 = time.perf_counter()
        time.sleep(base * speeds[w])
        k += 1
        since_sync += 1
        if stall_at and w == stall_worker and k == stall_at:
            time.sleep(stall_s)  # stops reporting: the server should take it out (PS)
        if o.get("delayed") == "1":  # ESync §4.2: report without waiting, poll for READY
            d = client.step_async(k, time.perf_counter() - t0).poll()
            round_overrun = max(round_overrun, time.perf_counter() - t0 - base * speeds[w])
            if d is None:
                continue
            record.setdefault("readies", 0)
            record["readies"] += 1
        else:
            d = client.step(k, time.perf_counter() - t0)
            round_overrun = max(round_overrun, time.perf_counter() - t0 - base * speeds[w])
        if cfg.policy == "osp":
            # Every worker must get the same bitmap for the next iteration.
            # Epochs of 5 iterations with a falling loss and a bound of 150 elements
            # (differing per worker: the smallest counts), so Alg. 1 opens ICS after epoch 1.
            imp = np.random.default_rng(k * 100 + w).random(6)
            epoch = 1 + (k - 1) // 5
            bitmap = client.report_importance(imp, np.array([10, 20, 30, 40, 50, 60]),
                                              loss=1.0 / epoch, epoch=epoch,
                                              u_max=150.0 + 10 * w)
            code = np.array([int("".join("1" if b else "0" for b in bitmap), 2)], dtype=np.int64)
            lo, hi = np.empty_like(code), np.empty_like(code)
            workers.Allreduce(code, lo, op=MPI.MIN)
            workers.Allreduce(code, hi, op=MPI.MAX)
            assert lo[0] == hi[0], f"workers got different OSP bitmaps at iteration {k}"
            record.setdefault("ics_layers", 0)
            record["ics_layers"] += int(bitmap.sum())
        if not d.sync:
            continue
        if cfg.topology == "ring":
            t_ready = time.perf_counter()
            mine = np.array([k], dtype=np.int64)
            lo, hi = np.empty_like(mine), np.empty_like(mine)
            workers.Allreduce(mine, lo, op=MPI.MIN)
            workers.Allreduce(mine, hi, op=MPI.MAX)
            record["slowest_wait"].append(time.perf_counter() - t_ready)
            record["gaps"].append(int(hi[0] - lo[0]))
        else:
            client.push(np.ones(4), k)
            client.pull(model, k)
        record["sync_iters"].append(k)
        record["local_before_sync"].append(since_sync)
        since_sync = 0
        record["rounds"] += 1
        record["overrun"].append(round_overrun)
        round_overrun = 0.0
        client.reset(record["rounds"], 0.0)
    record["iterations"] = k
    record["speed"] = speeds[w]
    all_records = workers.gather(record, root=0)
    if w == 0:
        with open(o["out"] + ".workers", "w") as f:
            json.dump(all_records, f)
    workers.Barrier()
    client.shutdown()


def _colocated(world, control, cfg, o) -> None:
    """Every rank trains; rank 0 also hosts the server in a thread."""
    from mpsync.server import start_colocated

    cfg = SyncConfig.from_options(env={}, policy=cfg.policy, topology=cfg.topology,
                                  server="colocated")
    rank = world.Get_rank()
    server = start_colocated(control, cfg) if rank == 0 else None
    client = SyncClient(control, cfg)
    for k in range(1, int(o.get("iters", "50")) + 1):
        time.sleep(0.001 * (rank + 1))
        d = client.step(k, 0.001 * (rank + 1))
        assert d.sync
        world.Barrier()
        client.reset(k, 0.0)
    client.shutdown()
    if server is not None:
        stats = server.join(timeout=60)
        with open(o["out"], "w") as f:
            json.dump(stats, f)


def transport() -> None:
    """The compiled loop as transport around the rules: rank 0 serves with the compiled path on,
    ranks 1..4 run the ring protocol at speeds 1,1,2,4 (their replies checked by the client:
    sequence numbers, layout), with malformed messages and a worker leaving early as asked;
    the server's stats go to ``out``.

    args: policy=.. rounds=N out=.. [speeds=1,1,2,4] [base=S] [delayed=1: ESync §4.2 mode]
    [bad=1: every 7th step of worker 0 is malformed first] [early=1: the last rank reports 3
    steps outside the aggregation group and shuts down, so the others run on with a worker
    gone]."""
    o = program_args()
    world = MPI.COMM_WORLD
    comm = world.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    early = o.get("early") == "1" and rank == size - 1
    workers = world.Split(0 if rank == 0 else 2 if early else 1, rank)
    cfg = SyncConfig.from_options(env={}, policy=o["policy"], topology="ring",
                                  silent_timeout=600.0, deadline=60.0)
    if rank == 0:
        server = StateServer(comm, cfg)
        assert server.view().fast_path, "the compiled path is not available here"
        stats = server.serve()
        with open(o["out"], "w") as f:
            json.dump(stats, f)
        return
    from mpsync.server import wire as W

    speeds = [float(x) for x in o.get("speeds", "1,1,2,4").split(",")]
    base = float(o.get("base", "0.002"))
    delayed = o.get("delayed") == "1"
    w = rank - 1
    client = SyncClient(comm, cfg)
    if early:
        for k in range(1, 4):
            time.sleep(base)
            client.step(k, base)
        client.shutdown()
        print(f"transport worker {rank} ok: left early", flush=True)
        return
    k = rnd = steps = 0
    while rnd < int(o["rounds"]):
        time.sleep(base * speeds[w])
        k += 1
        steps += 1
        if o.get("bad") == "1" and w == 0 and steps % 7 == 0:
            bad = np.array([10.0 ** 6 + steps, k + 0.5, float("nan"), 0, 0, 0, 0, 0])
            comm.Send([bad, MPI.DOUBLE], dest=0, tag=W.STEP)   # dropped by the server
        if delayed:
            decision = client.step_async(k, base * speeds[w]).poll()
        else:
            decision = client.step(k, base * speeds[w])
        if decision is None:
            continue   # delayed ACK: NOT-READY is implicit
        if decision.sync:
            t0 = time.perf_counter()
            workers.allreduce(k)
            rnd += 1
            client.reset(rnd, time.perf_counter() - t0)
    workers.Barrier()
    client.shutdown()
    print(f"transport worker {rank} ok: {steps} steps, {rnd} rounds", flush=True)


def load() -> None:
    """Every non-zero rank sends ``queries`` steps; replies must match one-to-one."""
    import resource

    o = program_args()
    world = MPI.COMM_WORLD
    control = world.Dup()
    rank = world.Get_rank()
    queries = int(o.get("queries", "2000"))
    cfg = SyncConfig.from_options(env={}, policy="bsp", topology="ring", deadline=120.0,
                                  silent_timeout=120.0)
    if rank == 0:
        srv = StateServer(control, cfg)
        rss0 = _rss_kb()  # after start-up (imports, kernel warm-up), before any query
        t0 = time.perf_counter()
        stats = srv.serve()
        elapsed = time.perf_counter() - t0
        rss1 = _rss_kb()
        total = sum(w["iterations"] for w in stats["workers"].values())
        with open(o["out"], "w") as f:
            json.dump({"total_steps": total, "elapsed_s": elapsed, "rss_start_kb": rss0,
                       "rss_end_kb": rss1,
                       "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                       "per_worker": {r: w["iterations"] for r, w in stats["workers"].items()},
                       "syncs": sum(w["decisions"]["SYNC"] for w in stats["workers"].values()),
                       "rejected": stats["rejected_messages"], "rss_kb": stats["rss_kb"]}, f)
        return
    client = SyncClient(control, cfg)
    for k in range(1, queries + 1):
        d = client.step(k, 0.0)
        assert d.sync and d.local_iters == 0, d
    # Each reply carried this request's sequence number (checked in SyncClient._call).
    client.shutdown()


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1
