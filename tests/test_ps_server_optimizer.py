"""The parameter server running the optimizer (``ps_optimizer='server'``) on real ranks: BSP
with Adam is single-process Adam on the concatenated batch, to 1e-9 in float64 over 20 steps
(learning rate changed half-way), the workers never run their own Adam, and a run resumed
half-way from the global model and the shards' optimizer state (what a checkpoint keeps)
goes on to the same model.  (That the workers' own Adam steps, averaged, are not that model
-- the departure [ps-worker-optimizer] -- is shown in one process by
tests/test_shard_optimizer.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import run_mpi


def _check(run) -> dict:
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    for r in res.values():
        assert r["vs_reference"] <= 1e-9, r
        assert r["worker_state"] == 0, r     # the workers never ran their Adam
        assert not r["pushed_before_start"], r
    assert len({r["digest"] for r in res.values()}) == 1, res   # one model on every worker
    return res[1]


def test_bsp_with_adam_on_the_server_is_adam_on_the_concatenated_batch(tmp_path):
    # start_late: workers 1 and 2 wait (2 s at most) for worker 0's first push before their
    # first pull; it must not come (every worker pulls the starting weights before anyone
    # pushes), and were it to, the shards must wait for their pushes in its round instead
    # of stepping on it alone (before they counted rounds per worker, this ended 0.23-0.34
    # away from single-process Adam).
    cut = tmp_path / "cut.pt"
    whole = _check(run_mpi("psopt_programs:ps_rounds", np=4, timeout=180,
                           args=["ps_optimizer=server", "ps_shards=3", "start_late=1",
                                 f"save={cut}"]))
    assert whole["iterations"] == 20 == whole["rounds"], whole
    resumed = _check(run_mpi("psopt_programs:ps_rounds", np=4, timeout=180,
                             args=["ps_optimizer=server", "ps_shards=2", f"resume={cut}"]))
    assert resumed["iterations"] == 10 == resumed["rounds"], resumed
    # Adam's moments and step count went on (restarted from zero, the model ends 0.07 away);
    # the last bits may differ with the order in which a round's pushes were summed.
    a, b = np.array(whole["final"]), np.array(resumed["final"])
    assert np.abs(a - b).max() <= 1e-12 * np.abs(a).max(), (a, b)


def test_a_workers_gradients_go_into_the_push_checked_in_the_pass_that_copies_them():
    # (ParameterServer._pack_grads_checked reads only the fusion buffer and the push's buffer,
    # through _grads_into)
    import torch

    from mpsync.torch.dataplane.fusion import FusionBuffer
    from mpsync.torch.strategies.ps import ParameterServer

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)   # no gradient: zeros in the push
    params = list(model.parameters())
    worker = type("Worker", (), {"_grads_into": ParameterServer._grads_into})()
    worker.buf = FusionBuffer(params, [f"p{i}" for i in range(len(params))])
    worker._base = np.full(worker.buf.numel, 7.0, dtype=np.float32)
    model(torch.ones(5, 3)).sum().backward()
    model[0].weight.grad = model[0].weight.grad.t().contiguous().t()   # strided: torch copies
    assert ParameterServer._pack_grads_checked(worker)
    expected = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in params]).numpy()
    assert np.array_equal(worker._base, expected)
    for p in (0, 1):   # a NaN in a contiguous gradient and in the strided one
        bad = params[p].grad.clone()
        bad[(1,) + (0,) * (bad.dim() - 1)] = float("nan")
        before, params[p].grad = params[p].grad, bad
        assert not ParameterServer._pack_grads_checked(worker)
        params[p].grad = before
    assert ParameterServer._pack_grads_checked(worker)


@pytest.mark.parametrize("policy", ["asp", "ssp"])
def test_gradients_go_straight_into_the_inbox_and_each_is_stepped_on_once(policy):
    # The inbox (one node, ASP/SSP/DSSP): each worker copies each parameter's gradient into
    # its slot on every shard whose range it crosses; a constant gradient makes the end exact.
    run = run_mpi("psopt_programs:constant_gradients", np=4, timeout=180,
                  args=[f"policy={policy}"])
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    pushes = sum(r["iterations"] for r in res.values())
    assert pushes == 3 * 20, res
    slopes = [np.ones(5), np.arange(7.0) / 4, np.zeros(3), np.zeros(6)]
    expected = [(-0.5 * pushes * c).tolist() for c in slopes]
    for r in res.values():
        assert r["into_slots"] == r["iterations"], r   # none packed into a buffer first
        assert r["final"] == expected, (r, expected)
