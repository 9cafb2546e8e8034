"""A bfloat16 model on the parameter server: stored as float32, on the wire as bfloat16
(``weights.BFLOAT16``, the bits of each value), half the bytes it took as float32.  The casts
(numpy's and torch's, bit for bit), the finiteness check on the bits, a shard in one process
over ``COMM_SELF``, and the bytes counted on real ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpsync.server.shard_optimizer import OptimizerSettings, ServerUpdates
from mpsync.server.shard_server import (ACK, INIT, OK, REFUSED, ShardServer, ShardThread,
                                        wire_code)
from mpsync.server.shards import ShardClient
from mpsync.server.weights import BFLOAT16, all_finite, numpy_cast
from mpsync.torch._runtime import torch_cast
from mpi_harness import run_mpi


def _bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint16)


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(20_000) * 10.0 ** rng.integers(-44, 38, 20_000)) \
        .astype(np.float32)
    ties = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00000001, 0x7F7FFFFF],
                    np.uint32).view(np.float32)       # halfway down, halfway up, subnormal, max
    values[:5] = ties
    values[5:9] = (np.inf, -np.inf, 0.0, -0.0)
    return values


def test_numpy_and_torch_round_to_the_same_bfloat16_bits_and_back_exactly():
    values = _values()
    wires = [np.empty(values.size, BFLOAT16) for _ in range(2)]
    for cast, wire in zip((numpy_cast, torch_cast), wires):
        cast(wire, values)
    assert np.array_equal(_bits(wires[0]), _bits(wires[1]))
    # round to nearest even: 1.00390625 (a tie) down to 1.0, 1.01171875 (a tie) up
    assert list(_bits(wires[0])[:3]) == [0x3F80, 0x3F82, 0x3F81]
    assert _bits(wires[0])[4] == 0x7F80            # float32's largest rounds up to inf
    reference = torch.from_numpy(values).to(torch.bfloat16)
    for dtype in (np.float32, np.float64):
        for cast in (numpy_cast, torch_cast):
            back = np.empty(values.size, dtype)
            cast(back, wires[0])
            assert np.array_equal(back, reference.to(torch.float64).numpy().astype(dtype))
    nan = np.empty(1, BFLOAT16)
    numpy_cast(nan, np.array([np.nan], np.float32))
    back = np.empty(1, np.float32)
    numpy_cast(back, nan)
    assert np.isnan(back[0])


def test_the_finiteness_check_reads_bfloat16_bits():
    wire = np.empty(4_099, BFLOAT16)
    numpy_cast(wire, np.linspace(-3e38, 3e38, 4_099).astype(np.float32))
    assert all_finite(wire) and all_finite(wire[:0])
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 2_048, 4_098):
            spoiled = wire.copy()
            numpy_cast(spoiled[at:at + 1], np.array([bad], np.float32))
            assert not all_finite(spoiled), (bad, at)


class _Shard:
    """A float32 shard and one worker's client of it with a bfloat16 wire (one process)."""

    def __init__(self, n: int, updates=None, compiled: bool = True):
        self.requests, self.replies = MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()
        self.logs: list[str] = []
        self.server = ShardServer(self.requests, self.replies, 0, 1, 1.0, log=self.logs.append,
                                  updates=updates, cast=torch_cast, compiled=compiled)
        if compiled:   # a cold cache compiles here, not within the client's deadline
            self.server._loop.warm_up(np.float32, stepping=updates is not None)
        self.thread = ShardThread(self.server)
        self.client = ShardClient(self.requests, self.replies, [0], ["PS shard 0"], 10.0,
                                  cast=torch_cast)
        self.n = n

    def close(self) -> dict:
        self.client.close()
        stats = self.thread.join(10.0)
        self.requests.Free()
        self.replies.Free()
        return stats


def _bf16(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to bfloat16, as float32."""
    return torch.from_numpy(values).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("optimizer", [None, "adam"])
def test_a_shard_takes_bfloat16_pushes_into_its_float32_weights_and_sends_them_rounded(
        optimizer, compiled):
    n = 3_001
    rng = np.random.default_rng(5)
    start = _bf16(rng.standard_normal(n).astype(np.float32))
    updates = None if optimizer is None else ServerUpdates(per_round=False)
    shard = _Shard(n, updates, compiled)
    if updates is not None:
        shard.client.configure(OptimizerSettings(optimizer, lr=1e-2).to_array())
    shard.client.init(start)                    # the store's dtype: float32
    shard.client.wire = BFLOAT16
    expected = start.copy()
    reference = None
    if updates is not None:
        reference = ServerUpdates(per_round=False)
        reference.configure(OptimizerSettings(optimizer, lr=1e-2).to_array())
    for step in range(6):
        delta = rng.standard_normal(n).astype(np.float32) / 7
        wire = shard.client.checked_push(delta)
        assert wire.dtype == BFLOAT16 and wire.nbytes == 2 * n
        out = np.empty(n, np.float32)
        if step % 2:
            shard.client.push_pull(wire, out)
        else:
            shard.client.push(delta)
            shard.client.pull(out)
        # the shard added (or stepped on) the bfloat16 rounding of the delta, in float32
        if reference is None:
            expected += _bf16(delta)
        else:
            reference.take(expected, _bf16(delta), 0)
        assert np.array_equal(out, _bf16(expected)), step
    assert np.array_equal(shard.server.store.weights, expected)
    # bfloat16 initial weights are refused (the store would lose its float32), named
    ack = np.zeros(2, np.int64)
    reply = shard.replies.Irecv([ack, MPI.INT64_T], source=0, tag=ACK)
    shard.requests.Send([np.zeros(4, np.uint16), MPI.BYTE], dest=0,
                        tag=INIT + wire_code(BFLOAT16))
    reply.Wait()
    assert ack[1] == REFUSED
    # the initial weights as float32, then 6 pushes and 6 pulls of 2 bytes a value
    assert (shard.client.bytes_sent, shard.client.bytes_received) == (4 * n + 12 * n, 12 * n)
    stats = shard.close()
    # compiled: 3 pushes and 3 pulls, 3 push+pulls, less Adam's first push (it makes the
    # optimizer's state, in Python); every value above was checked against the rounding
    served = 9 - (optimizer is not None) if compiled else 0
    assert stats["served_compiled"] == served, stats
    assert any("bfloat16 initial weights" in line for line in shard.logs), shard.logs


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["bfloat16", "auto"])
def test_a_bfloat16_model_trains_on_the_ps_on_a_bfloat16_wire_across_nodes(wire):
    # ``auto`` on one host: float32, whose copies cost less than the conversions; the
    # bfloat16 wire is forced as the shards spanning nodes choose it (the program checks
    # every byte count and that the model trained, in bfloat16).
    run = run_mpi("ps_programs:bytes_accounted", np=4, timeout=180,
                  args=["bf16=1", f"bf16_wire={'auto' if wire == 'auto' else '1'}"])
    res = run.results()
    assert len(res) == 3, run.report()
    each = 2 if wire == "bfloat16" else 4
    assert all(r["data_received"] == 7 * 1020 * each for r in res.values()), res


@pytest.mark.parametrize("nodes, dtype, expected", [
    (2, torch.bfloat16, BFLOAT16), (1, torch.bfloat16, None), (2, torch.float32, None)])
def test_a_bfloat16_model_goes_on_a_bfloat16_wire_where_the_shards_span_nodes(
        nodes, dtype, expected):
    from types import SimpleNamespace

    from mpsync.torch.strategies.ps import ParameterServer

    strategy = SimpleNamespace(bfloat16_wire=None, wire=None,
                               buf=SimpleNamespace(flat=torch.zeros(4, dtype=dtype)),
                               client=SimpleNamespace(shards=SimpleNamespace(nodes=nodes)))
    assert ParameterServer._wire_dtype(strategy) == expected
    strategy.bfloat16_wire = False          # the class attribute forces it either way
    assert ParameterServer._wire_dtype(strategy) is None
    strategy.bfloat16_wire = True
    assert ParameterServer._wire_dtype(strategy) == (BFLOAT16 if dtype == torch.bfloat16
                                                     else None)
