"""The launch registry: every way mpsync starts ranks is one registered target; a target added
from outside (registry call plus its own definition, nothing else) renders job scripts and
builds command lines like mpsync's own."""

from __future__ import annotations

import subprocess

import pytest

from mpsync import launch
from mpsync.launch import registry
from mpsync.launch.horovodrun import horovodrun_argv
from mpsync.launch.jobs import JobSettings, JobTemplateError, render, schedulers

TOY_PROLOGUE = """
set -euo pipefail
JOB_ID=${{TOY_JOB:?not inside a toy job}}
LOG_DIR=$PWD
REPO=$PWD
TASKS={ranks}
HOSTFILE=""
"""

TOY_LAUNCH = """
launch=(toyrun --ranks "$NP" $TOY_ARGS)
command=("${launch[@]}" "${train[@]}")
"""


def _toy_header(template, s):
    return [f"#TOY nodes={s.nodes} tasks={s.tasks_per_node} time={s.time}"]


def _toy_argv(nprocs, command, **options):
    return ["toyrun", "--ranks", str(nprocs), *command]


@pytest.fixture
def toy():
    target = launch.LaunchTarget(
        name="toy", description="a scheduler of our own", argv=_toy_argv,
        templates={"train": "toy/train.sh"}, words=("a toy batch job", "toyrun"),
        usage={"train": ["toysub train.sh"]}, tested={"train": ["Tested: test_launch_targets"]},
        header=_toy_header, prologue=TOY_PROLOGUE, launch_text=TOY_LAUNCH,
        variables=lambda template, s: [("TOY_ARGS", "", "more toyrun options")])
    launch.register(target)
    yield target
    launch.unregister("toy")


def test_a_target_registered_alone_renders_a_job_script(toy, tmp_path):
    assert "toy" in schedulers() and registry.templates()[("toy", "train")] == "toy/train.sh"
    text = render("toy", "train", JobSettings(nodes=2, tasks_per_node=3, policy="esync"))
    lines = text.splitlines()
    assert lines[:2] == ["#!/bin/bash", "#TOY nodes=2 tasks=3 time=01:00:00"]
    assert "# mpsync train as a toy batch job: every task is one MPI rank, all started by one" \
        in text
    assert "#   toysub train.sh" in lines and "TASKS=6" in lines
    assert "POLICY=${POLICY:-esync}" in lines and "TOY_ARGS=${TOY_ARGS:-}" in lines
    assert "# Tested: test_launch_targets" in lines
    # what it starts: its own launch line in front of the shared mpsync train command
    script = tmp_path / "train.sh"
    script.write_text(text)
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to("/bin/true")
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "TOY_JOB": "7",
                                            "DRY_RUN": "1", "VENV": str(tmp_path / "venv")})
    assert res.returncode == 0, res.stderr
    assert "mpsync: toyrun --ranks 6 " in res.stdout
    assert "-m mpsync.cli train --policy esync" in res.stdout


def test_a_registered_target_builds_its_command_line(toy):
    assert launch.get("toy").launch_argv(3, ["x"]) == ["toyrun", "--ranks", "3", "x"]


def test_unregistered_target_and_missing_parts_are_named(toy):
    launch.unregister("toy")
    with pytest.raises(JobTemplateError, match="unknown scheduler 'toy'"):
        render("toy", "train")
    with pytest.raises(launch.LaunchError, match="unknown launch target 'toy'"):
        launch.get("toy")
    launch.register(toy)
    with pytest.raises(launch.LaunchError, match="already registered"):
        launch.register(launch.LaunchTarget(name="toy", description="another"))
    with pytest.raises(launch.LaunchError, match="no prologue or launch text"):
        launch.register(launch.LaunchTarget(name="half", description="",
                                            templates={"train": "half.sh"}))
    with pytest.raises(launch.LaunchError, match="takes a LaunchTarget"):
        launch.register("toy")
    with pytest.raises(launch.LaunchError, match="starts ranks only from a job script"):
        launch.get("slurm").launch_argv(2, ["x"])


def test_mpsyncs_targets_are_registered():
    assert launch.names()[:2] == ("mpirun", "cluster")
    assert set(launch.names()) >= {"mpirun", "cluster", "horovodrun", "slurm", "pbs"}
    assert schedulers() == ("slurm", "pbs", "horovodrun")


def test_launch_argv_is_the_local_target_without_a_cluster():
    argv = launch.launch_argv(3, ["python", "x.py"], allow_run_as_root=False)
    assert argv == launch.mpirun_argv(3, ["python", "x.py"], allow_run_as_root=False)


def test_horovodrun_argv_runs_in_mpi_mode_on_this_machine_by_default():
    argv = horovodrun_argv(4, ["python", "x.py"], horovodrun="hvdrun")
    assert argv == ["hvdrun", "--mpi", "-np", "4", "-H", "localhost:4",
                    "--mpi-args=--mca mpi_yield_when_idle 1", "python", "x.py"]
    assert horovodrun_argv(2, ["a"], hosts="n1:1,n2:1", horovodrun="h")[5] == "n1:1,n2:1"
    with pytest.raises(ValueError, match="nprocs"):
        horovodrun_argv(0, ["a"])
