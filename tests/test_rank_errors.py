"""An error on any rank ends the whole job: every rank, non-zero, within 30 s of the error,
and the output says why in one line; what the launcher can check is checked before any rank
starts.

The jobs run ``mpsync train`` as a user would under plain ``mpirun`` (``python -m mpsync.cli
train``, the console script's path): nothing of the test harness's own runner is in the way,
so what ends the job is mpsync's.  ``mpirun --timestamp-output`` stamps every line, which
times the job's end from the error line (to the second).  A rank left behind after ``mpirun``
returned would be a rank still running: each job is tagged (``MPSYNC_TEST_TAG``) so that the
test finds, and in the end kills, any such process.  A script of the user's
(``rank_error_programs.py``) runs as a plain script too.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpi_harness import REPO, TESTS_DIR, run_mpi, tagged_pids
from mpsync import cli
from mpsync.launch import mpirun_argv, run_with_deadline

LIMIT = 30.0        # seconds from the error to the end of every rank
HARD_TIMEOUT = 120  # the harness's; a job still running then is a hang (2 shared cores)
RUN = ["--no-progress", "--no-plots"]


_STAMP = re.compile(r"(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})<std(?:out|err)>:")


def stamped(text: str) -> list[tuple[float, str]]:
    """``mpirun --timestamp-output``'s output as (clock, line); each chunk a rank wrote has
    its stamp (a line's newline may come as a chunk of its own)."""
    out = []
    pieces = _STAMP.split(text)
    for stamp, chunk in zip(pieces[1::2], pieces[2::2]):
        clock = time.mktime(time.strptime(stamp, "%a %b %d %H:%M:%S %Y"))
        out += [(clock, line) for line in chunk.splitlines() if line.strip()]
    return out


def train_job(np_: int, argv: list[str], tag: str):
    """``mpirun -np np_ mpsync train argv``; returns (result, the clock when mpirun ended,
    the tagged processes still alive then, the stamped lines)."""
    env = dict(os.environ, MPSYNC_TEST_TAG=tag, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(TESTS_DIR),
                                                    env.get("PYTHONPATH", "")) if p)
    env.pop("MPSYNC_DEBUG", None)
    command = [sys.executable, "-m", "mpsync.cli", "train", *argv, *RUN]
    forward = ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "MPSYNC_TEST_TAG")
    argv_ = mpirun_argv(np_, command, forward_env=forward, extra=("--timestamp-output",))
    try:
        res = run_with_deadline(argv_, HARD_TIMEOUT, env=env)
        ended = time.time()
        left = tagged_pids(tag)
    finally:
        for pid in tagged_pids(tag):   # a stopped rank, or one a hang left behind
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    return res, ended, left, stamped(res.stdout + "\n" + res.stderr)


def report(res, left) -> str:
    why = "timed out" if res.timed_out else f"exit {res.returncode}"
    return (f"{why} after {res.elapsed:.1f}s; still alive: {left}\n--- stdout ---\n"
            f"{res.stdout[-4000:]}\n--- stderr ---\n{res.stderr[-6000:]}")


def assert_ended_for(res, ended, left, lines, cause: str) -> str:
    """Every rank ended, non-zero, within LIMIT of the first line naming ``cause``, which
    is one line (no traceback anywhere); returns that line."""
    assert not res.timed_out and not left, report(res, left)
    assert res.returncode not in (0, None), report(res, left)
    said = [(t, text) for t, text in lines if re.search(cause, text)]
    assert said, report(res, left)
    took = ended - said[0][0]
    print(f"\njob ended {took:.0f}s after the error (exit {res.returncode}): {said[0][1]}")
    assert took <= LIMIT + 1, report(res, left)   # + 1: the stamps are whole seconds
    assert "Traceback" not in res.stdout + res.stderr, report(res, left)
    return said[0][1]


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["ssp", "esync"])
def test_a_stopped_worker_on_the_ps_ends_the_job_under_plain_mpirun(policy):
    # The last worker (world rank 3) stops; the live ones go on to the end of their budget,
    # then cannot finish without it: named, then the job ends (it used to wait forever in
    # the shutdown at exit and MPI_Finalize, after cli.main had caught the error).
    res, ended, left, lines = train_job(4, ["--policy", policy, "--topology", "ps",
                                            "--time-budget", "4", "--deadline", "4",
                                            "--silent-timeout", "3", "--stop-at-step", "3"],
                                        f"stop-{policy}-{os.getpid()}")
    line = assert_ended_for(res, ended, left, lines, r"no word from worker 2 \(world rank 3")
    assert "fault: rank" in line, line


@pytest.mark.mpi
def test_a_data_file_the_ranks_cannot_use_ends_the_job_under_plain_mpirun(tmp_path):
    # Class indices below 0 show only once the file is read, on each worker after MPI has
    # started: the error is one line naming the rank, and it ends the job (it used to print a
    # traceback on each worker and hang, the state server's rank spinning).
    data = tmp_path / "negative.npz"
    np.savez(data, x=np.zeros((64, 4), np.float32), y=-np.ones(64, np.int64))
    res, ended, left, lines = train_job(3, ["--dataset", f"npz:{data}", "--time-budget", "5"],
                                        f"data-{os.getpid()}")
    line = assert_ended_for(res, ended, left, lines, r"y must hold class indices")
    assert re.search(r"mpsync train \(rank [12]\): error: --dataset npz:", line), line


@pytest.mark.mpi
def test_a_data_file_without_x_and_y_is_one_line_from_rank_0_under_plain_mpirun(tmp_path):
    data = tmp_path / "ab.npz"
    np.savez(data, a=np.zeros((64, 4), np.float32), b=np.zeros(64, np.int64))
    res, ended, left, lines = train_job(3, ["--dataset", f"npz:{data}", "--time-budget", "5"],
                                        f"ab-{os.getpid()}")
    assert_ended_for(res, ended, left, lines, r"needs arrays 'x' \(samples\) and 'y'")
    assert res.returncode == 2, report(res, left)
    said = [text for _, text in lines if "error:" in text]
    assert said == [f"mpsync train: error: --dataset npz:{data}: needs arrays 'x' (samples) "
                    f"and 'y' (class indices), has 'a', 'b'"], report(res, left)


def run_cli(argv, env, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MPSYNC_DEBUG", "0")
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def data_files(tmp: Path) -> dict[str, Path]:
    files = {"ab": dict(a=np.zeros((64, 4), np.float32), b=np.zeros(64, np.int64)),
             "lengths": dict(x=np.zeros((64, 4), np.float32), y=np.zeros(63, np.int64)),
             "float-y": dict(x=np.zeros((64, 4), np.float32), y=np.zeros(64, np.float32)),
             "text-x": dict(x=np.array([["a"] * 4] * 64), y=np.zeros(64, np.int64))}
    out = {}
    for name, arrays in files.items():
        np.savez(tmp / f"{name}.npz", **arrays)
        out[name] = tmp / f"{name}.npz"
    (tmp / "not-a-zip.npz").write_text("x,y\n1,2\n")
    out["not-a-zip"] = tmp / "not-a-zip.npz"
    return out


@pytest.mark.parametrize("name, expected", [
    ("ab", "needs arrays 'x' (samples) and 'y' (class indices), has 'a', 'b'"),
    ("lengths", "x has 64 rows, y has 63; they must be equal"),
    ("float-y", "y must be one integer class index per sample, got shape (64,) of float32"),
    ("text-x", "x must be real numbers"),
    ("not-a-zip", "cannot read it as a .npz file of numpy arrays"),
])
def test_a_data_file_is_checked_before_any_rank_starts(name, expected, tmp_path, monkeypatch,
                                                       capsys):
    path = data_files(tmp_path)[name]
    started = time.monotonic()
    rc, out, err = run_cli(["train", "--np", "2", "--time-budget", "5", "--dataset",
                            f"npz:{path}"], {}, monkeypatch, capsys)
    assert rc == 2 and out == "" and err.splitlines() == [
        f"mpsync train: error: --dataset npz:{path}: " + err.split(f"npz:{path}: ", 1)[1].rstrip()]
    assert expected in err, err
    assert time.monotonic() - started < 60, "no rank may have started"


@pytest.mark.parametrize("variable, value, expected", [
    ("MPSYNC_POLICY", "nonsense", "unknown policy 'nonsense'"),
    ("MPSYNC_SERVER", "nowhere", "unknown server 'nowhere'"),
    ("MPSYNC_DEADLINE", "soon", "MPSYNC_DEADLINE='soon' is not a number"),
    ("MPSYNC_STALENESS", "-1", "staleness"),
])
def test_a_bad_mpsync_setting_in_the_environment_is_refused_by_train(variable, value, expected,
                                                                     monkeypatch, capsys):
    rc, out, err = run_cli(["train", "--np", "2", "--time-budget", "5"], {variable: value},
                           monkeypatch, capsys)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("mpsync train: error: ") and expected in err and variable in err, err


def test_train_honours_mpsync_settings_in_the_environment_below_its_flags(monkeypatch):
    from mpsync.apps.train import add_arguments, build_config

    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for name, value in (("MPSYNC_POLICY", "ssp"), ("MPSYNC_DEADLINE", "42"),
                        ("MPSYNC_SERVER", "colocated"), ("MPSYNC_COMM_DELAY", "0.01"),
                        ("MPSYNC_STALENESS", "5")):
        monkeypatch.setenv(name, value)
    args = parser.parse_args(["--time-budget", "5", "--staleness", "7"])
    config = build_config(args)
    assert (config.policy, config.topology, config.deadline, config.server, config.comm_delay,
            config.staleness) == ("ssp", "ps", 42.0, "colocated", 0.01, 7)
    # What the launcher reads and passes on to the ranks as flags:
    assert (args.policy, args.server, args.comm_delay) == ("ssp", "colocated", 0.01)
    args = parser.parse_args(["--time-budget", "5", "--policy", "bsp", "--server", "dedicated"])
    assert (build_config(args).policy, args.server) == ("bsp", "dedicated")


@pytest.mark.parametrize("model, features, differs", [
    ("wide-mlp", 32, "it lacks hidden.0.bias"),   # another architecture
    ("mlp", 16, " is [64, 32] there, [64, 16] here"),   # the same one on other data
])
def test_a_checkpoint_of_another_model_is_one_line_before_any_rank_starts(
        model, features, differs, tmp_path, monkeypatch, capsys):
    from mpsync.apps.checkpoint import save_checkpoint
    from mpsync.apps.models import build_model

    # Written by a run of the MLP on the synthetic set's 32 features and 10 classes.
    written = save_checkpoint(tmp_path / "run" / "checkpoints", 4,
                              {"model": build_model((32,), 10, 0, "mlp").state_dict()})
    started = time.monotonic()
    rc, out, err = run_cli(["train", "--np", "2", "--time-budget", "5", "--dataset", "synthetic",
                            "--synthetic-features", str(features), "--model", model,
                            "--out", str(tmp_path / "o"), "--resume", str(tmp_path / "run")],
                           {}, monkeypatch, capsys)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"mpsync train: error: --resume {written}: the checkpoint holds "
                          f"another model than --model {model} on --dataset synthetic builds ("), err
    assert differs in err and "Traceback" not in err, err
    assert time.monotonic() - started < 60, "no rank may have started"


def test_a_restart_with_no_checkpoint_yet_says_all_progress_is_lost(tmp_path, capsys):
    from mpsync.apps.checkpoint import save_checkpoint
    from mpsync.apps.train_restarts import restart_point

    assert restart_point(tmp_path, 1) is None
    assert capsys.readouterr().err.splitlines() == [
        f"mpsync train: restart 1: no checkpoint was written in {tmp_path} before the failure "
        f"(the first comes after --checkpoint-every rounds): starting over from step 0; all "
        f"progress so far is lost"]
    save_checkpoint(tmp_path / "checkpoints", 3, {"round": 3})
    assert restart_point(tmp_path, 2) == tmp_path / "restarts" / "restart-2"
    assert capsys.readouterr().err == ""


@pytest.mark.mpi
def test_an_error_before_init_ends_a_script_job():
    # The others are in init()'s first collective, waiting for the failed rank forever.
    started = time.time()
    run = run_mpi(str(TESTS_DIR / "rank_error_programs.py"), np=3, args=["raise_before_init"],
                  timeout=HARD_TIMEOUT, check=False)
    ended = started + run.elapsed
    assert not run.timed_out and run.returncode not in (0, None), run.report()
    [error_at] = [float(line.split()[1]) for line in run.rank_out(2).splitlines()
                  if line.startswith("ERROR-AT ")]
    assert ended - error_at <= LIMIT, run.report()
    assert "MPSYNC-RANK-FAILED rank 2" in run.rank_err(2), run.report()
    assert "ValueError: a bug in the script before init" in run.rank_err(2), run.report()


@pytest.mark.mpi
def test_an_error_on_a_rank_ends_a_job_started_by_horovodrun():
    # horovodrun (its mpirun path) starts the ranks; mpsync's abort hook ends the job all the
    # same, naming the rank, and nothing is left running.
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
    assert horovodrun, "horovodrun is installed with Horovod (make setup)"
    tag = f"hvdrun-{os.getpid()}"
    env = dict(os.environ, MPSYNC_TEST_TAG=tag,
               PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS_DIR)]))
    t0 = time.monotonic()
    try:
        res = subprocess.run([horovodrun, "-np", "4", "--mpi-args",
                              "--oversubscribe --allow-run-as-root", sys.executable,
                              str(TESTS_DIR / "torch_programs.py"), "fail_worker_raises",
                              "victim=1"], capture_output=True, text=True, env=env,
                             timeout=HARD_TIMEOUT, cwd="/tmp")
    finally:
        left = tagged_pids(tag)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    text = res.stdout + res.stderr
    assert res.returncode != 0, text[-3000:]
    assert "MPSYNC-RANK-FAILED rank 2 (worker 1)" in text, text[-3000:]
    assert "deliberate failure on worker 1" in text, text[-3000:]
    assert not left, f"ranks still running after horovodrun returned: {left}"
    assert time.monotonic() - t0 < HARD_TIMEOUT
