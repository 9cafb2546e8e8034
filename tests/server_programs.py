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


def _args():
    opts = {}
    for a in sys.argv[1:]:
        k, _, v = a.partition("=")
        opts[k] = v
    return opts


def policy_run() -> None:
    """args: policy=.. topology=.. iters=N base=S speeds=1,1,2,4 [options as key=value]."""
    o = _args()
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
    record = {"sync_iters": [], "local_before_sync": [], "slowest_wait": [], "rounds": 0,
              "gaps": []}
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
            if d is None:
                continue
            record.setdefault("readies", 0)
            record["readies"] += 1
        else:
            d = client.step(k, time.perf_counter() - t0)
        if cfg.policy == "osp":
            # Every worker must get the same bitmap for the next iteration.
            imp = np.random.default_rng(k * 100 + w).random(6)
            bitmap = client.report_importance(imp, np.array([10, 20, 30, 40, 50, 60]))
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


def fuzz() -> None:
    """Rank 0 serves (asp on the PS); the last rank sends random messages; the others are
    well-formed clients that check every reply."""
    o = _args()
    world = MPI.COMM_WORLD
    control = world.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    n_msgs = int(o.get("n", "10000"))
    cfg = SyncConfig.from_options(env={}, policy="asp", topology="ps", deadline=60.0)
    fuzzer = size - 1
    honest = [r for r in range(1, size - 1)]
    if rank == 0:
        log_lines = []
        srv = StateServer(control, cfg, workers=honest + [fuzzer], log=log_lines.append)
        stats = srv.serve()
        with open(o["out"], "w") as f:
            json.dump({"rejected": stats["rejected_messages"], "log": log_lines,
                       "ps_version": stats["ps_version"]}, f)
        return
    if rank == fuzzer:
        from mpsync.server import _wire as W

        client = SyncClient(control, cfg)
        rng = np.random.default_rng(int(o.get("seed", "1")))
        tags = [W.STEP, W.RESET, W.PUSH, W.PULL, W.IMPORTANCE, W.PS_INIT, W.DATA, 7, 999, 12345]
        specials = [np.nan, -1.0, 1e300, -np.inf, 2.0 ** 60, 0.0, 3.0]
        sink = bytearray(1 << 20)
        st = MPI.Status()
        for i in range(n_msgs):
            tag = int(rng.choice(tags))
            size_ = int(rng.choice([0, 1, 7, 8, 9, 64, int(rng.integers(0, 100))]))
            payload = rng.normal(size=size_) * 10 ** rng.integers(0, 20)
            if size_ and rng.random() < 0.5:
                payload[rng.integers(0, size_)] = rng.choice(specials)
            world_req = control.Isend([payload, MPI.DOUBLE], dest=0, tag=tag)
            # Drain whatever the server answers (replies to accidental well-formed requests).
            while not world_req.Test():
                while control.Iprobe(0, MPI.ANY_TAG, st):
                    control.Recv([sink, MPI.BYTE], source=0, tag=st.Get_tag())
            while control.Iprobe(0, MPI.ANY_TAG, st):
                control.Recv([sink, MPI.BYTE], source=0, tag=st.Get_tag())
        time.sleep(0.5)
        while control.Iprobe(0, MPI.ANY_TAG, st):
            control.Recv([sink, MPI.BYTE], source=0, tag=st.Get_tag())
        client.shutdown()
        return
    client = SyncClient(control, cfg)
    model = np.zeros(16)
    if rank == honest[0]:
        client.ps_init(model)
    client.pull(model, 0)
    versions = []
    for k in range(1, 301):
        d = client.step(k, 0.0001)
        assert d.sync, d
        v = client.push(np.full(16, 1.0), k)
        versions.append(v)
        client.pull(model, k)
    assert versions == sorted(versions), "model versions went backwards"
    client.shutdown()
    print(f"honest rank {rank} ok, last version {versions[-1]}")


def outsider() -> None:
    """Rank 0 serves bsp for workers 1..size-2; the last rank is not one of its workers and
    sends well-formed requests anyway: each must be dropped (no reply), logged once.  The
    server also writes its stats and Chrome trace through the public writers."""
    from mpsync.server import _wire as W
    from mpsync.server import write_chrome_trace, write_stats_json

    o = _args()
    world = MPI.COMM_WORLD
    control = world.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    others = world.Split(0 if rank == 0 else 1, rank)   # every rank but the server
    outsider_rank = size - 1
    workers = list(range(1, outsider_rank))
    n_msgs, iters = int(o.get("n", "50")), int(o.get("iters", "20"))
    cfg = SyncConfig.from_options(env={}, policy="bsp", topology="ring", deadline=60.0)
    if rank == 0:
        logs = []
        stats = StateServer(control, cfg, workers=workers, log=logs.append).serve()
        write_stats_json(stats, o["out"] + ".stats.json")
        write_chrome_trace(stats, o["out"] + ".trace.json")
        with open(o["out"], "w") as f:
            json.dump({"log": logs, "rejected": stats["rejected_messages"],
                       "workers": stats["workers"]}, f)
        return
    trainers = others.Split(1 if rank == outsider_rank else 0, rank)  # workers without it
    if rank == outsider_rank:
        msg = np.zeros(W.MSG_LEN)
        for i in range(n_msgs):
            tag = (W.REGISTER, W.STEP, W.RESET, W.PULL, W.STATS)[i % 5]
            msg[:] = (i + 1, i, 0.001, 0, 0, 0, 0, 0)
            # Synchronous send: returns once the server has received (and dropped) it.
            control.Ssend([msg, MPI.DOUBLE], dest=0, tag=tag)
        time.sleep(0.5)  # a reply, had one been sent, would have arrived by now
        replied = control.Iprobe(0, MPI.ANY_TAG)
        print(f"outsider: sent {n_msgs}, reply received: {replied}", flush=True)
        others.Barrier()
        return
    client = SyncClient(control, cfg)
    for k in range(1, iters + 1):
        d = client.step(k, 0.001)
        assert d.sync, d
        trainers.Barrier()
        client.reset(k, 0.0)
    others.Barrier()   # the outsider's messages were all received before anyone shuts down
    client.shutdown()


def load() -> None:
    """Every non-zero rank sends ``queries`` steps; replies must match one-to-one."""
    import resource

    o = _args()
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
