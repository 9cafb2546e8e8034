"""Job templates: the renderer against expected output, jobs/ in sync with it, and the scripts'
payloads run the way PBS and horovodrun run them.

The Slurm scripts are submitted to a real Slurm in tests/test_slurm.py.  PBS has no server in
Debian's packages, so the PBS script runs here with the environment a PBS server gives a job
(its copy of the script in the MOM's spool, started in $HOME, PBS_* variables, a nodefile).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mpsync.launch import run_with_deadline
from mpsync.launch.jobs import JobSettings, JobTemplateError, default_path, render, sync_jobs_dir
from mpsync.launch.registry import templates
from mpsync.policies import names as policy_names

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
VENV = Path(sys.executable).parent.parent
TRAIN_TIMEOUT = 240  # 3 oversubscribed ranks on 2 shared cores, one epoch of digits


def changed_lines(scheduler: str, template: str, settings: JobSettings) -> tuple[list, list]:
    """(lines only in the default script, lines only in the one rendered with settings)."""
    default = render(scheduler, template).splitlines()
    custom = render(scheduler, template, settings).splitlines()
    removed, added = [], []
    for line in difflib.unified_diff(default, custom, lineterm="", n=0):
        if line.startswith(("---", "+++", "@@")):
            continue
        (removed if line[0] == "-" else added).append(line[1:])
    return removed, added


# -- renderer ----------------------------------------------------------------------------------

def test_jobs_dir_is_what_the_renderer_writes_for_the_defaults():
    for (scheduler, template), rel in templates().items():
        path = JOBS / rel
        assert path.read_text() == render(scheduler, template), (
            f"{path} differs from `mpsync jobs render --scheduler {scheduler} --template "
            f"{template}`; run `.venv/bin/mpsync jobs sync` and commit the result")
        assert os.access(path, os.X_OK), f"{path} is not executable"
    assert sync_jobs_dir(JOBS, check=True) == []


def test_sync_writes_every_template(tmp_path):
    written = sync_jobs_dir(tmp_path)
    assert sorted(written) == sorted(str(tmp_path / rel) for rel in templates().values())
    assert sync_jobs_dir(tmp_path, check=True) == []
    (tmp_path / "pbs" / "train.pbs").write_text("stale\n")
    assert sync_jobs_dir(tmp_path, check=True) == [str(tmp_path / "pbs" / "train.pbs")]


SLOWDOWN_15 = "1,1,1,1,1,1,1,1,2,2,2,2,4,4,4"   # one factor per worker of 2 x 8 ranks
NAMES = " | ".join(policy_names())


def test_slurm_render_for_a_gpu_cluster_changes_exactly_the_expected_lines():
    removed, added = changed_lines("slurm", "train", JobSettings(
        nodes=2, tasks_per_node=8, gpus_per_node=4, time="12:00:00", partition="gpu",
        account="proj1", policy="esync", slowdown=SLOWDOWN_15, epochs=20,
        venv="/opt/mpsync/venv"))
    assert added == [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=12:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj1",
        "# other ranks train (16 ranks = 15 workers + server by default).",
        f"#   POLICY             {NAMES} (default: esync)",
        "#   EPOCHS             epochs per worker (default: 20); ignored if TIME_BUDGET is set",
        f"#   SLOWDOWN           per-worker slowdown factors, e.g. 1,1,2,4 (default: {SLOWDOWN_15})",
        "#   VENV               Python environment with mpsync (default: /opt/mpsync/venv)",
        "POLICY=${POLICY:-esync}",
        "EPOCHS=${EPOCHS:-20}",
        f"SLOWDOWN=${{SLOWDOWN:-{SLOWDOWN_15}}}",
        "VENV=${VENV:-/opt/mpsync/venv}",
    ]
    assert removed == [
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=5",
        "#SBATCH --time=01:00:00",
        "# other ranks train (5 ranks = 4 workers + server by default).",
        f"#   POLICY             {NAMES} (default: bsp)",
        "#   EPOCHS             epochs per worker (default: 5); ignored if TIME_BUDGET is set",
        "#   SLOWDOWN           per-worker slowdown factors, e.g. 1,1,2,4 (default: empty, none)",
        "#   VENV               Python environment with mpsync (default: the repository's .venv)",
        "POLICY=${POLICY:-bsp}",
        "EPOCHS=${EPOCHS:-5}",
        "SLOWDOWN=${SLOWDOWN:-}",
        "VENV=${VENV:-$REPO/.venv}",
    ]


def test_pbs_render_requests_cpus_for_every_rank_and_thread():
    removed, added = changed_lines("pbs", "train", JobSettings(
        nodes=2, tasks_per_node=8, cpus_per_task=2, gpus_per_node=1, partition="workq",
        job_name="mytrain", time="2-00:00:00"))
    assert added == [
        "#PBS -N mytrain",
        "#PBS -l select=2:ncpus=16:mpiprocs=8:ompthreads=2:ngpus=1",
        "#PBS -l walltime=2-00:00:00",
        "#PBS -q workq",
        "# other ranks train (16 ranks = 15 workers + server by default).",
    ]
    assert removed == ["#PBS -N mpsync-train",
                       "#PBS -l select=1:ncpus=5:mpiprocs=5:ompthreads=1",
                       "#PBS -l walltime=01:00:00",
                       "# other ranks train (5 ranks = 4 workers + server by default)."]


def test_horovodrun_render_multi_node():
    _, added = changed_lines("horovodrun", "train",
                             JobSettings(nodes=2, tasks_per_node=4, hosts="n1:4,n2:4"))
    assert "TASKS=8" in added and "HOSTS=${HOSTS:-n1:4,n2:4}" in added


def test_default_script_headers_and_settings():
    text = render("slurm", "train")
    assert text.startswith("#!/bin/bash\n#SBATCH --job-name=mpsync-train\n#SBATCH --nodes=1\n"
                           "#SBATCH --ntasks-per-node=5\n#SBATCH --cpus-per-task=1\n"
                           "#SBATCH --time=01:00:00\n#SBATCH --output=mpsync-train-%j.out\n#\n")
    # The settings a user overrides, each as a ${VAR:-default} override documented in the header.
    for name in ("POLICY", "TOPOLOGY", "BACKEND", "SERVER", "EPOCHS", "DATASET", "SLOWDOWN",
                 "OUT_DIR", "VENV"):
        for scheduler in ("slurm", "pbs", "horovodrun"):
            script = render(scheduler, "train")
            assert f"\n{name}=${{{name}:-" in script, (scheduler, name)
            assert f"\n#   {name} " in script, (scheduler, name)
    bench = render("slurm", "bench-kernels")
    assert "#SBATCH --exclusive\n" in bench and "#SBATCH --ntasks-per-node=1\n" in bench
    assert render("slurm", "compare").count("#SBATCH --time=02:00:00\n") == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="nope"), "unknown policy 'nope'"),
    (dict(policy="ssp", topology="ring"), "runs only on topology='ps'"),
    (dict(topology="star"), "unknown topology 'star'"),
    (dict(server="remote"), "unknown server 'remote'"),
    (dict(nodes=0), "nodes must be an integer >= 1"),
    (dict(tasks_per_node=1), "dedicated server needs at least 2 ranks"),
    (dict(time="90 minutes"), "time must look like HH:MM:SS"),
    (dict(job_name="my job"), "job-name must be"),
    (dict(venv="/opt/$HOME/venv"), "venv must not contain"),
    (dict(partition="a b"), "partition must not contain spaces"),
    (dict(slowdown="1,fast"), "slowdown: expected comma-separated numbers"),
    (dict(slowdown="1,4", tasks_per_node=8), "2 factors for the job's 7 workers"),
    (dict(target_acc="95"), r"target-acc must be a number in \(0, 1\]"),
    (dict(hosts="n1:4"), "--hosts is for horovodrun"),
])
def test_render_rejects_bad_settings_naming_them(kwargs, message):
    with pytest.raises(JobTemplateError, match=message):
        render("slurm", "train", JobSettings(**kwargs))


def test_topology_defaults_to_the_policys_own():
    # POLICY=ssp alone must be a valid submission: no TOPOLOGY default that contradicts it.
    for scheduler in ("slurm", "pbs", "horovodrun"):
        script = render(scheduler, "train", JobSettings(policy="ssp"))
        assert "\nPOLICY=${POLICY:-ssp}\nTOPOLOGY=${TOPOLOGY:-}\n" in script, scheduler
        assert "(default: empty, the policy's own: ps for asp, ssp, dssp;" in script
    assert "\nTOPOLOGY=${TOPOLOGY:-ps}\n" in render("slurm", "train",
                                                     JobSettings(policy="ssp", topology="ps"))
    assert "\nTOPOLOGY=${TOPOLOGY:-}\n" in render("slurm", "compare")


def test_compare_render_checks_every_policy_against_an_explicit_topology():
    assert "TOPOLOGY=${TOPOLOGY:-ps}" in render(
        "slurm", "compare", JobSettings(policies="bsp,ssp,esync", topology="ps"))
    with pytest.raises(JobTemplateError, match="policy='ssp' needs a central copy"):
        render("slurm", "compare", JobSettings(policies="bsp,ssp", topology="ring"))
    with pytest.raises(JobTemplateError, match="policy='osp' runs only on topology='ring'"):
        render("slurm", "compare", JobSettings(policies="bsp,osp", topology="ps"))


def test_bench_kernels_header_says_which_standard_settings_do_not_apply():
    header = render("slurm", "bench-kernels").split("\nset -euo pipefail")[0]
    note = header[header.index("# Not settings of this script:"):]
    for name in ("POLICY", "TOPOLOGY", "BACKEND", "SERVER", "EPOCHS", "DATASET", "SLOWDOWN"):
        assert name in note, name
        assert f"\n{name}=" not in render("slurm", "bench-kernels"), name
    assert "one process, with no mpirun" in " ".join(l.lstrip("# ") for l in note.splitlines())
    for name in ("OUT_DIR", "VENV"):
        assert f"\n#   {name} " in header


def test_render_rejects_unknown_scheduler_and_template():
    with pytest.raises(JobTemplateError, match="unknown scheduler 'lsf'"):
        render("lsf")
    with pytest.raises(JobTemplateError, match="no 'compare' template for pbs; pbs has: train"):
        render("pbs", "compare")
    with pytest.raises(JobTemplateError, match="horovodrun on more than one node needs --hosts"):
        render("horovodrun", "train", JobSettings(nodes=2))
    assert default_path("slurm", "bench-kernels") == "slurm/bench-kernels.sbatch"


def test_cli_render_prints_the_same_script_and_reports_errors(tmp_path):
    cli = [sys.executable, "-m", "mpsync.cli", "jobs"]
    out = subprocess.run(cli + ["render", "--scheduler", "pbs", "--nodes", "2",
                                "--tasks-per-node", "4", "--policy", "ebsp"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    # The script runs with the environment that rendered it, wherever it is saved.
    assert out == render("pbs", "train", JobSettings(nodes=2, tasks_per_node=4, policy="ebsp",
                                                     venv=str(VENV.resolve())),
                         script="THIS_SCRIPT")
    target = tmp_path / "my.sbatch"
    subprocess.run(cli + ["render", "--scheduler", "slurm", "--template", "bench-kernels",
                          "-o", str(target)], check=True, timeout=60)
    text = target.read_text()
    assert text == render("slurm", "bench-kernels", JobSettings(venv=str(VENV.resolve())),
                          script=str(target)) and os.access(target, os.X_OK)
    assert f"#   sbatch {target}\n" in text and "jobs/slurm" not in text
    bad = subprocess.run(cli + ["render", "--scheduler", "slurm", "--policy", "asp",
                                "--topology", "ring"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "policy='asp'" in bad.stderr and bad.stdout == ""
    listed = subprocess.run(cli + ["list"], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    assert "jobs/pbs/train.pbs" in listed and "bench-kernels" in listed


def test_scripts_are_valid_bash():
    for rel in templates().values():
        res = subprocess.run(["bash", "-n", str(JOBS / rel)], capture_output=True, text=True)
        assert res.returncode == 0, f"{rel}: {res.stderr}"
    if shutil.which("shellcheck"):  # stricter when available; not installed by `make setup`
        res = subprocess.run(["shellcheck", "-S", "warning",
                              *(str(JOBS / rel) for rel in templates().values())],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stdout


# -- payloads --------------------------------------------------------------------------------

def clean_env(**extra: str) -> dict:
    """The test's environment without any scheduler's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PBS_", "MPSYNC_", "OMPI_", "PMIX_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def pbs_job(tmp_path: Path, ranks: int, job_id: str = "4242.pbs-server", **variables):
    """Run jobs/pbs/train.pbs as PBS Pro would: from the MOM's spool copy, in $HOME, with the
    PBS_* variables and a nodefile listing this host once per MPI process."""
    submit_dir = tmp_path / "submit"
    home = tmp_path / "home"
    spool = tmp_path / "mom_priv" / "jobs"
    aux = tmp_path / "aux"
    for d in (submit_dir, home, spool, aux):
        d.mkdir(parents=True)
    script = spool / f"{job_id}.SC"
    shutil.copy(JOBS / "pbs" / "train.pbs", script)
    nodefile = aux / job_id
    nodefile.write_text(f"{socket.gethostname()}\n" * ranks)
    env = clean_env(
        HOME=str(home), PBS_JOBID=job_id, PBS_JOBNAME="mpsync-train",
        PBS_O_WORKDIR=str(submit_dir), PBS_O_HOME=str(home), PBS_O_HOST=socket.gethostname(),
        PBS_O_PATH=os.environ.get("PATH", ""), PBS_O_SHELL="/bin/bash", PBS_O_QUEUE="workq",
        PBS_QUEUE="workq", PBS_ENVIRONMENT="PBS_BATCH", PBS_NODEFILE=str(nodefile),
        PBS_NODENUM="0", PBS_TASKNUM="1", PBS_MOMPORT="15003", PBS_JOBDIR=str(home),
        NCPUS=str(ranks), TMPDIR=str(tmp_path), **{"VENV": str(VENV), **variables})
    res = run_with_deadline(["bash", str(script)], TRAIN_TIMEOUT, env=env, cwd=str(home))
    return res, submit_dir


def printed_command(stdout: str) -> list[str]:
    line = next(x for x in stdout.splitlines() if x.startswith("mpsync: ") and "run folder" not in x)
    return shlex.split(line[len("mpsync: "):])


def test_pbs_dry_run_builds_mpirun_over_the_nodefile(tmp_path):
    res, submit_dir = pbs_job(tmp_path, ranks=3, DRY_RUN="1", POLICY="esync",
                              SLOWDOWN="1,2", TRAIN_ARGS="--lookahead 7 --seed 3",
                              MPSYNC_DEADLINE="30")
    assert res.returncode == 0, res.stderr
    argv = printed_command(res.stdout)
    nodefile = str(tmp_path / "aux" / "4242.pbs-server")
    assert argv[:3] == ["mpirun", "-np", "3"]
    assert argv[argv.index("--hostfile") + 1] == nodefile
    for name in ("PATH", "OMP_NUM_THREADS", "MPSYNC_DEADLINE"):
        assert argv[argv.index(name) - 1] == "-x"
    train = argv[argv.index(str(VENV / "bin" / "python")):]
    out_dir = str(submit_dir / "mpsync-train-4242")
    # No TOPOLOGY: no --topology, mpsync train runs esync on its own topology (the ring).
    assert train == [str(VENV / "bin" / "python"), "-m", "mpsync.cli", "train",
                     "--policy", "esync", "--backend", "mpi",
                     "--server", "dedicated", "--dataset", "digits", "--out", out_dir,
                     "--epochs", "5", "--slowdown", "1,2", "--lookahead", "7", "--seed", "3"]
    assert not Path(out_dir).exists()  # a dry run creates nothing


def test_pbs_dry_run_passes_topology_only_when_set(tmp_path):
    res, _ = pbs_job(tmp_path / "ps", ranks=3, DRY_RUN="1", POLICY="ssp", TOPOLOGY="ps")
    assert res.returncode == 0, res.stderr
    argv = printed_command(res.stdout)
    assert argv[argv.index("--policy"):argv.index("--policy") + 4] == [
        "--policy", "ssp", "--topology", "ps"]
    res, _ = pbs_job(tmp_path / "own", ranks=3, DRY_RUN="1", POLICY="ssp")
    assert res.returncode == 0, res.stderr
    assert "--topology" not in printed_command(res.stdout)


@pytest.mark.parametrize("variables, message", [
    (dict(VENV="/nonexistent/venv"), "VENV=/nonexistent/venv has no bin/python"),
    (dict(TOPOLOGY="star"), "TOPOLOGY must be ring, ps or empty (the policy's own), got 'star'"),
    (dict(NP="1"), "SERVER=dedicated needs 2 ranks or more"),
    (dict(SERVER="remote"), "SERVER must be dedicated or colocated, got 'remote'"),
    (dict(NP="two"), "NP must be a positive integer, got 'two'"),
])
def test_pbs_payload_rejects_bad_settings_before_starting(tmp_path, variables, message):
    res, _ = pbs_job(tmp_path, ranks=3, **variables)
    assert res.returncode == 2 and message in res.stderr, (res.stdout, res.stderr)


def mca_of(argv: list[str]) -> dict[str, str]:
    return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--mca"}


def test_pbs_dry_run_launches_with_the_tuned_transport_unless_told_otherwise(tmp_path):
    from mpsync.transport import TUNED

    res, _ = pbs_job(tmp_path / "tuned", ranks=3, DRY_RUN="1")
    assert res.returncode == 0, res.stderr
    launch = printed_command(res.stdout)
    launch = launch[:launch.index(str(VENV / "bin" / "python"))]
    assert mca_of(launch) == {"mpi_yield_when_idle": "1", **dict(TUNED)}
    res, _ = pbs_job(tmp_path / "none", ranks=3, DRY_RUN="1", MPSYNC_MPI_TUNING="none")
    assert res.returncode == 0, res.stderr
    assert mca_of(printed_command(res.stdout)) == {"mpi_yield_when_idle": "1"}
    res, _ = pbs_job(tmp_path / "own", ranks=3, DRY_RUN="1",
                     MPSYNC_MPI_TUNING="btl_tcp_links=4")
    assert mca_of(printed_command(res.stdout)) == {"mpi_yield_when_idle": "1",
                                                    "btl_tcp_links": "4"}
    res, _ = pbs_job(tmp_path / "bad", ranks=3, DRY_RUN="1", MPSYNC_MPI_TUNING="links")
    assert res.returncode == 2 and "MPSYNC_MPI_TUNING='links'" in res.stderr, res.stderr


def test_pbs_payload_outside_a_job_says_so(tmp_path):
    res = run_with_deadline(["bash", str(JOBS / "pbs" / "train.pbs")], 30, env=clean_env(),
                            cwd=str(tmp_path))
    assert res.returncode != 0 and "not inside a PBS job" in res.stderr


def test_horovodrun_dry_run_uses_mpi_mode_and_the_repository_venv(tmp_path):
    res = run_with_deadline(["bash", str(JOBS / "horovodrun" / "train.sh")], 60,
                            env=clean_env(NP="3", DRY_RUN="1", BACKEND="mpi"), cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    argv = printed_command(res.stdout)
    # No VENV given: the repository's .venv, found from the script's own location.
    assert argv[:6] == [str(REPO / ".venv" / "bin" / "horovodrun"), "--mpi", "-np", "3",
                        "-H", "localhost:3"]
    assert "--backend" in argv and argv[argv.index("--backend") + 1] == "mpi"
    assert argv[argv.index("--out") + 1].startswith(str(tmp_path / "mpsync-train-"))
    # Horovod's own allreduce is an MPI_Allreduce: the transport settings go to its mpirun.
    from mpsync.transport import mca_argv

    assert f"--mpi-args=--mca mpi_yield_when_idle 1 {' '.join(mca_argv('tuned'))}" in argv


# -- mpsync compare: the flags compare.sbatch passes ------------------------------------------

def compare_args(*flags: str):
    from mpsync.apps import compare

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_compare_launches_np_ranks_colocated_and_np_plus_one_dedicated(tmp_path):
    from mpsync.apps.compare import launch_argv

    dedicated = launch_argv(compare_args("--np", "3"), "bsp", tmp_path / "bsp")
    colocated = launch_argv(compare_args("--np", "3", "--server", "colocated"), "bsp",
                            tmp_path / "bsp")
    assert dedicated[:3] == ["mpirun", "-np", "4"] and colocated[:3] == ["mpirun", "-np", "3"]
    for argv, server in ((dedicated, "dedicated"), (colocated, "colocated")):
        train = argv[argv.index("mpsync.apps.train") + 1:]
        assert train[train.index("--server") + 1] == server
        assert "--topology" not in train  # default: train picks the policy's own topology


def test_compare_on_one_host_tunes_the_transport_only_when_asked(tmp_path, monkeypatch):
    from mpsync.apps.compare import launch_argv

    monkeypatch.delenv("MPSYNC_MPI_TUNING", raising=False)
    assert "btl_tcp_links" not in launch_argv(compare_args(), "bsp", tmp_path / "bsp")
    monkeypatch.setenv("MPSYNC_MPI_TUNING", "tuned")  # what compare.sbatch exports
    argv = launch_argv(compare_args(), "bsp", tmp_path / "bsp")
    assert argv[argv.index("btl_tcp_links") + 1] == "2"


def test_compare_topology_is_passed_to_every_run(tmp_path):
    from mpsync.apps.compare import train_argv

    args = compare_args("--topology", "ps", "--policies", "bsp,ssp")
    for policy in ("bsp", "ssp"):
        argv = train_argv(args, policy, tmp_path / policy)
        assert argv[argv.index("--topology") + 1] == "ps"


@pytest.mark.parametrize("flags, message", [
    (["--topology", "ring", "--policies", "bsp,ssp"],
     "policy='ssp' needs a central copy of the weights and runs only on topology='ps' "
     "(got topology='ring')"),
    (["--topology", "ps", "--policies", "osp"], "policy='osp' runs only on topology='ring'"),
    (["--topology", "star"], "unknown topology 'star'"),
    (["--server", "remote"], "unknown server 'remote'"),
])
def test_compare_rejects_topology_and_server_before_launch(tmp_path, flags, message):
    out = tmp_path / "cmp"
    res = subprocess.run([sys.executable, "-m", "mpsync.cli", "compare", "--out", str(out),
                          *flags], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpsync compare: error: ") and \
        message in lines[0], res.stderr
    assert not out.exists(), "nothing may be launched or written"


# -- full runs (need `mpsync train`) ---------------------------------------------------------

def read_metrics(out_dir: Path) -> dict:
    path = out_dir / "metrics.json"
    assert path.exists(), f"no metrics.json in {out_dir}: {sorted(p.name for p in out_dir.iterdir())}"
    return json.loads(path.read_text())


def assert_run(metrics: dict, policy: str, workers: int) -> None:
    assert metrics["config"]["policy"] == policy
    assert metrics["config"]["workers"] == workers
    assert len(metrics["workers"]) == workers
    assert metrics["total_samples"] > 0 and metrics["evals"]


@pytest.mark.mpi
@pytest.mark.slow
def test_pbs_job_trains_and_writes_its_run_folder_beside_the_log(tmp_path):
    res, submit_dir = pbs_job(tmp_path, ranks=3, POLICY="esync", EPOCHS="1", BACKEND="mpi")
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    out_dir = submit_dir / "mpsync-train-4242"
    assert_run(read_metrics(out_dir), "esync", workers=2)
    assert (out_dir / "command.sh").read_text().startswith("mpirun -np 3 ")


@pytest.mark.mpi
@pytest.mark.slow
def test_horovodrun_script_trains(tmp_path):
    out_dir = tmp_path / "run"
    res = run_with_deadline(["bash", str(JOBS / "horovodrun" / "train.sh")], TRAIN_TIMEOUT,
                            env=clean_env(NP="3", POLICY="ebsp", EPOCHS="1", OUT_DIR=str(out_dir)),
                            cwd=str(tmp_path))
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    assert_run(read_metrics(out_dir), "ebsp", workers=2)
