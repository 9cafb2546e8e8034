"""``auto`` and a change of learning rate: a candidate ruled out (the training diverged under
it) or refuted (its measured progress was worse), and the parameter server's measured
progress bracket, were judged at the old rate, so a change (a step schedule's drop) re-admits
them and the next check ranks anew.  The worker tells the server with a bit of its loss
report's flag, once the rate has moved by ``RATE_CHANGE`` or more since the rate it last told
of; the server takes the workers' reports of one change as one."""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from mpsync.auto.decider import Decider
from mpsync.auto.measurements import Measurements
from mpsync.auto.ranking import Candidate, Ranked
from mpsync.torch.strategies.switching import RATE_CHANGE, learning_rates, rates_changed


def _ranked(label_times):
    return [Ranked(candidate=c, predicted_time_to_target_s=t, samples_per_s=1.0,
                   efficiency=1.0, wait_fraction=0.0, reasons=(),
                   simulation_cpu_s=0.0) for c, t in label_times]


def test_a_change_is_a_move_by_the_factor_in_any_group():
    assert not rates_changed((0.1,), (0.1 * 1.4,)) and rates_changed((0.1,), (0.1 * RATE_CHANGE,))
    assert rates_changed((0.1, 0.01), (0.1, 0.001)) and not rates_changed((0.1, 0.01),
                                                                            (0.08, 0.012))
    assert rates_changed((0.0,), (1e-4,)) and not rates_changed((0.0,), (0.0,))
    assert rates_changed((0.1,), (0.1, 0.1)) and rates_changed((None,), (0.1,))
    opt = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": torch.tensor(0.5)},
                           {"params": [torch.zeros(1)]}], lr=0.1)
    assert learning_rates(opt) == (0.5, 0.1)
    opt.param_groups[1]["lr"] = None       # (an optimizer that sets its own step sizes)
    assert learning_rates(opt) == (0.5, None)


def test_the_decider_readmits_what_it_ruled_out_and_ranks_again_on_a_new_rate():
    ebsp, ssp, asp = Candidate("ebsp", "ring"), Candidate("ssp", "ps"), Candidate("asp", "ps")
    d = Decider(ebsp, confirm=1)
    m = Measurements(compute_s=(0.1,) * 4, aggregation_s=0.01)
    assert d.wants_ranking(m) == "first measurement"
    d.decide(_ranked([(ssp, 10.0), (asp, 11.0), (ebsp, 20.0)]), m, 1.0, "first")
    d.diverged(ebsp, "the training loss rose", 9.0, [ssp, asp])
    assert d.wants_ranking(m) is None                   # the same cluster: nothing to rank
    assert d.learning_rate_changed("worker 1 at iteration 40") == ["asp/ps", "ssp/ps"]
    trigger = d.wants_ranking(m)
    assert trigger.startswith("learning rate changed (worker 1 at iteration 40)"), trigger
    assert "re-admitted: asp/ps, ssp/ps" in trigger and not d.unstable
    assert d.wants_ranking(m) is None                   # once
    again = d.decide(_ranked([(ssp, 5.0), (asp, 6.0), (ebsp, 20.0)]), m, 12.0, trigger)
    assert again.switch and d.current == ssp, again.reason
    assert d.learning_rate_changed("worker 0 at iteration 90") == []
    assert d.wants_ranking(m) == "learning rate changed (worker 0 at iteration 90)"


def test_the_server_drops_the_bracket_and_takes_the_workers_reports_of_one_change_as_one():
    from mpsync.auto.serving import SAME_RATE_CHANGE_S
    from mpsync.config import SyncConfig
    from mpsync.server.policies import make_policy

    pol = make_policy(SyncConfig(policy="auto", topology="ring").validate(), 4)
    pol.t0 = 100.0
    pol.gain_bracket = (0.0, 0.4, "1 measurement")
    pol.decider.unstable["ssp/ps"] = "the training loss rose"
    for w in range(4):                                 # every worker tells, 0.1 s apart
        pol.on_learning_rate_change(w, 50 + w, 110.0 + 0.1 * w)
    assert pol.gain_bracket is None and not pol.decider.unstable
    assert pol.rate_changes == [{"at_s": 10.0, "worker": 0, "iteration": 50,
                                 "readmitted": ["ssp/ps"], "bracket_dropped": True}]
    pol.on_learning_rate_change(2, 80, 110.0 + SAME_RATE_CHANGE_S + 0.1)   # a later change
    assert [c["iteration"] for c in pol.rate_changes] == [50, 80]
    assert pol.describe()["learning_rate_changes"] == pol.rate_changes


def test_the_loss_reports_flag_reaches_the_policy_over_the_wire():
    """A LOSS request whose flag carries both bits, over real MPI (one process, its own
    server on COMM_SELF): the loss is read as not finite and the change is told."""
    from mpsync.config import SyncConfig
    from mpsync.server import StateServer, wire as W

    comm = MPI.COMM_SELF.Dup()
    try:
        config = SyncConfig.from_options(env={}, policy="asp", topology="ps",
                                         server="colocated", deadline=600.0)
        server = StateServer(comm, config, workers=[0], fast_path=False)
        heard = []
        server.policy.on_learning_rate_change = lambda w, k, now: heard.append(("lr", w, k))
        server.policy.on_loss = lambda w, k, loss, count, now: heard.append(("loss", loss))
        for flag in (W.LR_CHANGED | W.NOT_FINITE, 0):
            msg = W.new_msg()
            msg[W.SEQ], msg[W.ITER], msg[W.AGG], msg[W.COUNT], msg[W.FLAG] = 1, 7, 0.5, 3, flag
            request = comm.Isend([msg, MPI.DOUBLE], dest=0, tag=W.LOSS)
            status = MPI.Status()
            comm.Probe(0, W.LOSS, status)
            server._receive(0, W.LOSS, status.Get_count(MPI.BYTE))
            request.Wait()
        assert heard == [("lr", 0, 7), ("loss", float("inf")), ("loss", 0.5)], heard
        assert np.isfinite(heard[-1][1])
    finally:
        comm.Free()
