"""What a new user meets first: the help, compare's defaults for any worker count, bare
``mpsync simulate``, and outputs that never land on files the repository tracks."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpsync.apps import compare, runs, simulate
from mpsync.bench import BENCHMARKS
from mpsync.launch import run_with_deadline

REPO = Path(__file__).resolve().parent.parent


def help_of(*command: str) -> str:
    res = subprocess.run([sys.executable, "-m", "mpsync.cli", *command, "--help"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, COLUMNS="200"))
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_the_help_lists_every_benchmark_and_the_run_command():
    top = help_of()
    for name in BENCHMARKS:
        assert name in top.split("bench", 1)[1].split("\n", 1)[0], (name, top)
    assert "run " in top and "--np" in help_of("run")


def test_train_help_shows_every_flags_default():
    text = help_of("train")
    # each option's entry: from its line to the next option's
    entries = {m.group(1): m.group(0) for m in re.finditer(
        r"^  (-[-\w]+)(?:, -[-\w]+)?[^\n]*\n(?:(?!  -)[^\n]*\n)*", text, flags=re.M)}
    for flag, default in (("--dataset", "digits"), ("--model", "auto"), ("--lr", "0.05"),
                          ("--batch-size", "32"), ("--partition", "iid"), ("--seed", "0"),
                          ("--momentum", "0.9"), ("--synthetic-samples", "4096"),
                          ("--staleness", "3"), ("--staleness-range", "3,15"),
                          ("--lookahead", "15"), ("--deadline", "20"), ("--policy", "bsp")):
        assert f"default {default}" in " ".join(entries[flag].split()), entries[flag]
    no_default = [f for f, e in entries.items() if "default" not in e]
    # flags that are off unless given, or whose absence is the setting
    assert set(no_default) <= {"-h", "--stop-at-target", "--no-progress", "--no-plots",
                               "--epochs", "--time-budget", "--target-acc", "--out",
                               "--resume", "--slowdown", "--slowdown-schedule",
                               "--iter-time", "--topology", "--hostfile", "--mpirun-args",
                               "--cluster", "--np", "-H", "--min-np", "--max-np",
                               "--nesterov"}, no_default


@pytest.mark.parametrize("workers, slowdown", [(1, "1"), (2, "1,2"), (3, "1,1,2"),
                                               (4, "1,1,2,4"), (8, "1,1,1,1,2,2,4,4")])
def test_compares_default_slowdown_scales_with_the_workers(workers, slowdown):
    assert runs.default_slowdown(workers) == slowdown


def test_each_run_gets_a_fresh_folder_under_runs(tmp_path):
    first = Path(runs.fresh_run_dir("compare", root=str(tmp_path)))
    assert first.parent == tmp_path and first.name.startswith("compare-")
    first.mkdir()
    assert runs.fresh_run_dir("compare", root=str(tmp_path)) != str(first)
    assert subprocess.run(["git", "check-ignore", "-q", "runs/compare-x/table.md"],
                          cwd=REPO).returncode == 0


def test_bare_simulate_takes_trains_defaults():
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args([])
    assert args.ps_shards == "auto" and args.workers is None
    args.iterations, args.policies = 5, "bsp,dssp"   # a short run of the same defaults
    rows = simulate.run_rows(args)
    assert [(r["policy"], r["workers"]) for r in rows] == [("bsp", 4), ("dssp", 4)]
    assert rows[1]["ps_shards"] == 4 and rows[1]["config"]["staleness_high"] == 15
    args.staleness_range = "2,6"
    assert simulate.run_rows(args)[1]["config"] == {"staleness_low": 2, "staleness_high": 6}


@pytest.mark.mpi
def test_compare_runs_two_workers_into_a_fresh_folder(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = run_with_deadline([sys.executable, "-m", "mpsync.cli", "compare", "--np", "2",
                             "--policies", "bsp", "--time-budget", "3", "--json",
                             "--train-args", "--deadline 60"], 300,
                            env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    [out] = list((tmp_path / "runs").iterdir())
    assert out.name.startswith("compare-")
    assert json.loads((out / "compare.json").read_text())["rows"][0]["policy"] == "bsp"
    assert "slowdown 1,2" in (out / "table.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_make_demo_writes_under_runs_and_bench_compare_is_explicit():
    makefile = (REPO / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert "--out" not in demo and "mpsync.apps.compare" in demo
    bench = re.search(r"^bench-compare:.*\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert "--out bench/compare" in bench
    assert compare.DEMO_POLICIES
