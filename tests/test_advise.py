"""``mpsync advise``: stated clusters for which different policies should win are ranked so,
a real run's metrics.json gives a ranking, bad input is one line.  Single process: the command
runs in-process (``mpsync.cli.main``), the simulator on a short horizon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpsync import cli, policies

REPO = Path(__file__).resolve().parent.parent
# a real 4-worker run of mpsync compare across the virtual cluster at 1gbit (wide MLP)
REAL_RUN = REPO / "bench" / "simulate" / "compare-runs-1gbit" / "bsp" / "metrics.json"


def _advise(capsys, *argv):
    assert cli.main(["advise", *argv, "--horizon", "60", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    return out["measurements"], out["ranking"]


def _time(ranking, label):
    return next(r["predicted_time_to_target_s"] for r in ranking if r["candidate"] == label)


def test_equal_speeds_on_a_fast_link_put_ssp_on_the_ps_first(capsys):
    # nobody waits and pushes cost nothing: the parameter server applies every update in full
    # (more progress per sample than the ring's average) with no worker behind the others.
    # ASP predicts the same; SSP's bound breaks the tie.  On the ring, BSP: local steps
    # (ElasticBSP's monitoring iterations) buy nothing here.
    _, ranking = _advise(capsys, "--speeds", "1,1,1,1", "--link", "10gbit", "--model-bytes",
                         "150K")
    assert ranking[0]["policy"] == "ssp" and ranking[0]["topology"] == "ps"
    best = ranking[0]["predicted_time_to_target_s"]
    assert _time(ranking, "asp/ps") == pytest.approx(best, rel=0.01)
    assert _time(ranking, "bsp/ring") > 1.15 * best
    assert _time(ranking, "ebsp/ring") > 1.01 * _time(ranking, "bsp/ring")


def test_a_straggler_behind_a_slow_link_puts_elasticbsp_first(capsys):
    # 1,1,2,4 with the wide MLP's 8.7 MB at 1 Gbit/s: aggregating every iteration costs as
    # much as computing, and BSP waits for the 4x worker too
    m, ranking = _advise(capsys, "--speeds", "1,1,2,4", "--link", "1gbit", "--model",
                         "wide-mlp")
    assert m["model_bytes"] == pytest.approx(8.7e6, rel=0.01)
    assert ranking[0]["policy"] == "ebsp"
    assert _time(ranking, "bsp/ring") >= 2 * ranking[0]["predicted_time_to_target_s"]


def test_one_slow_worker_and_a_small_model_put_asp_first(capsys):
    # a 30x straggler, a 150 KB model on a fast link: pushes cost nothing and nobody waits;
    # its stale updates are 1/91 of all, 90 updates old (at 8x, ElasticBSP's local steps cost
    # less than the straggler's staleness: ElasticBSP first)
    _, ranking = _advise(capsys, "--speeds", "1,1,1,30", "--link", "10gbit", "--model-bytes",
                         "150K")
    assert ranking[0]["candidate"] == "asp/ps"
    assert _time(ranking, "bsp/ring") >= 1.5 * ranking[0]["predicted_time_to_target_s"]
    times = [r["predicted_time_to_target_s"] for r in ranking]
    assert times == sorted(times)


def test_a_candidate_still_in_its_first_rounds_is_simulated_until_it_is_past_them():
    # ESync on the parameter server, 16 workers, 100 MB over 100 Mbit/s: the first round's
    # pushes queue at the shards while the workers that pulled step locally.  Over the usual
    # horizon the workers completed 0.6 rounds each and the prediction read "1 local step
    # per round, efficiency 1.00"; past the start-up it is hundreds of local steps per round.
    from mpsync.auto.measurements import Measurements
    from mpsync.auto.ranking import HORIZON_ITERATIONS, Candidate, predict

    m = Measurements.from_speeds([1] * 16, link=12.5e6, model_bytes=100e6, ps_shards=4)
    ranked = predict(m, Candidate("esync", "ps"))
    simulated = int(ranked.reasons[0].split("engine, ")[1].split()[0])
    assert simulated > 16 * HORIZON_ITERATIONS, ranked.reasons
    assert ranked.efficiency < 0.5 and "local steps per round" in ranked.reasons[2], \
        ranked.reasons
    # a candidate past its first rounds within the horizon is simulated over it alone
    fast = predict(Measurements.from_speeds([1] * 4), Candidate("esync", "ps"))
    assert f"{4 * HORIZON_ITERATIONS} iterations" in fast.reasons[0], fast.reasons


def test_a_real_runs_metrics_give_a_ranking_with_reasons(capsys):
    assert cli.main(["advise", "--metrics", str(REAL_RUN), "--horizon", "60",
                     "--topologies", "ring"]) == 0
    text = capsys.readouterr().out
    run = json.loads(REAL_RUN.read_text())
    assert f"{len(run['workers'])} workers" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]
    labels = [row.split("|")[2].strip() for row in rows]
    assert {"bsp/ring", "ebsp/ring", "esync/ring", "osp/ring"} <= set(labels)
    times = [float(row.split("|")[3]) for row in rows]
    assert times == sorted(times)
    assert all("samples/s simulated" in row for row in rows)
    assert f"advice: {labels[0]}" in text


@pytest.mark.parametrize("argv,named", [
    (["--speeds", "1,x"], "--speeds"),
    (["--speeds", "1,1", "--metrics", "m.json"], "--metrics"),
    (["--speeds", "1,1", "--link", "fast"], "--link"),
    (["--speeds", "1,1", "--topologies", "mesh"], "--topologies"),
    (["--metrics", "no/such/metrics.json"], "metrics"),
])
def test_bad_input_is_one_line_naming_the_setting(capsys, argv, named):
    assert cli.main(["advise", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and err[0].startswith("mpsync advise: error:")


def test_advice_is_only_what_train_can_run_with_its_command_line(capsys):
    """Every candidate advise ranks is runnable by ``mpsync train``: its command line parses
    with train's own flags and validates to that policy, topology and bound; train has no
    compression flag, so no fp16 candidate is offered."""
    import argparse

    from mpsync.apps import train
    from mpsync.apps.advise import runnable_candidates, train_command
    from mpsync.auto import Measurements

    m = Measurements.from_speeds([1, 1, 2, 4], batch_size=64)
    candidates = runnable_candidates(("ring", "ps"))
    assert candidates and all(c.wire == "fp32" for c in candidates)
    assert {c.policy for c in candidates} == {s.name for s in policies.specs()
                                               if s.name != policies.AUTO}
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    for c in candidates:
        command = train_command(c, m)
        assert command.startswith("mpsync train --np 4 ") and "--batch-size 64" in command
        args = parser.parse_args(command.split()[2:] + ["--time-budget", "5"])
        config = train.validate(args, args.np)
        assert (config.policy, config.topology) == (c.policy, c.topology), command
        for key, value in c.settings:
            assert getattr(config, key) == value, command
    ranking = _advise(capsys, "--speeds", "1,1,2,4", "--link", "1gbit")[1]
    assert not [r["candidate"] for r in ranking if "fp16" in r["candidate"]]
    assert ranking[0]["command"].startswith(f"mpsync train --np 4 --policy "
                                            f"{ranking[0]['policy']} --topology "
                                            f"{ranking[0]['topology']}")
    assert cli.main(["advise", "--speeds", "1,1,2,4", "--horizon", "60", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "to 10,000 BSP-equivalent samples" in text
    assert "run it: mpsync train --np 4 --policy " in text and "fp16" not in text
