"""``auto``'s switches on real ranks: every kind of switch it can make happens after a round
every worker takes part in, from bitwise identical weights, losing no update (checked against
the sum of every update the workers applied), and a change of the cluster's speeds makes the
live decision logic choose again."""

from __future__ import annotations

import pytest

from mpi_harness import REPO, run_mpi

pytestmark = pytest.mark.mpi

# Every switch auto can make on the ring: bsp->esync, esync->ebsp, ebsp->bsp, bsp->ebsp,
# ebsp->esync, esync->bsp.
PLAN = "3:esync,6:ebsp,9:bsp,12:ebsp,15:esync,18:bsp"
KINDS = {("bsp", "esync"), ("esync", "ebsp"), ("ebsp", "bsp"), ("bsp", "ebsp"),
         ("ebsp", "esync"), ("esync", "bsp")}


def _run(momentum: str):
    run = run_mpi("auto_programs:planned_switches", np=4, timeout=240,
                  args=[f"plan={PLAN}", "rounds=21", f"momentum={momentum}"])
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    return res


def _check_switches(res):
    switches = [r["switches"] for r in res.values()]
    kinds = {(s["from"], s["to"]) for s in switches[0]}
    assert kinds == KINDS, switches[0]
    for k in range(len(switches[0])):
        # Every worker switched after the same round, from the same weights.
        assert len({(s[k]["round"], s[k]["from"], s[k]["to"], s[k]["weights_sha256"])
                    for s in switches}) == 1, [s[k] for s in switches]
    server = res[1]
    timeline = [(t["policy"], t["after_round"]) for t in server["timeline"]]
    assert timeline == [("bsp", 0), *((s["to"], s["round"]) for s in switches[0])], timeline
    assert [d["chosen"] for d in server["decisions"]] == [f"{s['to']}/ring"
                                                          for s in switches[0]]


def test_every_kind_of_switch_keeps_every_update_and_equal_weights():
    res = _run("0")
    _check_switches(res)
    for r in res.values():
        # Every update any worker applied is in the model, averaged, none twice.
        assert r["rel_err"] <= 1e-9, r["rel_err"]
    assert len({r["digest"] for r in res.values()}) == 1
    # After every round (under each policy) the replicas are bitwise equal.
    rounds = [r["after_round"] for r in res.values()]
    assert all(set(x) == set(rounds[0]) for x in rounds)
    for k in rounds[0]:
        assert len({x[k] for x in rounds}) == 1, k
    # The local-step phases let the fast workers run more iterations than the straggler.
    assert res[2]["steps"] > res[1]["steps"]


def test_momentum_is_carried_into_bsp_so_its_rounds_stay_identical():
    """ESync and ElasticBSP leave each replica its own momentum; after a switch to BSP the
    states are averaged and made equal, or the BSP rounds would drift apart."""
    res = _run("0.9")
    _check_switches(res)
    rounds = [r["after_round"] for r in res.values()]
    bsp_rounds = [k for k, p in res[1]["policy_of_round"].items() if p == "bsp"]
    assert len(bsp_rounds) >= 9
    for k in rounds[0]:
        assert len({x[k] for x in rounds}) == 1, (k, res[1]["policy_of_round"][k])


# Across topologies (the job hosts the PS's shards): ring -> PS after a BSP round, an
# ElasticBSP barrier and an ESync round; PS -> ring to each ring policy; PS -> PS.
CROSS_PLAN = "3:asp,6:bsp,9:ebsp,12:ssp,15:esync,18:dssp,21:asp,24:ebsp"
CROSS_KINDS = {("bsp", "asp"), ("asp", "bsp"), ("bsp", "ebsp"), ("ebsp", "ssp"),
               ("ssp", "esync"), ("esync", "dssp"), ("dssp", "asp"), ("asp", "ebsp")}


def test_switches_across_topologies_keep_every_update_and_equal_weights():
    run = run_mpi("auto_programs:planned_switches", np=4, timeout=240,
                  args=[f"plan={CROSS_PLAN}", "rounds=30", "momentum=0"])
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    server = res[1]
    timeline = [(t["policy"], t.get("topology", "ring")) for t in server["timeline"]]
    assert {(a[0], b[0]) for a, b in zip(timeline, timeline[1:])} == CROSS_KINDS, timeline
    # Each worker switched its strategy at every change of topology (and on the ring), to
    # the same policy after the same round, from bitwise identical weights.
    switches = [[(s["to"], s["to_topology"], s["round"], s["weights_sha256"])
                 for s in r["switches"]] for r in res.values()]
    assert len({tuple(s) for s in switches}) == 1, switches
    assert [(s[0], s[1]) for s in switches[0]] == \
        [b for a, b in zip(timeline, timeline[1:]) if "ring" in (a[1], b[1])]
    for r in res.values():
        # Every update any worker applied is in the model, none twice.
        assert r["rel_err"] <= 1e-9, r["rel_err"]
    assert len({r["digest"] for r in res.values()}) == 1
    rounds = [r["after_round"] for r in res.values()]
    ring_rounds = [k for k, t in res[1]["topology_of_round"].items() if t == "ring"]
    assert len(ring_rounds) >= 12
    for k in ring_rounds:
        # After every ring round the replicas are bitwise equal (PS rounds are each worker's).
        assert len({x[k] for x in rounds}) == 1, (k, res[1]["policy_of_round"][k])


def test_optimizer_states_are_made_equal_when_the_ps_hands_over_to_bsp():
    """Each worker runs its own optimizer on the PS (momentum drifts apart); after the switch
    to BSP the states are averaged and made equal, or the BSP rounds would drift apart."""
    res = run_mpi("auto_programs:planned_switches", np=4, timeout=180,
                  args=["plan=3:asp,6:bsp", "rounds=14", "momentum=0.9"]).results()
    assert [(s["from"], s["to"]) for s in res[1]["switches"]] == [("bsp", "asp"),
                                                                   ("asp", "bsp")]
    rounds = [r["after_round"] for r in res.values()]
    bsp_after = [k for k, p in res[1]["policy_of_round"].items()
                 if p == "bsp" and int(k) > res[1]["switches"][1]["round"]]
    assert len(bsp_after) >= 5
    for k in bsp_after:
        assert len({x[k] for x in rounds}) == 1, k


def test_a_worker_stopped_on_the_ps_ends_the_job_instead_of_hanging_the_switch_back():
    run = run_mpi("auto_programs:stopped_in_gathering", np=4, timeout=120, check=False)
    assert not run.timed_out and run.returncode != 0, run.report()
    assert "STOPPED" in run.stdout + str(run.ranks), run.report()
    assert "worker rank(s) [2] silent" in run.stderr + str(run.ranks), run.report()


def _train_auto(tmp_path, plan: str, budget: str, *more: str) -> dict:
    """``mpsync train --np 3 --policy auto`` with the switches of ``plan``, the straggler
    8x slower; its ``metrics.json``."""
    import json
    import os
    import sys

    from mpsync.launch import run_with_deadline

    env = dict(os.environ, PYTHONPATH=str(REPO), MPSYNC_AUTO_PLAN=plan)
    env.pop("MPSYNC_DEBUG", None)
    res = run_with_deadline([sys.executable, "-m", "mpsync.cli", "train", "--np", "3",
                             "--policy", "auto", "--time-budget", budget, "--slowdown", "1,1,8",
                             *more, "--no-progress", "--no-plots", "--deadline", "60",
                             "--out", str(tmp_path / "run")], 300, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    return json.loads((tmp_path / "run" / "metrics.json").read_text())


def test_mpsync_train_under_auto_crosses_topologies_and_ends_cleanly(tmp_path):
    """``mpsync train`` decides when to stop by the ring's rule on the ring and by the PS's
    on the PS (where each worker counts its own rounds, so a stop check at round boundaries
    would pair different rounds and straddle the switch back to the ring)."""
    metrics = _train_auto(tmp_path, "3:asp,30:bsp", "8")
    timeline = [(t["policy"], t.get("topology", "ring")) for t in metrics["policy_timeline"]]
    assert timeline == [("bsp", "ring"), ("asp", "ps"), ("bsp", "ring")], timeline


def test_auto_on_the_ps_counts_the_samples_the_server_applied_so_the_axis_never_goes_back(
        tmp_path):
    """On the PS, ``auto``'s samples axis goes on from the ring's last agreed sum by the
    server's count of updates; worker 0's own samples times the workers ran ahead of it by
    as much as the workers differ (here 3 against 2.125 at the straggler's 8x), and the last
    evaluation, which sums every worker's samples, came out below the one before."""
    m = _train_auto(tmp_path, "2:asp", "6", "--eval-every", "0.5")
    assert [t["policy"] for t in m["policy_timeline"]] == ["bsp", "asp"], m["policy_timeline"]
    samples = [e["samples"] for e in m["evals"]]
    assert len(samples) >= 6 and samples == sorted(samples), samples
    assert samples[-1] == m["total_samples"], (samples, m["total_samples"])
    # The count on the PS goes on from the samples taken at the move, which the workers
    # agree on at the ring's last round (BSP: a step of each of the 3 workers per round),
    # not from the last stop check before it (BSP checks every 5 rounds: here, the start).
    moved = m["switches"][0]
    batch = m["config"]["batch_size"]
    assert moved["to_topology"] == "ps" and moved["round"] == 2, moved
    assert moved["samples"] == moved["round"] * 3 * batch, moved


def test_leaving_a_diverging_ps_restarts_the_ring_from_earlier_weights():
    """The training loss the workers report rises back to its start 4 s after auto moved them
    to the parameter server: it goes back to the ring, every worker from the same weights,
    those the lowest worker held on the PS before the loss rose (its snapshot), and does not
    choose the PS again."""
    run = run_mpi("auto_programs:diverging_on_the_ps", np=4, timeout=180)
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    decisions = res[1]["decisions"]
    # Deciding, auto runs ElasticBSP from the first step on every worker (no switch to it).
    assert decisions[0]["trigger"] == "start" and not decisions[0]["switch"], decisions[0]
    assert res[1]["timeline"][0]["policy"] == "ebsp", res[1]["timeline"]
    went = [d for d in decisions if d["switch"] and d["chosen"].split(" ")[0].endswith("/ps")]
    assert went, ("the ranking did not move the equal-speeds job to the PS, which this test "
                  "needs", [(d["trigger"], d["chosen"], d["reason"]) for d in decisions])
    assert {r["switches"][0]["from"] for r in res.values()} == {"ebsp"}, run.report()
    back = [d for d in decisions if d["trigger"] == "training loss"]
    assert len(back) == 1 and back[0]["switch"] and back[0]["chosen"].endswith("/ring"), \
        [(d["at_s"], d["trigger"], d["chosen"], d["reason"]) for d in decisions]
    assert "asp/ps" in back[0]["reason"] and "ssp/ps" in back[0]["reason"]
    rolled = [r["rolled"] for r in res.values()]
    assert all(r is not None for r in rolled), run.report()
    assert len({(r["round"], r["weights_sha256"]) for r in rolled}) == 1, rolled
    assert rolled[0]["rolled_back_s"] >= 1.0, rolled[0]
    # The restart point is weights worker 0 (rank 1) held after one of its PS steps, not the
    # ones it held last on the PS.
    assert rolled[0]["weights_sha256"] in res[1]["on_ps"][:-5], rolled[0]
    assert len({r["digest"] for r in res.values()}) == 1
    assert not any(d["chosen"].split(" ")[0].endswith("/ps")
                   for d in decisions[decisions.index(back[0]) + 1:] if d["switch"])


def test_a_joined_workers_idle_iterations_are_not_a_cluster_change():
    """Worker 1 joins 5 s before worker 0 ends (both iterate every 0.15 s): its idle
    iterations, 50 ms apart, report its usual iteration, so auto decides once and never
    again: nothing in the cluster changed."""
    run = run_mpi("auto_programs:idle_after_join", np=3, timeout=120)
    res = run.results()
    assert sorted(res) == [1, 2], run.report()
    decisions = res[1]["decisions"]
    assert any(d["trigger"] == "first measurement" for d in decisions), decisions
    changed = [(d["at_s"], d["trigger"]) for d in decisions if "changed" in d["trigger"]]
    assert not changed, changed
    assert res[1]["steps"] > res[2]["steps"] + 15, res


def test_a_switch_to_the_ps_that_reaches_a_joined_worker_ends_as_the_ps_ends():
    """Worker 1 joins on the ring after 2 steps; worker 0 trains on until ``auto`` moves the
    job to the PS (a plan: after round 4).  Worker 1 switches inside its join, and its ``synchronize`` then ends as
    the PS's (final push, barrier, final pull), as worker 0's does: before the fix it
    broadcast the ring's final model into worker 0's final-push barrier, and worker 0 waited
    there until its deadline."""
    run = run_mpi("auto_programs:switch_while_joined", np=3, timeout=90)
    res = run.results()
    assert sorted(res) == [1, 2], run.report()
    assert res[2]["steps"] == 2 and res[1]["steps"] > 4, res
    # The case under test happened: worker 1 was on the ring when it joined, and left it.
    assert ("ring", "ps") in map(tuple, res[2]["switches"]), res[2]["switches"]
    assert {r["topology"] for r in res.values()} == {"ps"}, res
    assert res[1]["digest"] == res[2]["digest"], res

