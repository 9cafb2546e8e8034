"""The staleness bound holds to the end of an ``mpsync train`` run on the parameter server:
under SSP and DSSP the largest gap the server granted stays within the bound, worker 0 (which
evaluates often here) does not train alone after the others stopped, and the samples axis of
the evaluations never goes back (real ranks, 2 workers, a dedicated server)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from mpi_harness import REPO, run_mpi

TRAIN = str(REPO / "mpsync" / "apps" / "train.py")

# policy, its flags, the bound on the gap
CASES = [("ssp", ["--staleness", "2"], 2), ("dssp", ["--staleness-range", "1,3"], 3)]
ITER_TIME = 0.01


def _run(case, out):
    policy, flags, _ = case
    # Evaluations every 0.02 s: worker 0 spends a good part of the budget evaluating, which
    # its clock leaves out and the others' (held by the bound meanwhile) count.
    return run_mpi(TRAIN, np=3, timeout=180, check=False, args=[
        "--policy", policy, *flags, "--ps-optimizer", "server", "--lr", "0.02",
        "--time-budget", "3", "--eval-every", "0.02", "--iter-time", str(ITER_TIME),
        "--batch-size", "16", "--out", str(out), "--no-progress", "--no-plots"])


@pytest.mark.slow
def test_the_bound_holds_to_the_last_iteration(tmp_path):
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda c: _run(c, tmp_path / c[0]), CASES))
    for (policy, _, bound), run in zip(CASES, runs):
        assert run.ok, run.report()
        m = json.loads((tmp_path / policy / "metrics.json").read_text())
        # The premise: worker 0 evaluated for longer than twice the iterations the bound
        # allows between the workers (alone for that long, it would break the checks below).
        # Not a fixed time: one evaluation took 1-8 ms here, so at one every 0.05 s a CI run
        # on an idle machine fell short (0.062 s); at one every 0.02 s, some 140 are made.
        assert m["eval_s"] > 2 * (bound + 1) * ITER_TIME, (m["eval_s"], len(m["evals"]))
        assert m["server"]["max_staleness_gap"] <= bound, (policy, m["server"])
        iterations = [w["iterations"] for w in m["workers"].values()]
        # The workers stop together: after worker 0 stops, another takes at most the step
        # it is in.
        assert max(iterations) - min(iterations) <= bound + 1, (policy, iterations)
        samples = [e["samples"] for e in m["evals"]]
        assert samples == sorted(samples), (policy, samples)
        assert samples[-1] == m["total_samples"]
