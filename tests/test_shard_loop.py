"""A PS shard's compiled request loop (``mpsync.server._shard_loop``), in one process: a shard
thread and a worker's client over ``COMM_SELF``, the compiled loop against the Python loop
on the same requests.  Multi-rank jobs through it are in test_ps_shards.py and the other PS
tests (every shard runs it where Open MPI is the MPI)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpsync.server import _fastpath, _shard_loop
from mpsync.server.shard_optimizer import OptimizerSettings, ServerUpdates
from mpsync.server.shard_server import (ACK, OK, PULL, PUSH, REFUSED, ShardServer, ShardThread,
                                        wire_code)
from mpsync.server.shards import ShardClient

pytestmark = pytest.mark.skipif(_shard_loop.unavailable_reason() is not None,
                                reason="the compiled loop binds Open MPI")


class _Shard:
    """A shard thread of ``n`` elements and this process's client of it (one worker)."""

    def __init__(self, n: int, dtype, *, compiled: bool, scale: float = 1.0,
                 deadline: float = 5.0, updates: ServerUpdates | None = None):
        self.requests, self.replies = MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()
        self.logs: list[str] = []
        self.server = ShardServer(self.requests, self.replies, 0, 1, scale, deadline=deadline,
                                  log=self.logs.append, compiled=compiled, updates=updates)
        if compiled:   # a cold cache compiles here, not within the client's deadline
            self.server._loop.warm_up(np.dtype(dtype), stepping=updates is not None)
        self.thread = ShardThread(self.server)
        self.client = ShardClient(self.requests, self.replies, [0], ["PS shard 0"], 10.0)
        self.dtype, self.n = np.dtype(dtype), n

    def raw_push(self, payload: np.ndarray, tag: int) -> np.ndarray:
        """Send ``payload`` as it is (no client check) and return the shard's ACK."""
        ack = np.zeros(2, np.int64)
        reply = self.replies.Irecv([ack, MPI.INT64_T], source=0, tag=ACK)
        self.requests.Send([payload, MPI.BYTE], dest=0, tag=tag)
        reply.Wait()
        return ack

    def pulled(self) -> np.ndarray:
        out = np.empty(self.n, self.dtype)
        self.client.pull(out)
        return out

    def close(self) -> dict:
        self.client.close()
        stats = self.thread.join(10.0)
        assert stats is not None, "the shard thread did not end after the goodbye"
        self.requests.Free()
        self.replies.Free()
        return stats


def _updates(n: int, dtype, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(n).astype(dtype) / 3 for _ in range(steps)]


def _push_and_read(shard: _Shard, step: int, update: np.ndarray) -> np.ndarray:
    """A push then a pull every third step, a push+pull otherwise: the weights read."""
    if step % 3 == 0:
        shard.client.push(update)
        return shard.pulled()
    out = np.empty(shard.n, shard.dtype)
    shard.client.push_pull(shard.client.checked_push(update), out)
    return out


def _serve_sequence(compiled: bool, dtype, scale: float) -> tuple[list, dict]:
    """INIT, then pushes, push+pulls and pulls in turn; every weight vector read."""
    n = 10_007
    shard = _Shard(n, dtype, compiled=compiled, scale=scale)
    shard.client.init(np.linspace(-1, 1, n).astype(dtype))
    reads = [_push_and_read(shard, step, delta)
             for step, delta in enumerate(_updates(n, dtype, 12))]
    return reads, shard.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_the_compiled_loop_serves_the_same_bits_as_the_python_loop(dtype, scale):
    compiled, stats = _serve_sequence(True, dtype, scale)
    python, python_stats = _serve_sequence(False, dtype, scale)
    assert stats["compiled_loop"] and not python_stats["compiled_loop"]
    # 4 pushes, 4 pulls and 8 push+pulls served without the interpreter (INIT: Python)
    assert stats["served_compiled"] == 16, stats
    assert stats["version"] == python_stats["version"] == 12
    assert stats["bytes_received"] == python_stats["bytes_received"]
    assert stats["bytes_sent"] == python_stats["bytes_sent"]
    for step, (a, b) in enumerate(zip(compiled, python)):
        assert np.array_equal(a, b), f"step {step}: the compiled loop's weights differ"


# The server-side optimizer per push, as ASP, SSP and DSSP run it.
OPTIMIZERS = [OptimizerSettings("sgd", lr=0.05),
              OptimizerSettings("sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
              OptimizerSettings("sgd", lr=0.05, momentum=0.8, dampening=0.3),
              OptimizerSettings("adam", lr=0.01, weight_decay=0.02),
              OptimizerSettings("adamw", lr=0.01, weight_decay=0.05, amsgrad=True)]


def _optimizer_sequence(compiled: bool, dtype, settings: OptimizerSettings):
    """The settings, INIT, then gradients pushed as in ``_serve_sequence`` with a refused one
    (NaN) among them; every weight vector read, then the optimizer's state saved."""
    n = 10_007
    shard = _Shard(n, dtype, compiled=compiled, updates=ServerUpdates(per_round=False))
    shard.client.configure(settings.to_array())
    shard.client.init(np.linspace(-1, 1, n).astype(dtype))
    reads, refused = [], []
    for step, grad in enumerate(_updates(n, dtype, 12)):
        if step == 5:
            bad = grad.copy()
            bad[n // 2] = np.nan
            refused.append(shard.raw_push(bad, PUSH + wire_code(dtype))[1])
        reads.append(_push_and_read(shard, step, grad))
    state = shard.client.optimizer_state(dtype)
    return reads, state, refused, shard.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("settings", OPTIMIZERS, ids=lambda s: (
    f"{s.kind}-m{s.momentum:g}{'-nesterov' if s.nesterov else ''}"
    f"{'-amsgrad' if s.amsgrad else ''}"))
def test_the_server_optimizer_steps_in_the_compiled_loop_to_the_python_loops_bits(
        dtype, settings):
    compiled, state, refused, stats = _optimizer_sequence(True, dtype, settings)
    python, python_state, python_refused, python_stats = \
        _optimizer_sequence(False, dtype, settings)
    assert refused == python_refused == [REFUSED]
    # The first push makes the optimizer's state (Python's); the other 11 pushes, 8 of them
    # with their pull, and the 4 pulls alone are the compiled loop's.
    assert stats["served_compiled"] == 11 + 4, stats
    assert python_stats["served_compiled"] == 0
    assert stats["version"] == python_stats["version"] == 12
    assert stats["dropped"] == python_stats["dropped"] == 1
    for step, (a, b) in enumerate(zip(compiled, python)):
        assert np.array_equal(a, b), f"step {step}: the compiled loop's weights differ"
    assert not np.array_equal(compiled[-1], compiled[-2])
    assert state["steps"] == python_state["steps"] == 12 and state.keys() == python_state.keys()
    for name in state.keys() - {"kind", "steps"}:
        assert np.array_equal(state[name], python_state[name]), name


def test_a_push_with_nan_or_inf_is_refused_and_leaves_the_weights_untouched():
    n = 5_003
    shard = _Shard(n, np.float32, compiled=True)
    shard.client.init(np.ones(n, np.float32))
    before = shard.pulled()
    tag = PUSH + wire_code(np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        delta = np.full(n, 0.25, np.float32)
        delta[n - 1] = bad          # the last element: the whole pass ran before it was seen
        version, status = shard.raw_push(delta, tag)
        assert status == REFUSED and version == 0
        assert np.array_equal(shard.pulled(), before)
    version, status = shard.raw_push(np.full(n, 0.25, np.float32), tag)   # it serves on
    assert (version, status) == (1, OK)
    assert np.array_equal(shard.pulled(), before + np.float32(0.25))
    stats = shard.close()
    assert stats["dropped"] == 3
    assert sum("refused the push of worker 0: push with NaN or inf" in line
               for line in shard.logs) == 3, shard.logs


def test_a_push_of_the_wrong_size_goes_to_the_python_loop_and_is_refused_naming_it():
    shard = _Shard(1_000, np.float32, compiled=True)
    shard.client.init(np.zeros(1_000, np.float32))
    version, status = shard.raw_push(np.ones(999, np.float32), PUSH + wire_code(np.float32))
    assert status == REFUSED
    shard.client.push(np.ones(1_000, np.float32))      # and the compiled loop serves on
    assert np.array_equal(shard.pulled(), np.ones(1_000, np.float32))
    shard.close()
    assert any("push before ps_init or of the wrong length" in line for line in shard.logs), \
        shard.logs


def test_a_pull_in_another_dtype_is_served_by_the_python_loop_cast():
    shard = _Shard(2_000, np.float32, compiled=True)
    weights = np.linspace(0, 1, 2_000).astype(np.float32)
    shard.client.init(weights)
    out = np.empty(2_000, np.float64)
    pull_arg = np.zeros(1, np.int64)
    reply = shard.replies.Irecv([out, MPI.BYTE], source=0)
    shard.requests.Send([pull_arg, MPI.INT64_T], dest=0, tag=PULL + wire_code(np.float64))
    reply.Wait()
    assert np.array_equal(out, weights.astype(np.float64))
    assert shard.close()["served_compiled"] == 0


def test_the_compiled_loop_records_who_it_heard_and_when_the_next_push_is_due():
    shard = _Shard(1_000, np.float32, compiled=True)
    server = shard.server
    shard.client.init(np.zeros(1_000, np.float32))
    for _ in range(4):                 # a push every 20 ms, as between a job's iterations
        time.sleep(0.02)
        before = time.monotonic()
        shard.client.push(np.ones(1_000, np.float32))
        assert before <= server.heard[0] <= time.monotonic()
    assert server.stats()["served_compiled"] >= 4
    # the next push is expected one interval (~20 ms) after the last one
    due_in = server._next_due - time.perf_counter()
    assert 0.0 < due_in < 0.05, due_in
    assert server.silent_workers() == []
    shard.close()


def test_how_late_sleeps_wake_is_the_largest_recent_overshoot_decaying_per_sleep():
    # (the shards' loops and the state server's loop share it)
    for late_wake in (_fastpath.late_wake, _fastpath.late_wake.py_func):
        assert late_wake(0.0, 3e-3) == 3e-3                 # a late wake is taken at once
        assert late_wake(3e-3, 1e-4) == pytest.approx(3e-3 * _fastpath.LATE_DECAY)
        estimate = 5e-3
        for _ in range(300):                                # then forgotten, sleep by sleep
            estimate = late_wake(estimate, 1e-4)
        assert estimate == 1e-4


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_shard_polls_for_a_due_push_as_early_as_its_sleeps_have_been_waking_late(compiled):
    # Beside a trainer computing on its core a shard's sleep wakes milliseconds late, and a
    # push due meanwhile waits for it: the window before a due push in which the shard polls
    # (and never sleeps) widens by how late its sleeps have been waking.
    shard = _Shard(1_000, np.float32, compiled=compiled)
    shard.client.init(np.zeros(1_000, np.float32))
    times, late = shard.server._times, _shard_loop.T_LATE_WAKE
    time.sleep(0.05)                    # idle, nothing due: it sleeps, and measures its wakes
    assert 0.0 < times[late] < 0.05
    times[_shard_loop.T_NEXT_DUE] = time.monotonic() + 0.5   # a push due in 0.5 s
    for _ in range(2):                  # (again after any sleep begun before, which decays it)
        times[late] = 1.0               # its sleeps wake 1 s late: the push is within reach
        time.sleep(0.02)
    time.sleep(0.2)
    assert times[late] == 1.0, "the shard slept with the push due within its late wake"
    times[late] = 0.0                   # they wake on time: 0.25 s ahead, it sleeps again
    deadline = time.monotonic() + 0.2
    while times[late] == 0.0:
        assert time.monotonic() < deadline, "the shard did not sleep with nothing due soon"
        time.sleep(0.005)
    shard.close()


def test_a_pull_reply_nobody_takes_is_cancelled_at_the_deadline_and_the_shard_serves_on():
    n = 1 << 20        # 4 MB: a rendezvous send, which completes only once it is received
    shard = _Shard(n, np.float32, compiled=True, deadline=0.5)
    shard.client.init(np.zeros(n, np.float32))
    # a pull whose worker gave up: no receive is posted for its reply
    shard.requests.Send([np.zeros(1, np.int64), MPI.INT64_T], dest=0,
                        tag=PULL + wire_code(np.float32))
    deadline = time.monotonic() + 10
    while not any("did not take its pull reply" in line for line in shard.logs):
        assert time.monotonic() < deadline, shard.logs
        time.sleep(0.05)
    # it serves on (that worker gave up and asks it nothing more: another push is ACKed)
    assert tuple(shard.raw_push(np.ones(n, np.float32), PUSH + wire_code(np.float32))) == (1, OK)
    stats = shard.close()
    assert stats["dropped"] == 1 and stats["version"] == 1
    assert np.array_equal(shard.server.store.weights, np.ones(n, np.float32))


def test_without_the_compiled_loop_a_shard_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(_shard_loop, "unavailable_reason", lambda: "this is not Open MPI")
    requests = MPI.COMM_SELF.Dup()
    logs: list[str] = []
    server = ShardServer(requests, requests, 3, 1, 1.0, log=logs.append)
    assert logs == ["mpsync PS shard 3: no compiled loop (this is not Open MPI); the Python "
                    "loop serves"]
    assert not server.stats()["compiled_loop"]
    requests.Free()


def test_a_warm_up_long_enough_to_be_a_compile_says_so_and_either_way_marks_the_shard_warm(
        monkeypatch):
    from mpsync.server import shard_server

    requests = MPI.COMM_SELF.Dup()
    for note_s, lines in ((60.0, 0), (0.0, 1)):   # a load from the cache; as if a compile
        monkeypatch.setattr(shard_server, "COMPILE_NOTE_S", note_s)
        logs: list[str] = []
        server = ShardServer(requests, requests, 2, 1, 1.0, log=logs.append)
        assert not server.warmed.is_set()
        took = server.warm_up()
        assert server.warmed.is_set() and took >= 0
        assert len(logs) == lines, logs
    assert logs[0].startswith("mpsync PS shard 2: compiled its loop in ") and \
        "mpsync doctor --warm" in logs[0], logs
    requests.Free()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_in_place_add_refuses_a_bad_value_anywhere_and_adds_numpys_bits_otherwise(dtype):
    # The check reads the whole delta before the add (no early exit, so that it vectorizes):
    # a bad value in the first, a middle or the last element still leaves the weights as
    # they were, and a finite delta adds the bits numpy's ``weights + delta * scale`` gives.
    rng = np.random.default_rng(3)
    n = 10_007                                     # not a multiple of any vector width
    weights = rng.standard_normal(n).astype(dtype)
    delta = (rng.standard_normal(n) * 1e-3).astype(dtype)
    for scale in (1.0, 0.25):
        s = np.array([scale], dtype=dtype)
        for at in (0, n // 2, n - 1):
            for bad in (np.nan, np.inf, -np.inf):
                poisoned, before = delta.copy(), weights.copy()
                poisoned[at] = bad
                assert not _shard_loop.add_checked_in_place(weights, poisoned, s)
                assert np.array_equal(weights, before)
        expected = weights + delta * s[0] if scale != 1.0 else weights + delta
        assert _shard_loop.add_checked_in_place(weights, delta, s)
        np.testing.assert_array_equal(weights, expected)
