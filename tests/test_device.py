"""The device paths, here through their CPU twins: which device a worker takes, fusion
buffers on the parameters' device, host staging only where a transport needs it, the PS's
device path (forced on host parameters), ``mpsync train --device``.  Tests that need CUDA
itself are marked and skipped without it; ``make gpu-check`` runs the CUDA paths."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mpi_harness import REPO, run_mpi

from mpsync.apps.devices import check_device_before_launch, choose_device
from mpsync.config import ConfigError
from mpsync.torch.broadcast import local_cuda_location
from mpsync.torch.dataplane.fusion import FusionBuffer
from mpsync.torch.dataplane.staging import HostStaged, needs_host_memory, stage_if_needed

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


# -- which device a worker takes --------------------------------------------------------------
def test_one_gpu_per_worker_by_local_rank():
    assert choose_device("auto", 3, 8, 8) == ("cuda:3", None)
    assert choose_device("cuda", 0, 2, 4) == ("cuda:0", None)
    assert choose_device("auto", 1, 2, 0) == ("cpu", None)
    assert choose_device("cpu", 1, 2, 8) == ("cpu", None)


def test_more_workers_than_gpus_shares_under_auto_and_is_refused_under_cuda():
    device, note = choose_device("auto", 3, 3, 2)
    assert device == "cuda:1" and "3 workers share" in note
    with pytest.raises(ConfigError, match="3 workers on this node and only 2 GPUs"):
        choose_device("cuda", 0, 3, 2)
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        choose_device("cuda", 0, 1, 0)
    with pytest.raises(ConfigError, match="unknown --device 'gpu'"):
        choose_device("gpu", 0, 1, 0)


@no_cuda
def test_device_cuda_is_refused_before_launch_without_cuda():
    with pytest.raises(ConfigError, match="--device cuda"):
        check_device_before_launch("cuda", 2)
    check_device_before_launch("auto", 2)
    check_device_before_launch("cpu", 2)


# -- fusion buffers on the parameters' device --------------------------------------------------
def test_fusion_buffer_is_allocated_on_the_parameters_device_and_binds_gradients_there():
    # The "meta" device is the CPU twin of a GPU here: not the host, no memory behind it.
    params = [torch.nn.Parameter(torch.empty(3, 2, device="meta")),
              torch.nn.Parameter(torch.empty(4, device="meta"))]
    buf = FusionBuffer(params, ["a.weight", "a.bias"])
    assert buf.wire.device.type == "meta" and buf.device.type == "meta"
    buf.bind_grads()
    assert buf.grads_bound
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in params)


def test_fusion_buffer_refuses_parameters_on_two_devices():
    params = [torch.nn.Parameter(torch.zeros(3)),
              torch.nn.Parameter(torch.empty(4, device="meta"))]
    with pytest.raises(ValueError, match="one device"):
        FusionBuffer(params, ["a.weight", "b.weight"])


# -- host staging only where the transport needs host memory -----------------------------------
class _Named:
    def __init__(self, name):
        self.name, self.rank, self.size, self.deadline, self.watch = name, 0, 1, 1.0, None
        self.while_waiting = None


def test_transports_that_need_host_memory_for_device_buffers():
    assert needs_host_memory(_Named("mpi"), cuda_aware_mpi=False)
    assert not needs_host_memory(_Named("mpi"), cuda_aware_mpi=True)
    assert needs_host_memory(_Named("mpi+link"), cuda_aware_mpi=None)
    assert needs_host_memory(_Named("horovod"), cuda_aware_mpi=False)
    assert not needs_host_memory(_Named("horovod"), cuda_aware_mpi=False, horovod_nccl=True)
    assert needs_host_memory(_Named("gloo"), cuda_aware_mpi=True)
    assert not needs_host_memory(_Named("nccl"), cuda_aware_mpi=False)


def test_no_staging_at_all_on_the_cpu():
    agg = _Named("mpi")
    assert stage_if_needed(agg, torch.device("cpu"), cuda_aware_mpi=False) is agg
    nccl = _Named("nccl")
    assert stage_if_needed(nccl, torch.device("cuda", 0), cuda_aware_mpi=False) is nccl
    staged = stage_if_needed(agg, torch.device("cuda", 0), cuda_aware_mpi=False)
    assert isinstance(staged, HostStaged) and staged.inner is agg
    staged.while_waiting = print          # joining sets the hook on what it knows
    assert agg.while_waiting is print


def test_root_cuda_tensors_land_on_this_workers_device_or_the_host():
    where = local_cuda_location()
    here = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    assert where["cuda:3"] == here and where["cuda"] == here and "cpu" not in where


# -- the PS's device path, forced on host parameters --------------------------------------------
@pytest.mark.mpi
def test_ps_device_path_gives_bitwise_the_host_paths_weights():
    # One worker (and the server): with two, the shards add the pushes in arrival order,
    # which is not bitwise repeatable between runs whatever path made them.
    digests = {}
    for staged in ("0", "1"):
        run = run_mpi("device_programs:ps_staged", np=2, timeout=180,
                      args=["policy=bsp", f"staged={staged}"])
        res = run.results()
        assert sorted(res) == [1], run.report()
        assert res[1]["staged"] == (staged == "1")
        digests[staged] = res[1]["digest"]
    assert digests["0"] == digests["1"]


@pytest.mark.mpi
def test_ps_device_path_under_asp_ends_with_equal_weights():
    run = run_mpi("device_programs:ps_staged", np=3, timeout=180,
                  args=["policy=asp", "staged=1"])
    res = run.results()
    assert sorted(res) == [1, 2], run.report()
    assert len({r["digest"] for r in res.values()}) == 1, res


# -- mpsync train --device ------------------------------------------------------------------------
def _train(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "mpsync.cli", "train", *flags], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.mpi
def test_train_device_cpu_with_a_dedicated_server_counts_local_ranks_over_workers():
    # --np 2 with the dedicated server: 3 ranks, 2 workers, local ranks 0 and 1 of 2 (the
    # server's rank takes no device).
    p = _train("--np", "2", "--server", "dedicated", "--device", "cpu", "--epochs", "0.05",
               "--no-progress", "--no-plots")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "worker 0 (local 0 of 2) on cpu" in p.stdout, p.stdout
    assert "worker 1 (local 1 of 2) on cpu" in p.stdout, p.stdout


@no_cuda
def test_train_device_cuda_without_cuda_is_one_line_exit_2():
    p = _train("--np", "2", "--device", "cuda", "--time-budget", "1", timeout=60)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--device cuda" in lines[0], p.stderr


@pytest.mark.gpu
@cuda
def test_host_staged_mirrors_average_device_buffers():
    from mpsync.torch.dataplane.backends import Aggregator, Pending

    class Doubling(Aggregator):   # a host transport of one worker whose "average" doubles
        name = "mpi"

        def start_allreduce_average(self, flat, what="allreduce"):
            assert flat.device.type == "cpu" and flat.is_pinned()
            flat.mul_(2)
            return Pending(lambda: True, lambda: None, what, 0, self)

    staged = HostStaged(Doubling(0, 1, 10.0, None))
    x = torch.arange(8.0, device="cuda")
    staged.start_allreduce_average(x).wait()
    assert torch.equal(x.cpu(), torch.arange(8.0) * 2) and staged.copies == 2
