"""Worker 0's evaluations are not its compute: the time it spends evaluating between two
steps is left out of the compute time its next step reports (the state server reads that as
the worker's speed: ``auto``, ESync and ElasticBSP decide on it).  A real run under mpirun."""

from __future__ import annotations

import json

from mpi_harness import REPO, run_mpi

TRAIN = str(REPO / "mpsync" / "apps" / "train.py")


def test_worker_0_reports_no_evaluation_time_as_compute(tmp_path):
    # Two equal workers under BSP (the same iterations each); worker 0 evaluates at every
    # round boundary, with the wide MLP on the whole test set so each evaluation costs; each
    # iteration padded to 50 ms (the emulated device time), so both report the same compute.
    run = run_mpi(TRAIN, np=3, timeout=240, args=[
        "--policy", "bsp", "--time-budget", "4", "--batch-size", "16", "--slowdown", "1,1",
        "--iter-time", "0.05", "--eval-every", "0.0001", "--model", "wide-mlp",
        "--out", str(tmp_path), "--no-progress", "--no-plots"])
    assert run.ok, run.report()
    m = json.loads((tmp_path / "metrics.json").read_text())
    w0, w1 = m["workers"]["0"], m["workers"]["1"]
    assert w0["iterations"] == w1["iterations"] and len(m["evals"]) > 5
    per_iteration = (w0["compute_s"] - w1["compute_s"]) / w0["iterations"]
    eval_per_iteration = m["eval_s"] / w0["iterations"]
    # Before the fix worker 0's compute exceeded worker 1's by the evaluations' time.
    assert eval_per_iteration > 0.002, m["eval_s"]
    assert per_iteration < 0.5 * eval_per_iteration, (w0["compute_s"], w1["compute_s"],
                                                      m["eval_s"])
