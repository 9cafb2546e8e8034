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
    o = _args()
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


def _fuzz_strategy(worker: bool):
    """Hypothesis strategy of one fuzz message: ``(tag, payload)`` with payload a float64 or
    int32 array or bytes.  Headers mix valid integers with NaN, inf, negatives, fractions and
    huge values in every slot.  For a worker rank (whose well-formed pushes the server applies)
    every float64 DATA payload is made of zeros and non-finite values only, so an accepted
    fuzz push adds exactly 0 and the honest clients can check their weights exactly; DATA of
    other types is never 128 bytes (the model's 16 float64).  Shutdown is left out for the
    worker rank: it would legitimately end that rank's membership."""
    from hypothesis import strategies as st

    from mpsync.server import wire as W

    nan, inf = float("nan"), float("inf")
    specials = st.sampled_from([nan, inf, -inf, -1.0, 0.5, -0.0, 1e300, 2.0 ** 53, 2.0 ** 60])
    slot = st.one_of(st.integers(0, 40).map(float), specials, st.floats())
    count = st.one_of(st.sampled_from([0.0, 1.0, 16.0, 17.0, 2.0 ** 31 + 1, -1.0, nan, 1.5]),
                      slot)
    flag = st.sampled_from([0.0, 1.0, 2.0, 0.5, nan])
    request_tags = [t for t in W.REQUEST_TAGS if not (worker and t == W.SHUTDOWN)]
    tag = st.one_of(st.sampled_from(request_tags), st.sampled_from(
        [W.DATA, W.REPLY, W.REPLY_DATA, W.REPLY_STATS]), st.integers(0, 32767).filter(
        lambda t: not (worker and t == W.SHUTDOWN)))
    # SEQ "unique" is replaced by a fresh number when sent (replies must echo it).
    seq = st.one_of(st.just(None), st.sampled_from([nan, -1.0, 0.5, 2.0 ** 60, inf]))
    header = st.tuples(st.sampled_from(request_tags), seq, slot, slot, slot, slot, slot,
                       count, flag).map(lambda t: (t[0], [t[1]] + list(t[2:])))
    data_value = st.sampled_from([0.0, -0.0, nan, inf, -inf]) if worker else st.floats()
    data = st.tuples(st.just(W.DATA), st.lists(data_value, max_size=40).map(
        lambda v: np.array(v, dtype=np.float64)))
    raw_floats = st.tuples(tag, st.lists(st.floats(), max_size=40).map(
        lambda v: np.array(v, dtype=np.float64))).filter(
        lambda m: not (worker and m[0] == W.DATA))
    raw_bytes = st.tuples(tag, st.binary(max_size=300))
    raw_int32 = st.tuples(tag, st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=40).map(
        lambda v: np.array(v, dtype=np.int32)))
    typed = st.one_of(raw_bytes, raw_int32).filter(
        lambda m: not (worker and m[0] == W.DATA and len(memoryview(m[1]).cast("B")) == 128))
    return st.one_of(header, header, data, data, raw_floats, typed)


def fuzz() -> None:
    """Property-based fuzzing of a live server: rank 0 serves asp on the PS;
    the two last ranks send hypothesis-generated messages (random tags, sizes, types and
    payloads), one of them a worker of the server, the other a rank the server does not know;
    the other ranks are well-formed clients that check every model they pull."""
    from hypothesis import HealthCheck, Phase, seed, settings
    from hypothesis import given, strategies as st

    from mpsync.server import wire as W

    o = _args()
    world = MPI.COMM_WORLD
    control = world.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    others = world.Split(0 if rank == 0 else 1, rank)   # every rank but the server
    per_fuzzer = int(o.get("n", "5000"))
    iters = int(o.get("iters", "300"))
    cfg = SyncConfig.from_options(env={}, policy="asp", topology="ps", deadline=60.0,
                                  silent_timeout=120.0)
    fuzz_worker, fuzz_outsider = size - 2, size - 1
    honest = list(range(1, size - 2))
    if rank == 0:
        log_lines = []
        srv = StateServer(control, cfg, workers=honest + [fuzz_worker], log=log_lines.append)
        stats = srv.serve()
        with open(o["out"], "w") as f:
            json.dump({"rejected": stats["rejected_messages"], "log": log_lines,
                       "ps_version": stats["ps_version"], "workers": sorted(stats["workers"]),
                       "pushes": {r: w["pushes"] for r, w in stats["workers"].items()}}, f)
        return
    delta = {r: np.full(16, 1000.0 ** i) for i, r in enumerate(honest)}  # 1, 1000, ...
    if rank in (fuzz_worker, fuzz_outsider):
        worker = rank == fuzz_worker
        client = SyncClient(control, cfg) if worker else None
        others.Barrier()   # the model is initialised: no fuzz ps_init can replace it
        st_ = MPI.Status()
        echo_ok = {1.0}    # sequence numbers a reply may carry (1: this rank's register)
        replies = [0]
        next_seq = [10.0 ** 6]

        def drain():
            while control.Iprobe(0, MPI.ANY_TAG, st_):
                buf = bytearray(max(st_.Get_count(MPI.BYTE), 1))
                tag = st_.Get_tag()
                control.Recv([buf, MPI.BYTE], source=0, tag=tag)
                if tag == W.REPLY:
                    replies[0] += 1
                    rep_seq = np.frombuffer(bytes(buf[:64]), dtype=np.float64)[W.R_SEQ]
                    assert rep_seq in echo_ok, f"reply to request {rep_seq}, never sent"
                    last_reply[0] = rep_seq

        last_reply = [None]

        def send(tag, payload):
            if isinstance(payload, list):           # a header: fill in a fresh SEQ
                if payload[0] is None:
                    payload[0] = next_seq[0]
                    next_seq[0] += 1
                payload = np.array(payload, dtype=np.float64)
            raw = bytes(payload) if isinstance(payload, bytes) else payload.tobytes()
            if len(raw) == 64:   # anything of a header's size may be read as one
                echo_ok.add(float(np.frombuffer(raw, dtype=np.float64)[0]))
            if tag == W.DATA:
                since_data[0] = 0
            elif tag in (W.PUSH, W.PS_INIT, W.IMPORTANCE):
                since_data[0] += 1
            mpi_type = (MPI.BYTE if isinstance(payload, bytes) else
                        MPI.INT if payload.dtype == np.int32 else MPI.DOUBLE)
            req = control.Isend([payload, mpi_type], dest=0, tag=tag)
            while not req.Test():
                drain()
            drain()

        sent = [0]
        since_data = [0]   # payload headers sent since the last DATA message
        strategy = st.lists(_fuzz_strategy(worker), min_size=20, max_size=40)
        round_ = 0
        while sent[0] < per_fuzzer:
            @seed(1000 * rank + round_)
            @settings(max_examples=max(1, (per_fuzzer - sent[0]) // 30 + 1), database=None,
                      deadline=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(strategy)
            def run(batch):
                for tag, payload in batch:
                    send(tag, payload)
                    sent[0] += 1
            run()
            round_ += 1
        # A payload header still waiting for its DATA gets one (the server waits for it up to
        # the deadline); then a marker request, answered after everything sent before it.
        for _ in range(since_data[0] + 1):
            send(W.DATA, np.zeros(0))
        marker = 2.0 ** 50
        echo_ok.add(marker)
        send(W.STEP, np.array([marker, 0, 0, 0, 0, 0, 0, 0], dtype=np.float64))
        if worker:
            deadline = time.monotonic() + 60
            while last_reply[0] != marker:
                assert time.monotonic() < deadline, "no answer to the marker request"
                drain()
                time.sleep(1e-4)
        else:
            time.sleep(0.5)
            drain()
            assert replies[0] == 0, f"the server answered a non-worker {replies[0]} times"
        print(f"fuzzer rank {rank} sent {sent[0]} messages, {replies[0]} replies", flush=True)
        others.Barrier()   # fuzzing over
        others.Barrier()   # the honest clients checked the final model
        if client is not None:
            client.shutdown()
        return
    client = SyncClient(control, cfg)
    model = np.zeros(16)
    if rank == honest[0]:
        client.ps_init(model)
    others.Barrier()
    client.pull(model, 0)
    me = honest.index(rank)
    seen = np.zeros(len(honest), dtype=np.int64)
    versions = []

    def decode(m):
        """The pushes of each honest rank in the model: a + 1000 b + ..., all < 1000."""
        assert np.all(m == m[0]), f"coordinates differ: {m}"
        v, counts = int(m[0]), []
        assert v == m[0], f"not an integer: {m[0]!r}"
        for _ in honest:
            v, c = divmod(v, 1000)
            counts.append(c)
        assert v == 0, m
        return np.array(counts)

    for k in range(1, iters + 1):
        d = client.step(k, 0.0001)
        assert d.sync, d
        v = client.push(delta[rank], k)
        versions.append(v)
        v = client.pull(model, k)
        # The model is the initial one (0) plus every accepted push: this rank's k pushes, the
        # others' so far (never fewer than seen before), the fuzzer's accepted ones (all 0).
        counts = decode(model)
        assert counts[me] == k, (k, counts)
        assert np.all(counts >= seen), (seen, counts)
        assert v >= counts.sum(), (v, counts)
        seen = counts
    assert versions == sorted(versions), "model versions went backwards"
    others.Barrier()   # fuzzing over
    client.pull(model, iters + 1, final=True)
    assert np.array_equal(decode(model), np.full(len(honest), iters)), decode(model)
    others.Barrier()
    client.shutdown()
    print(f"honest rank {rank} ok, last version {versions[-1]}")


def outsider() -> None:
    """Rank 0 serves bsp for workers 1..size-2; the last rank is not one of its workers and
    sends well-formed requests anyway: each must be dropped (no reply), logged once.  The
    server also writes its stats and Chrome trace through the public writers."""
    from mpsync.server import wire as W
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


def late_payload() -> None:
    """A PS push header whose DATA comes late, then one whose DATA never comes (PS, asp):
    rank 1 keeps stepping, pushing and pulling meanwhile and times every answer; rank 2 sends
    the raw headers.  The server must go on serving rank 1, apply the late push when its DATA
    arrives, and drop the other header after ``deadline`` (args: hold=S deadline=S)."""
    from mpsync.server import wire as W

    o = _args()
    world = MPI.COMM_WORLD
    control = world.Dup()
    rank = world.Get_rank()
    others = world.Split(0 if rank == 0 else 1, rank)
    hold, deadline = float(o.get("hold", "1.5")), float(o.get("deadline", "2.0"))
    cfg = SyncConfig.from_options(env={}, policy="asp", topology="ps", deadline=deadline,
                                  silent_timeout=60.0)
    if rank == 0:
        logs = []
        stats = StateServer(control, cfg, log=logs.append).serve()
        with open(o["out"], "w") as f:
            json.dump({"log": logs, "ps_version": stats["ps_version"],
                       "pushes": {r: w["pushes"] for r, w in stats["workers"].items()},
                       "rejected": stats["rejected_messages"]}, f)
        return
    client = SyncClient(control, cfg)
    model = np.zeros(4)
    if rank == 1:
        client.ps_init(model)
    others.Barrier()
    if rank == 1:
        others.Barrier()   # rank 2's first header is on its way
        answers, k = [], 0
        end = time.perf_counter() + hold + deadline + 1.0
        while time.perf_counter() < end:
            k += 1
            t0 = time.perf_counter()
            client.step(k, 0.0)
            client.push(np.ones(4), k)
            client.pull(model, k)
            answers.append(time.perf_counter() - t0)
            time.sleep(0.01)
        print(f"rank 1: {k} iterations, slowest {max(answers) * 1e3:.1f} ms", flush=True)
        others.Barrier()
        client.pull(model, k + 1, final=True)
        with open(o["out"] + ".worker", "w") as f:
            json.dump({"iterations": k, "slowest_s": max(answers), "model": model.tolist()}, f)
    else:
        header = np.array([1000, 1, 0, 0, 0, 0, 4, 0], dtype=np.float64)
        reply = np.zeros(W.MSG_LEN)
        req = control.Irecv([reply, MPI.DOUBLE], source=0, tag=W.REPLY)
        control.Send([header, MPI.DOUBLE], dest=0, tag=W.PUSH)
        others.Barrier()
        time.sleep(hold)
        assert not req.Test(), "the push was answered before its payload was sent"
        control.Send([np.full(4, 100.0), MPI.DOUBLE], dest=0, tag=W.DATA)
        req.Wait()
        assert reply[W.R_SEQ] == 1000, reply
        # A header whose payload never comes: dropped after the deadline, never answered.
        header[W.SEQ] = 1001
        req = control.Irecv([reply, MPI.DOUBLE], source=0, tag=W.REPLY)
        control.Send([header, MPI.DOUBLE], dest=0, tag=W.PUSH)
        time.sleep(deadline + 0.5)
        assert not req.Test(), "a push without payload was answered"
        req.Cancel()
        req.Wait()
        others.Barrier()
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
