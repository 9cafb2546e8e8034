"""Single-process tests of mpsync.torch pieces that need no communicator."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from mpsync.config import ConfigError
from mpsync.server import DeadlineExceeded
import mpsync.torch as mps
from mpsync.torch import CollectiveTimeout
from mpsync.torch.dataplane.fusion import FusionBuffer, group_by_dtype, layer_name
from mpsync.torch.optimizer import name_parameters


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_layer_names_group_a_modules_parameters():
    assert layer_name("encoder.fc1.weight") == "encoder.fc1"
    assert layer_name("bias") == "bias"


def test_fusion_buffer_layout_keeps_each_layer_contiguous():
    m = small_model()
    named = list(m.named_parameters())
    # Interleave the order: layer 0's bias after layer 2's weight.
    named = [named[0], named[2], named[1], named[3]]
    buf = FusionBuffer([p for _, p in named], [n for n, _ in named])
    assert buf.layer_names == ["0", "2"]
    assert buf.layer_sizes.tolist() == [3 * 4 + 4, 4 * 2 + 2]
    assert buf.layer_bounds.tolist() == [[0, 16], [16, 26]]
    buf.pack_params()
    assert torch.equal(buf.flat[:12], m[0].weight.reshape(-1))
    assert torch.equal(buf.flat[12:16], m[0].bias)


def test_pack_and_unpack_round_trip_and_missing_grads_are_zeros():
    m = small_model()
    buf = group_by_dtype(list(m.named_parameters()))[0]
    m(torch.randn(5, 3)).sum().backward()
    m[2].bias.grad = None
    flat = buf.pack_grads().clone()
    assert torch.equal(flat[-2:], torch.zeros(2))
    buf.flat.mul_(2)
    buf.unpack_to_grads()
    assert torch.equal(m[0].weight.grad.reshape(-1), flat[:12] * 2)
    assert torch.equal(m[2].bias.grad, torch.zeros(2))


def test_bound_gradients_live_in_the_fusion_buffer_and_survive_set_to_none():
    m = small_model()
    buf = group_by_dtype(list(m.named_parameters()))[0]
    buf.bind_grads()
    x = torch.randn(5, 3)
    m(x).sum().backward()  # accumulates in place into the views
    assert buf.all_bound()
    expected = torch.cat([p.grad.reshape(-1).clone() for p in m.parameters()])
    assert torch.equal(buf.pack_grads(), expected)
    m.zero_grad(set_to_none=True)  # unbinds
    m(x).sum().backward()
    assert not buf.all_bound()
    assert torch.equal(buf.pack_grads(), expected)  # copied in
    buf.unpack_to_grads()  # binds again without copying
    assert buf.all_bound()


def test_gather_and_scatter_of_layer_ranges_are_inverse():
    m = small_model()
    buf = group_by_dtype(list(m.named_parameters()))[0]
    flat = torch.arange(float(buf.numel))
    ranges = buf.layer_ranges(np.array([False, True]))
    assert ranges == [(16, 26)]
    part = buf.gather(flat, ranges)
    assert torch.equal(part, torch.arange(16.0, 26.0))
    out = torch.zeros_like(flat)
    buf.scatter(part, out, ranges)
    assert torch.equal(out[16:], part) and not out[:16].any()
    slots = buf.slots_in(ranges)
    assert [(s.name, pos) for s, pos in slots] == [("2.weight", 0), ("2.bias", 8)]
    with pytest.raises(ValueError, match="layer mask"):
        buf.layer_ranges(np.array([True]))


def test_fusion_buffer_refuses_mixed_dtypes_but_grouping_splits_them():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="one dtype"):
        FusionBuffer([a, b], ["a", "b"])
    assert [g.dtype for g in group_by_dtype([("a", a), ("b", b)])] == [torch.float32,
                                                                       torch.float64]


def test_named_parameters_are_checked_like_horovod():
    m = small_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    named = name_parameters(opt, m.named_parameters())
    assert [n for n, _ in named] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    with pytest.raises(ValueError, match="duplicate names"):
        name_parameters(opt, [("w", p) for p in m.parameters()])
    with pytest.raises(ValueError, match="not in named_parameters"):
        name_parameters(opt, list(m.named_parameters())[:2])
    with pytest.raises(ValueError, match="pairs"):
        name_parameters(opt, list(m.parameters()))


def test_collective_timeout_names_workers_and_world_ranks():
    e = CollectiveTimeout("mpi gradients (collective #7)", 5.0, [2], [3])
    assert "no word from worker 2 (world rank 3)" in str(e)
    assert e.silent_ranks == [2] and list(e.ranks) == [3]
    assert isinstance(e, DeadlineExceeded) and isinstance(e, TimeoutError)


@pytest.mark.parametrize("options,match", [
    (dict(policy="asp", topology="ring"), "topology='ps'"),
    (dict(policy="nope"), "unknown policy"),
    (dict(backend="tcp"), "unknown backend"),
    (dict(staleness_low=5, staleness_high=2), "s_L=5 > s_U=2"),
])
def test_init_rejects_bad_settings_before_touching_mpi(options, match):
    with pytest.raises(ConfigError, match=match):
        mps.init(**options)
    assert not mps.is_initialized()


@pytest.mark.parametrize("options", [dict(policy="bsp", topology="ring"),
                                     dict(policy="asp", topology="ps"),
                                     dict(policy="esync", topology="ps")])
def test_init_names_missing_horovod(monkeypatch, options):
    # Horovod is installed here; hide it from the lookup init makes.  The PS topology imports
    # Horovod too (its barriers and broadcasts), so it must be checked there as well.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "horovod" else real(name, *a))
    with pytest.raises(ConfigError, match="Horovod is not installed"):
        mps.init(backend="horovod", **options)
    assert not mps.is_initialized()


def test_frozen_parameters_get_no_gradient():
    m = small_model()
    m[0].weight.requires_grad_(False)
    buf = group_by_dtype(list(m.named_parameters()))[0]
    buf.bind_grads()
    assert m[0].weight.grad is None and m[0].bias.grad is not None
    m(torch.randn(2, 3)).sum().backward()
    assert buf.all_bound()
