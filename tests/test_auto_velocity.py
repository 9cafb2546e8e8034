"""Going from the ring to the parameter server, ``auto`` divides each worker's velocity by n
(``mpsync.torch.strategies.switching.share_velocity``): the ring moved the model by the mean of the
workers' steps, the PS moves it by their sum.  Checked on real torch optimizers, no MPI."""

from __future__ import annotations

import torch

from mpsync.torch.strategies.switching import share_velocity


def _trained(opt_cls, **kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    opt = opt_cls([p], lr=0.05, **kw)
    for _ in range(5):
        opt.zero_grad()
        (p ** 2).sum().backward()
        opt.step()
    return p, opt


def test_n_workers_next_steps_sum_to_the_ring_step_they_replace():
    """With no new gradient, the ring's next step is lr * momentum * m; after the switch
    each of n workers steps by 1/n of it, and the PS sums the n steps: the same move."""
    n = 4
    p, opt = _trained(torch.optim.SGD, momentum=0.9)
    before = p.detach().clone()
    p.grad.zero_()
    opt.step()
    ring_step = p.detach() - before

    p, opt = _trained(torch.optim.SGD, momentum=0.9)
    share_velocity(opt, n)
    before = p.detach().clone()
    p.grad.zero_()
    opt.step()
    worker_step = p.detach() - before
    assert torch.allclose(n * worker_step, ring_step, rtol=1e-12, atol=0)
    assert ring_step.abs().max() > 0


def test_adam_first_moment_is_divided_and_the_rest_kept():
    p, opt = _trained(torch.optim.Adam)
    state = opt.state[p]
    exp_avg, exp_avg_sq, step = (state["exp_avg"].clone(), state["exp_avg_sq"].clone(),
                                 state["step"].clone())
    share_velocity(opt, 3)
    assert torch.allclose(state["exp_avg"] * 3, exp_avg, rtol=1e-15, atol=0)
    assert torch.equal(state["exp_avg_sq"], exp_avg_sq)
    assert torch.equal(state["step"], step)


def test_an_optimizer_without_velocity_is_left_as_it_is():
    p, opt = _trained(torch.optim.SGD)            # momentum 0: no state at all
    share_velocity(opt, 4)
    assert all("momentum_buffer" not in s or s["momentum_buffer"] is None
               for s in opt.state.values())
