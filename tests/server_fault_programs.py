"""Rank programs for the state-server tests that send it what a correct client never would:
random and malformed messages (fuzz), a rank that is no worker (outsider), a payload that
arrives late (late_payload).  Run through tests/mpi_harness.py, like tests/server_programs.py,
whose argument reader they share.
"""

from __future__ import annotations

import json
import time

import numpy as np
from mpi4py import MPI

from mpsync.config import SyncConfig
from mpsync.server import SyncClient, StateServer

from server_programs import program_args


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

    o = program_args()
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

    o = program_args()
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

    o = program_args()
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


def late_server() -> None:
    """The server starts ``late`` seconds after its workers, past their per-decision
    ``deadline`` but within ``startup_timeout``: every worker registers and takes its steps
    (args: late=S deadline=S startup=S)."""
    o = program_args()
    world = MPI.COMM_WORLD
    control = world.Dup()
    rank = world.Get_rank()
    late, deadline = float(o.get("late", "3")), float(o.get("deadline", "1"))
    cfg = SyncConfig.from_options(env={}, policy="bsp", topology="ring", deadline=deadline,
                                  startup_timeout=float(o.get("startup", "30")))
    if rank == 0:
        time.sleep(late)   # a slow start: imports and compiling on a busy node
        StateServer(control, cfg).serve()
        return
    started = time.perf_counter()
    client = SyncClient(control, cfg)
    waited = time.perf_counter() - started
    for k in range(1, 4):
        assert client.step(k, 0.001).sync
        client.reset(k, 0.0)
    # The steady deadline is back once registered: the start-up allowance was for the start.
    assert client.deadline == deadline, client.deadline
    client.shutdown()
    print(f"REGISTERED rank={rank} waited={waited:.2f}", flush=True)
