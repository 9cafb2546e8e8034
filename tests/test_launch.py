"""mpirun command lines are built by pure functions; deadlines kill whole process groups."""

from __future__ import annotations

import sys
import time

import pytest

from mpsync.launch import forwarded_env, mpirun_argv, run_with_deadline


def test_mpirun_argv_for_a_root_oversubscribed_run():
    argv = mpirun_argv(5, ["python", "-m", "mpsync.cli", "train"], allow_run_as_root=True,
                       forward_env=("PYTHONPATH",), output_dir="/tmp/o", hostfile="hosts")
    assert argv == ["mpirun", "-np", "5", "--bind-to", "none", "--mca", "mpi_yield_when_idle",
                    "1", "--allow-run-as-root", "--oversubscribe", "--hostfile", "hosts",
                    "-x", "PYTHONPATH", "--output-filename", "/tmp/o",
                    "python", "-m", "mpsync.cli", "train"]


def test_mpirun_argv_without_root_or_oversubscription():
    argv = mpirun_argv(2, ["a"], allow_run_as_root=False, oversubscribe=False)
    assert "--allow-run-as-root" not in argv and "--oversubscribe" not in argv
    assert argv[-1] == "a"


@pytest.mark.parametrize("n, cmd, msg", [(0, ["a"], "nprocs"), (2, [], "command")])
def test_mpirun_argv_rejects_nonsense(n, cmd, msg):
    with pytest.raises(ValueError, match=msg):
        mpirun_argv(n, cmd)


def test_deadline_kills_the_child_and_its_children():
    # The child starts a grandchild that would outlive a plain kill of the child.
    code = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    start = time.monotonic()
    res = run_with_deadline([sys.executable, "-c", code], timeout=2)
    assert res.timed_out and res.returncode is None
    assert time.monotonic() - start < 12


def test_missing_launcher_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no-such-mpirun.*not found on PATH"):
        run_with_deadline(["no-such-mpirun", "-np", "2"], timeout=5)


def test_forwarded_env_expands_prefixes_into_names_of_set_variables():
    names = forwarded_env({"MPSYNC_POLICY": "ssp", "HOROVOD_TIMELINE": "t", "NCCL_DEBUG": "1",
                           "HOME": "/root", "PATH": "/bin", "PYTHONPATH": "/x"})
    assert names[:2] == ("PATH", "PYTHONPATH")   # unset fixed names are left out
    assert set(names[2:]) == {"MPSYNC_POLICY", "HOROVOD_TIMELINE", "NCCL_DEBUG"}


def test_mpirun_argv_takes_hosts_and_extra_options_last():
    argv = mpirun_argv(4, ["a"], allow_run_as_root=False, hosts=["n1:2", "n2:2"],
                       extra=["--mca", "plm_rsh_agent", "/x/agent"])
    assert argv[argv.index("--host") + 1] == "n1:2,n2:2"
    assert argv[-4:] == ["--mca", "plm_rsh_agent", "/x/agent", "a"]
