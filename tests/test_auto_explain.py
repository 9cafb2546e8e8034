"""``python -m mpsync.auto.explain OUT``: what auto did, read from an ``mpsync train`` run's
directory or an ``mpsync compare`` one, written here by the code's own writers (the
decision records, ``report.write_metrics``, the comparison's ``table_rows``)."""

from __future__ import annotations

import json

from mpsync.apps import report
from mpsync.apps.compare import table_rows
from mpsync.auto import Candidate, Decider, Measurements
from mpsync.auto.explain import main
from mpsync.auto.ranking import Ranked


def _metrics(policy: str, ttt: float | None, decisions=(), switches=(),
             topology: str = "ring") -> dict:
    """A train run's metrics.json as ``trainer._metrics`` writes it (the fields explain and
    compare read), 2 workers on the digits task."""
    worker = {"iterations": 300, "samples": 9600, "compute_s": 1.5, "wait_s": 0.4,
              "aggregation_s": 0.3, "rounds": 300, "bytes_sent": 10**6}
    out = {"schema": 1,
           "config": {"policy": policy, "topology": topology, "workers": 2, "target_acc": 0.9,
                      "batch_size": 32, "dataset": "digits"},
           "evals": [{"samples": 4000, "accuracy": 0.6, "wall_s": 2.0},
                     {"samples": 9000, "accuracy": 0.91 if ttt else 0.8, "wall_s": 4.0}],
           "workers": {"0": worker, "1": worker}, "wall_s": 6.0, "time_to_target_s": ttt,
           "final_acc": 0.91 if ttt else 0.8, "samples_per_s": 3200.0, "wait_fraction": 0.1,
           "bytes_per_sample": 100.0}
    if decisions:
        out |= {"decisions": list(decisions), "switches": list(switches),
                "policy_timeline": [{"policy": "ebsp"}]}
    return out


def _decisions() -> list[dict]:
    ranked = [Ranked(Candidate(p, "ring"), t, 1000.0, 1.0, 0.0, (), 0.0)
              for p, t in (("esync", 6.0), ("ebsp", 8.0), ("bsp", 12.0))]
    m = Measurements.from_speeds([1, 4], topologies=("ring",), ps_gain=1.4, ps_gain_sd=0.1,
                                 ps_gain_note="measured 1.40 +- 0.10 from the noise scale")
    d = Decider(Candidate("ebsp", "ring"))
    d.decide(ranked, m, 2.5, "first measurement")
    return [r.as_dict() for r in d.records]


def _write_comparison(out, runs: dict) -> None:
    """An ``mpsync compare`` directory of one run per policy, as compare writes it."""
    for policy, metrics in runs.items():
        (out / policy).mkdir()
        report.write_metrics(metrics, out / policy)
    (out / "compare.json").write_text(json.dumps({"rows": table_rows(runs), "target_acc": 0.9}))


def test_explain_reads_a_train_run(tmp_path, capsys):
    from mpsync.auto.noise import GradientNoise

    switches = [{"from": "ebsp", "to": "esync", "round": 40, "wall_s": 2.7}]
    noise = GradientNoise(2)
    for i in range(8):
        noise.add(0.5 * i, i % 2, 2.0, 1.0, 3)
    metrics = _metrics("auto", 5.5, _decisions(), switches)
    metrics["auto_gradient_noise"] = noise.estimate().as_dict()
    report.write_metrics(metrics, tmp_path)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "full-update gain it ranked with: measured 1.40 +- 0.10" in out, out
    assert "the gain at the end of the run: measured 1.33" in out, out
    assert "| 2.5 s | first measurement | ebsp/ring -> esync/ring | yes |" in out, out
    assert "predicted time to 10,000 BSP-equivalent samples" in out
    assert "| 1 | esync/ring | 6.0 s |" in out
    assert "switched ebsp -> esync after round 40 at 2.7 s" in out


def test_explain_on_a_fixed_policy_run_says_it_made_no_decisions(tmp_path, capsys):
    report.write_metrics(_metrics("bsp", 5.0), tmp_path)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no decisions in this run" in out and "time to 0.9 accuracy 5.0 s" in out, out


def test_explain_of_a_run_without_a_target_says_none_was_given(tmp_path, capsys):
    metrics = _metrics("bsp", None)
    metrics["config"]["target_acc"] = None
    report.write_metrics(metrics, tmp_path)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "workers: no target accuracy given (--target-acc), final accuracy 0.800" in out, out
    assert "None" not in out, out


def test_explain_reads_a_comparison_without_repeats(tmp_path, capsys):
    """One run per policy (no --repeats): its rows have no 'reached'/'repeats'; the table
    says 1/1 or 0/1, never None/None."""
    runs = {"bsp": _metrics("bsp", 6.0), "asp": _metrics("asp", None, topology="ps"),
            "auto": _metrics("auto", 5.5, _decisions())}
    _write_comparison(tmp_path, runs)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "None" not in out, out
    assert "| bsp | 1/1 | 6.0 s (6.0) |" in out and "| asp | 0/1 | - (-) |" in out, out
    assert "auto / best fixed policy (bsp): **0.92x**" in out


def test_explain_refuses_a_directory_that_is_neither(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "neither compare.json" in err and "Traceback" not in err


def test_explain_sets_the_efficiency_measured_in_auto_runs_beside_the_comparisons(tmp_path,
                                                                                 capsys):
    """A comparison whose auto run switched to SSP on the PS and measured its progress at the
    confirmation: the efficiency check lists, for SSP, the efficiency auto settled on after
    measuring (what the issue's acceptance sets beside the comparison's measurement)."""
    from mpsync.auto.progress import ProgressRatio

    bsp, ssp = Candidate("bsp", "ring"), Candidate("ssp", "ps")
    m = Measurements.from_speeds([1, 1], aggregation_s=0.002)   # a timed network
    d = Decider(bsp)
    d.decide([Ranked(ssp, 5.0, 1000.0, 1.2, 0.0, (), 0.0),
              Ranked(bsp, 8.0, 900.0, 1.0, 0.0, (), 0.0)], m, 1.0, "first measurement")
    d.confirm_switch(bsp, 10.0, 12.0, 5.0, 4.0,
                     progress=ProgressRatio("bsp/ring", "ssp/ps", 0.1, 0.05, 1e-4, 5e-5,
                                            1e-3, 1e-5, 40, 40))
    runs = {"bsp": _metrics("bsp", 6.0), "ssp": _metrics("ssp", None, topology="ps"),
            "auto": _metrics("auto", 7.0, [r.as_dict() for r in d.records])}
    _write_comparison(tmp_path, runs)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| ssp |")][-1]
    # first ranking; the fitted constants' and the measured gain's (none: no noise was
    # measured); settled after the confirmation; the model's now.  SSP never reached the
    # target, so nothing is nearer.
    assert row.endswith("| 1.20 | - | - | 0.40 (1) | 1.22 | - |"), out


def _gain_comparison(out, gain: float) -> None:
    """A comparison whose SSP reached the target after as many samples as BSP (progress
    1.00), its auto run's ranking at the fitted gain giving SSP 1.20, and ``gain`` measured
    by the run's end, written to ``out`` and explained (printed)."""
    bsp, ssp = Candidate("bsp", "ring"), Candidate("ssp", "ps")
    d = Decider(bsp)
    d.decide([Ranked(bsp, 8.0, 900.0, 1.0, 0.0, (), 0.0),
              Ranked(ssp, 9.0, 1000.0, 1.2, 0.0, (), 0.0)], Measurements.from_speeds([1, 1]),
             1.0, "first measurement")
    auto = _metrics("auto", 7.0, [r.as_dict() for r in d.records])
    auto["auto_gradient_noise"] = {"gain": gain, "sd": 0.1, "measured": gain, "note": "test"}
    out.mkdir()
    _write_comparison(out, {"bsp": _metrics("bsp", 6.0),
                            "ssp": _metrics("ssp", 5.0, topology="ps"), "auto": auto})
    assert main([str(out)]) == 0


def test_explain_says_whether_the_gain_measured_in_the_run_or_the_constants_came_nearer(
        tmp_path, capsys):
    """The ranking used the fitted gain (1.22): with a gain of 1.0 measured, SSP's efficiency
    is 1.2 x 1.0 / 1.22 = 0.98, nearer the measured 1.00 than the constants' 1.20; with 2.0
    measured, 1.97 is farther."""
    _gain_comparison(tmp_path / "low", 1.0)
    _gain_comparison(tmp_path / "high", 2.0)
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ssp | 9000 |")]
    assert rows == ["| ssp | 9000 | 1.00 | 1.20 | 1.20 | 0.98 (1) | - | 1.22 | the run's |",
                    "| ssp | 9000 | 1.00 | 1.20 | 1.20 | 1.97 (1) | - | 1.22 | the constants' |"]
