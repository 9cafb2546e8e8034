"""BSP's gradient buckets started during backward (mpsync.torch.dataplane.buckets): how they
are cut, that they start before backward ends, and that they give the weights of the whole
model averaged at step()."""

from __future__ import annotations

import pytest
import torch

from mpi_harness import run_mpi
from mpsync.torch.dataplane.buckets import plan_buckets
from mpsync.torch.dataplane.fusion import FusionBuffer


def _buffer(sizes, header=0, frozen=()):
    params = [torch.zeros(n, requires_grad=i not in frozen) for i, n in enumerate(sizes)]
    buf = FusionBuffer(params, [f"layer{i}.weight" for i in range(len(sizes))])
    if header:
        buf.add_header(header)
    return buf, params


def _ids(buckets, params):
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b.params] for b in buckets]


def test_buckets_are_cut_from_the_last_parameter_and_cover_the_wire_once():
    buf, params = _buffer([10, 20, 30, 40], header=3)
    buckets = plan_buckets([buf], cap_bytes=50 * 4)
    # Walking from the last parameter: [40] and the header (43 elements; 30 more would pass
    # the cap of 50), [30, 20] (exactly 50), [10].
    assert _ids(buckets, params) == [[3], [2, 1], [0]]
    assert [(b.start, b.stop) for b in buckets] == [(60, 103), (10, 60), (0, 10)]
    assert [b.payload for b in buckets] == [40, 50, 10]
    assert [b.has_header for b in buckets] == [True, False, False]
    # The bucket slices are views of the wire: what backward writes, the collective reduces.
    assert buckets[0].wire.data_ptr() == buf.wire[60:].data_ptr()


def test_a_parameter_larger_than_the_cap_is_a_bucket_of_its_own():
    buf, params = _buffer([5, 100, 5])
    buckets = plan_buckets([buf], cap_bytes=16 * 4)
    assert _ids(buckets, params) == [[2], [1], [0]]


def test_one_bucket_when_the_cap_holds_the_model_and_frozen_parameters_count_as_ready():
    buf, params = _buffer([4, 4, 4], frozen=(1,))
    (bucket,) = plan_buckets([buf], cap_bytes=2**20)
    assert (bucket.start, bucket.stop, bucket.expected) == (0, 12, 2)


def test_a_bucket_size_of_zero_is_refused():
    buf, _ = _buffer([4])
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets([buf], cap_bytes=0)


def test_a_bucket_size_that_is_not_positive_is_refused_by_the_config():
    from mpsync.config import ConfigError, SyncConfig

    for bad in (0, -1.0, float("nan"), "x"):
        with pytest.raises(ConfigError, match="bucket_mb"):
            SyncConfig(bucket_mb=bad).validate()
    with pytest.raises(ConfigError, match="MPSYNC_BUCKET_MB"):
        SyncConfig.from_options(env={"MPSYNC_BUCKET_MB": "0"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_,passes,backend", [(2, 1, "mpi"), (2, 2, "mpi"), (4, 1, "mpi"),
                                               (2, 1, "gloo")])
def test_buckets_during_backward_give_the_weights_of_the_whole_model_at_step(np_, passes,
                                                                             backend):
    run = run_mpi("bucket_programs:buckets_equal_the_whole_model", np=np_, timeout=240,
                  args=["steps=50", f"passes={passes}", f"backend={backend}"])
    res = run.results()
    assert len(res) == np_, run.report()
    for r in res.values():
        assert r["buckets"] >= 3, r
        events = r["first_step"]
        starts = [i for i, e in enumerate(events) if e.startswith("start")]
        grads = [i for i, e in enumerate(events) if e.startswith("grad")]
        assert len(starts) == r["buckets"], events
        if r["rank"] == 0:
            # Every parameter has a gradient in this step here, so the first bucket starts
            # during backward: its collective comes before the pass's last gradient hook (an
            # ordering, not a timing).
            assert starts[0] < grads[-1], events
        else:
            # The side branch got no gradient here (only worker 0 uses it), yet every bucket
            # started, the side branch's too: found unused at the end of backward.
            assert not any(e.startswith("grad side") for e in events), events
        if passes > 1:
            # Only the last pass of a step starts buckets: none before the first pass's
            # gradients are all in.
            assert starts[0] > grads[len(grads) // passes - 1], events
        assert r["none_after_zero"], r
        if np_ == 2:   # a sum of two numbers does not depend on the order it is taken in
            assert r["bucketed"] == r["whole"], r
        else:
            assert r["max_rel"] <= 1e-6, r
    assert len({r["bucketed"] for r in res.values()}) == 1, "workers ended apart"


def test_train_flags_and_environment_reach_the_config(monkeypatch):
    import argparse

    from mpsync.apps.train import add_arguments, build_config

    def config(*argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return build_config(p.parse_args(["--epochs", "1", *argv]))

    assert (config().bucket_mb, config().overlap) == (25.0, True)
    assert (config("--bucket-mb", "4").bucket_mb, config("--no-overlap").overlap) == (4.0, False)
    monkeypatch.setenv("MPSYNC_BUCKET_MB", "2.5")
    monkeypatch.setenv("MPSYNC_OVERLAP", "0")
    assert (config().bucket_mb, config().overlap) == (2.5, False)
    assert config("--bucket-mb", "8").bucket_mb == 8.0   # the flag wins


def test_the_overlap_benchmarks_model_has_over_40_mb_of_gradients_in_three_buckets():
    from mpsync.apps.models import build_model

    model = build_model((64,), 10, 0, "big-mlp")
    names, params = zip(*model.named_parameters())
    buf = FusionBuffer(list(params), list(names))
    buckets = plan_buckets([buf], cap_bytes=25 << 20)   # the default bucket size
    assert buf.numel * 4 > 40e6
    assert len(buckets) == 3 and all(b.nbytes <= 25 << 20 for b in buckets)
