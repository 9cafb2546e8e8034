"""Every user mistake is one line naming the setting, the value and the fix, exit status 2, no
traceback; checked before any rank starts where it can be.  A bug is not one of them: it keeps
its traceback and says it is a bug.

Most mistakes are caught by ``mpsync`` itself before it starts mpirun, so they are checked in
this process (``mpsync.cli.main``); the few that only a rank can see (a setting read by
``mpsync.torch.init`` from the environment, ``mpirun -np 1`` leaving no worker) run as ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpi_harness import run_mpi
from mpsync import cli

PROGRAMS = str(Path(__file__).resolve().parent / "user_error_programs.py")
RUN = ["--time-budget", "5"]


def mistakes(tmp):
    """(what the user got wrong, argv, environment, what the one line must say)."""
    afile = tmp / "afile"    # a plain file (the test writes it)
    train = ["train", "--np", "2", *RUN]
    return [
        ("train without --np outside mpirun", ["train", *RUN], {}, "--np N is needed"),
        ("an unknown policy", [*train, "--policy", "nonsense"], {},
         "unknown policy 'nonsense'; choose one of: bsp"),
        ("ssp on the ring", [*train, "--policy", "ssp", "--topology", "ring"], {},
         "policy='ssp' needs a central copy of the weights and runs only on topology='ps'"),
        ("a staleness range of one number", [*train, "--policy", "dssp",
                                             "--staleness-range", "5"], {},
         "--staleness-range: expected sL,sU integers (e.g. 3,15), got '5'"),
        ("a staleness that is no number", [*train, "--staleness", "abc"], {},
         "argument --staleness: invalid int value: 'abc'"),
        ("--out under a file", [*train, "--out", str(afile / "run")], {},
         f"--out {afile / 'run'}: {afile} is a file, not a directory"),
        ("--out where nobody can write", [*train, "--out", "/proc/mpsync-run"], {},
         "--out /proc/mpsync-run: cannot write there"),
        ("a learning rate that is no number", [*train, "--lr", "fast"], {},
         "argument --lr: invalid float value: 'fast'"),
        ("a flag that does not exist", [*train, "--polcy", "ssp"], {},
         "unrecognized arguments: --polcy ssp"),
        ("neither epochs nor a time budget", ["train", "--np", "2"], {},
         "give exactly one of --epochs N or --time-budget S"),
        ("fewer slowdown factors than workers", [*train, "--slowdown", "1,4", "--np", "4"], {},
         "--slowdown: 2 values for 4 workers"),
        ("a host without a slot count", [*train, "-H", "node1:x"], {}, "is not HOST or HOST:SLOTS"),
        ("more workers than the hosts' slots", [*train, "--np", "5", "-H", "n1:2,n2:2"], {},
         "--np 5 asks for more workers than the 4 slots of -H n1:2,n2:2"),
        ("a hostfile that is not there", [*train, "--hostfile", str(tmp / "nohosts")], {},
         f"--hostfile {tmp / 'nohosts'}: cannot read it"),
        ("resuming from a folder that is not there",
         [*train, "--out", str(tmp / "o"), "--resume", str(tmp / "nothing")], {},
         f"--resume {tmp / 'nothing'}: no such file or directory"),
        ("zero parameter-server shards", [*train, "--policy", "ssp", "--ps-shards", "0"], {},
         "ps_shards (--ps-shards, MPSYNC_PS_SHARDS) must be 'auto' or an integer >= 1"),
        ("MPSYNC_PS_SHARDS that is no count", [*train, "--policy", "ssp"],
         {"MPSYNC_PS_SHARDS": "many"}, "got 'many'"),
        ("the server's optimizer under auto", [*train, "--policy", "auto", "--ps-optimizer",
                                               "server"], {},
         "ps_optimizer='server' (--ps-optimizer, MPSYNC_PS_OPTIMIZER) cannot run under "
         "policy='auto'"),
        ("an unknown backend", [*train, "--backend", "tcp"], {},
         "unknown backend 'tcp'; choose one of: mpi, horovod, gloo, nccl"),
        *([("NCCL without CUDA", [*train, "--backend", "nccl"], {},
            "backend='nccl' needs CUDA, and torch.cuda.is_available() is False")]
          if not torch.cuda.is_available() else []),
        ("a bucket size of zero", [*train, "--bucket-mb", "0"], {},
         "bucket_mb (--bucket-mb, MPSYNC_BUCKET_MB) must be a number of MiB > 0"),
        ("MPSYNC_BUCKET_MB that is no number", train, {"MPSYNC_BUCKET_MB": "big"},
         "MPSYNC_BUCKET_MB='big' is not a number"),
        ("an unknown server placement", [*train, "--server", "nowhere"], {},
         "unknown server 'nowhere'; choose one of: dedicated, colocated"),
        ("an unknown model", [*train, "--model", "vgg"], {},
         "unknown --model 'vgg'; choose from"),
        ("a data file that is not there", [*train, "--dataset", f"npz:{tmp / 'x.npz'}"], {},
         str(tmp / "x.npz")),
        ("compare with a policy twice", ["compare", "--policies", "bsp,bsp"], {},
         "--policies bsp,bsp: bsp given twice"),
        ("compare --out under a file", ["compare", "--np", "2", "--out", str(afile / "c")], {},
         f"{afile} is a file, not a directory"),
        ("compare with a slowdown for other workers", ["compare", "--np", "2", "--slowdown",
                                                       "1,2,3"], {},
         "--slowdown: 3 values for 2 workers"),
        ("run without --np", ["run", "python", "train.py"], {}, "--np is required"),
        ("run without a program", ["run", "--np", "2"], {}, "give the program to run"),
        ("simulate zero workers", ["simulate", "--workers", "0"], {}, "--workers must be >= 1"),
        ("simulate an unknown policy", ["simulate", "--policies", "nonsense"], {},
         "unknown policy 'nonsense' in --policies"),
        ("simulate auto", ["simulate", "--policies", "bsp,auto"], {},
         "--policies auto: auto chooses among the others as a run goes; to see what it would "
         "choose, run mpsync advise"),
        ("simulate an upside-down staleness range", ["simulate", "--policies", "dssp",
                                                     "--staleness-range", "9,2"], {},
         "s_L=9 > s_U=2"),
        ("a Slurm job whose slowdown misses workers",
         ["jobs", "render", "--scheduler", "slurm", "--tasks-per-node", "8", "--slowdown",
          "1,4"], {}, "slowdown 1,4: 2 factors for the job's 7 workers"),
    ]


def run_cli(argv, env, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # Set (not deleted) so that the teardown restores the variable's absence: ``--debug`` writes
    # MPSYNC_DEBUG=1 into os.environ for the ranks it starts, and it must not outlive the test.
    monkeypatch.setenv("MPSYNC_DEBUG", "0")
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:   # argparse's own errors exit here
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_there_are_at_least_twenty():
    assert len(NAMES) >= 20 and len(set(NAMES)) == len(NAMES)


NAMES = [m[0] for m in mistakes(Path("/tmp"))]


@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_a_mistake_is_one_line_and_exit_status_2(index, tmp_path, monkeypatch, capsys):
    what, argv, env, expected = mistakes(tmp_path)[index]
    (tmp_path / "afile").write_text("")
    rc, out, err = run_cli(argv, env, monkeypatch, capsys)
    lines = err.splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, (what, rc, out, err)
    assert lines[0].startswith("mpsync"), (what, err)
    assert "error: " in lines[0] and expected in lines[0], (what, err)
    assert not list(tmp_path.glob("o*")) and not list(tmp_path.glob("runs")), \
        "nothing may be written"


def test_debug_shows_the_traceback_of_a_user_error(monkeypatch, capsys):
    rc, _, err = run_cli(["--debug", "train", "--np", "2", *RUN, "--policy", "nonsense"], {},
                         monkeypatch, capsys)
    last = err.rstrip().splitlines()[-1]
    assert rc == 2 and "Traceback" in err and last.startswith(
        "mpsync train: error: unknown policy 'nonsense'; choose one of: bsp, asp,"), err


def test_a_bug_keeps_its_traceback_and_says_it_is_one(monkeypatch, capsys):
    from mpsync.apps import simulate

    def broken(args, log=None):
        raise KeyError("a bug")
    monkeypatch.setattr(simulate, "run_rows", broken)
    rc, _, err = run_cli(["simulate"], {}, monkeypatch, capsys)
    assert rc == 1 and "Traceback" in err and "KeyError: 'a bug'" in err
    assert err.rstrip().splitlines()[-1] == (
        "mpsync simulate: internal error: KeyError is a bug in mpsync, not in your settings; "
        "please report it with the traceback above")


@pytest.mark.parametrize("variable, value, expected", [
    ("MPSYNC_ESYNC_DELAYED_ACK", "maybe", "MPSYNC_ESYNC_DELAYED_ACK='maybe' is not a boolean"),
    ("MPSYNC_STALENESS", "abc", "MPSYNC_STALENESS='abc' is not an integer"),
    ("MPSYNC_DEADLINE", "soon", "MPSYNC_DEADLINE='soon' is not a number"),
    ("MPSYNC_SERVER_FAST_PATH", "2", "MPSYNC_SERVER_FAST_PATH='2' is not a boolean"),
])
def test_a_bad_environment_value_in_a_script_is_one_line(variable, value, expected):
    # Before MPI starts: the script alone is enough to see it (a job prints it once, below).
    env = dict(os.environ, **{variable: value})
    env.pop("MPSYNC_DEBUG", None)
    res = subprocess.run([sys.executable, PROGRAMS, "init"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"mpsync: error: {expected}" + res.stderr.split(expected, 1)[1].rstrip()], res.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("args, env, expected", [
    (["policy=ssp", "topology=ring"], {}, "mpsync: error: policy='ssp' needs a central copy "
                                          "of the weights and runs only on topology='ps'"),
    ([], {"MPSYNC_POLICY": "nonsense"}, "mpsync: error: unknown policy 'nonsense'"),
    pytest.param(["backend=nccl"], {}, "mpsync: error: backend='nccl' needs CUDA",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_a_bad_init_setting_ends_a_job_with_one_line_on_one_rank(args, env, expected):
    run = run_mpi(PROGRAMS, np=3, args=["init", *args], env=dict(os.environ, **env),
                  check=False, timeout=120)
    assert run.returncode == 2 and not run.timed_out, run.report()
    said = {r: o.get("stderr", "") for r, o in run.ranks.items() if o.get("stderr")}
    assert list(said) == [0] and said[0].startswith(expected), run.report()
    assert said[0].count("\n") == 1 and "Traceback" not in said[0], run.report()


@pytest.mark.mpi
def test_mpirun_of_one_rank_says_the_server_takes_it():
    run = run_mpi(PROGRAMS, np=1, args=["cli", "train", *RUN], check=False, timeout=60)
    assert run.returncode == 2, run.report()
    assert run.rank_err(0).splitlines() == [
        "mpsync train: error: mpirun started 1 rank: rank 0 is the state server (--server "
        "dedicated), which leaves no worker; start one rank more than the workers (mpirun -np "
        "5 for 4), use --server colocated, or let mpsync start them: mpsync train --np 4 ..."]
