"""Smoke tests of ``mpsync bench allreduce`` and ``mpsync bench memory``: real mpirun jobs on
tiny sizes, each under a hard subprocess timeout (180 s), checking the JSON shapes the benchmarks promise
and the memory accounting's basic facts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from mpsync.bench.memory import CASES

ROW_KEYS = ("bytes", "mpsync_ms", "horovod_ms", "mpi_ms", "ps_ms", "ps_shard_ms", "ps_raw_ms",
            "ps_paced_ms", "ps_raw_paced_ms", "ps_ssp_ms", "ps_ssp_asked_ms", "ps_ssp_paced_ms",
            "ps_raw_apply_ms", "ps_raw_apply_paced_ms", "ps_vs_raw_apply", "ps_ssp_raw_ms",
            "ps_ssp_raw_paced_ms", "ps_ssp_asked_vs_raw")


def _bench(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpsync.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_bench_allreduce_json_is_a_list_of_rows():
    sizes = [4096, 65536]
    r = _bench(["allreduce", "--np", "2", "--sizes", ",".join(map(str, sizes)), "--json",
                "--max-repeats", "5", "--seconds-per-point", "0.2", "--timeout", "170",
                "--pace", "idle"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)  # the whole of stdout is the JSON list
    assert isinstance(rows, list) and [row["bytes"] for row in rows] == sizes
    for row in rows:
        assert row["ps_pace"] == "idle", row   # (compute, the default, elsewhere)
        for key in ROW_KEYS[1:]:
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)


def test_the_paced_exchanges_wait_by_sleeping_or_by_computing_on_the_callers_thread():
    from mpsync.bench.ps_exchange import PACES

    for pace, computes in (("idle", False), ("compute", True)):
        wall, cpu = time.perf_counter(), time.thread_time()
        PACES[pace](0.05)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        assert wall >= 0.05, (pace, wall)
        # this thread's CPU time: most of the pace computing (a loaded machine may take
        # some of its core), almost none sleeping
        assert (cpu > 0.3 * wall) if computes else (cpu < 0.1 * wall), (pace, wall, cpu)


def test_interleaved_timing_takes_turns_in_blocks_and_leaves_out_the_settling_calls():
    from mpi4py import MPI

    from mpsync.bench._timing import interleaved

    calls, befores, slow = [], [0], 0.02

    def method(name):
        def call():
            calls.append(name)
            # the first two calls of each turn are slow, as after another method's turn
            if calls[-3:-1] != [name, name]:
                time.sleep(slow)
        return call

    ms = interleaved(MPI.COMM_SELF, {"a": method("a"), "b": method("b")}, repeats=5,
                     before=lambda: befores.__setitem__(0, befores[0] + 1), block=4, settle=2)
    assert befores[0] == len(calls) == 24
    # 5 counted calls of each at 2 a turn: 3 turns of 4 calls each, a's before b's
    assert calls == (["a"] * 4 + ["b"] * 4) * 3, calls
    assert set(ms) == {"a", "b"} and all(0 <= v < 1e3 * slow / 4 for v in ms.values()), ms
    counted = interleaved(MPI.COMM_SELF, {"c": method("c")}, repeats=3, block=1)
    assert counted["c"] >= 1e3 * slow, counted   # without settling, the slow calls count
    with pytest.raises(ValueError, match="settle"):
        interleaved(MPI.COMM_SELF, {"c": method("c")}, repeats=3, block=2, settle=2)


def test_bench_memory_rows_per_policy():
    # One worker (2 ranks with the server) took 17-30 s on the shared 2-core machine (3 ranks:
    # 37 s); the buffers a worker holds do not depend on the number of workers.  The limits
    # leave room for a loaded machine: how long the bench takes is not what is tested.
    r = _bench(["memory", "--np", "1", "--layers", "2", "--width", "64", "--steps", "2",
                "--json", "--timeout", "170"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["case"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {c[0] for c in CASES}
    param_bytes = 2 * (64 * 64 + 64) * 4
    for case, row in rows.items():
        assert row["param_bytes"] == param_bytes, row
        assert row["extra_bytes"] >= 0 and row["rounds"] >= 1, row
        assert row["fusion_bytes"] == param_bytes, row  # one float32 buffer over all params
    bsp = rows["bsp"]
    # BSP's gradients live in the fusion buffer: beyond it only constant-size bookkeeping
    # (control-message buffers, layer tables: tens of bytes) is held.
    assert bsp["grads_in_fusion_buffer"] and bsp["extra_bytes"] <= bsp["fusion_bytes"], bsp
    assert bsp["extra_beyond_fusion_bytes"] == bsp["bookkeeping_bytes"] < 1024, bsp
    assert bsp["meets_target"], bsp
    # The walk must find the buffers that are known to exist: ESync's global model (a float32
    # copy besides the fusion buffer) and the PS base (in the model's dtype, float32 here).
    esync = rows["esync"]
    assert esync["extra_beyond_fusion_bytes"] >= param_bytes, esync
    assert rows["asp-ps"]["extra_beyond_fusion_bytes"] >= param_bytes, rows["asp-ps"]


def test_bench_startup_refuses_a_job_without_workers_before_launching():
    r = _bench(["startup", "--np", "1"], timeout=60)
    assert r.returncode == 2 and "--np must be >= 2" in r.stderr, r.stderr


def test_bench_startup_on_a_cluster_that_is_not_up_says_so():
    r = _bench(["startup", "--cluster", "nosuch", "--rounds", "1"], timeout=60)
    assert r.returncode == 2 and "cluster 'nosuch' is not up" in r.stderr, r.stderr


def test_bench_startup_names_a_program_it_does_not_know():
    r = _bench(["startup", "--programs", "floor,nonsense"], timeout=60)
    assert r.returncode == 2 and "unknown nonsense" in r.stderr, r.stderr
