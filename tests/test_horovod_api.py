"""horovod.torch's API on mpsync: a Horovod-style script runs with only its import line
changed under every policy (chosen by MPSYNC_POLICY / MPSYNC_TOPOLOGY alone), with uneven
step counts, and reaches the accuracy of the same script on real Horovod; the collectives
and the optimizer's keywords do what Horovod's do.

Run time: about 12-20 s per policy run (3 workers + server, 5 epochs of an MLP on the 8x8
digits, then 150 more steps per worker), 10 runs plus one on Horovod; about 8 s per run of
a worker joining while the others still train and call collectives.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from mpi_harness import REPO, TESTS_DIR, run_mpi
from mpsync.config import SyncConfig

pytestmark = pytest.mark.mpi

SCRIPT = TESTS_DIR / "horovod_scripts" / "pytorch_digits.py"
DIGITS = REPO / "mpsync" / "data" / "digits.npz"
HOROVOD_IMPORT = "import horovod.torch as hvd"
COMMON = ["--data", str(DIGITS), "--epochs", "5", "--fixed-steps", "150"]
JOIN_ORDER_SLACK = 0.1   # seconds: a time slice lost to the other ranks on an oversubscribed
                         # host between the script's print and join()'s own reading of the clock

# (policy, topology, extra flags): every policy on each of its topologies; the flags spread
# compression, op, predivide, uneven step counts and the end through join() over the runs.
RUNS = [
    ("bsp", "ring", ["--uneven-steps", "5", "--fp16-allreduce", "--op", "sum"]),
    ("ebsp", "ring", ["--uneven-steps", "5", "--end", "join"]),
    ("esync", "ring", []),
    ("esync", "ring", ["--uneven-steps", "5", "--fp16-allreduce"]),
    ("osp", "ring", ["--uneven-steps", "5", "--gradient-predivide-factor", "2",
                     "--backward-passes-per-step", "2"]),
    ("asp", "ps", ["--uneven-steps", "5"]),
    ("ssp", "ps", ["--fp16-allreduce"]),
    ("dssp", "ps", ["--uneven-steps", "5", "--end", "join"]),
    ("esync", "ps", ["--uneven-steps", "5"]),
    ("ebsp", "ps", ["--uneven-steps", "5", "--end", "join"]),
]


def mpsync_script(tmp_path: Path) -> Path:
    text = SCRIPT.read_text()
    assert text.count(HOROVOD_IMPORT) == 1
    path = tmp_path / "pytorch_digits_mpsync.py"
    path.write_text(text.replace(HOROVOD_IMPORT, "import mpsync.torch as hvd"))
    return path


def parse(run) -> dict:
    out = "\n".join(run.rank_out(r) for r in sorted(run.ranks))
    finals = {int(m.group(1)): m.groupdict() for m in re.finditer(
        r"FINAL rank=(\d+) size=(?P<size>\d+) steps=(?P<steps>\d+) digest=(?P<digest>\w+) "
        r"accuracy=(?P<accuracy>[\d.]+)", out)}
    losses = [float(v) for v in re.findall(r"EPOCH \d+ loss ([\d.]+)", out)]
    return {"finals": finals, "losses": losses, "text": out}


@pytest.fixture(scope="module")
def horovod_accuracy(tmp_path_factory) -> float:
    """The unchanged script on real Horovod, 3 ranks (the workers of the mpsync runs)."""
    run = run_mpi(str(SCRIPT), np=3, args=COMMON, timeout=240)
    res = parse(run)
    assert sorted(res["finals"]) == [0, 1, 2], run.report()
    assert len({f["digest"] for f in res["finals"].values()}) == 1
    return float(res["finals"][0]["accuracy"])


# The ring's policies again on gloo (a torch.distributed group of the workers), chosen by
# MPSYNC_BACKEND alone: the ones with local steps, In-Computation Sync and an early join.
GLOO_RUNS = [
    ("ebsp", "ring", ["--uneven-steps", "5", "--end", "join"]),
    ("esync", "ring", ["--fp16-allreduce"]),
    ("osp", "ring", ["--uneven-steps", "5", "--backward-passes-per-step", "2"]),
]


@pytest.mark.parametrize("policy, topology, flags, backend",
                         [(*run, "horovod") for run in RUNS] +
                         [(*run, "gloo") for run in GLOO_RUNS],
                         ids=[f"{p}-{t}-{i}" for i, (p, t, _) in enumerate(RUNS)] +
                             [f"{p}-{t}-gloo" for p, t, _ in GLOO_RUNS])
def test_horovod_script_under_every_policy(tmp_path, horovod_accuracy, policy, topology,
                                           flags, backend):
    # The script keeps hvd.init(): the policy, topology and the aggregation backend come
    # from the environment alone.
    env = dict(os.environ, MPSYNC_POLICY=policy, MPSYNC_TOPOLOGY=topology,
               MPSYNC_BACKEND=backend)
    passed = ("MPSYNC_POLICY", "MPSYNC_TOPOLOGY", "MPSYNC_BACKEND")
    run = run_mpi(str(mpsync_script(tmp_path)), np=4, args=COMMON + flags, env=env,
                  timeout=300, mpirun_extra=tuple(x for name in passed for x in ("-x", name)))
    res = parse(run)
    finals = res["finals"]
    # Rank 0 served; ranks 1-3 are workers 0-2, which all end cleanly with the same model.
    assert sorted(finals) == [0, 1, 2], run.report()
    assert len({f["digest"] for f in finals.values()}) == 1, finals
    uneven = int(flags[flags.index("--uneven-steps") + 1]) if "--uneven-steps" in flags else 0
    assert [int(finals[r]["steps"]) for r in range(3)] == [150 + uneven * r for r in range(3)]
    losses = res["losses"]
    assert len(losses) == 5 and losses[-1] < 0.7 * losses[0], losses
    accuracy = float(finals[0]["accuracy"])
    assert accuracy >= horovod_accuracy - 0.05, (accuracy, horovod_accuracy)
    if "join" in flags:
        # join() returns the worker that joined last.  Which one that is depends on the policy:
        # ElasticBSP and DSSP let a worker fall more steps behind than the 5-10 its peers have
        # to do beyond it (worker 0, which also coordinates the script's collectives, joined
        # last in a full-suite run), so the answer is checked against when each worker called
        # join().  Each join carries the time of its call, and the last caller is the
        # answer (before, member 0 took the last it read, and read joins waiting together
        # by source: a full-suite run answered worker 2, which had called 0.2 s before
        # worker 1).
        last = [int(w) for w in re.findall(r"JOINED last=(\d+)", res["text"])]
        called = {int(r): float(t) for r, t in
                  re.findall(r"JOIN-CALLED rank=(\d+) at=([\d.]+)", res["text"])}
        assert len(last) == 1 and sorted(called) == [0, 1, 2], (last, called)
        assert called[last[0]] >= max(called.values()) - JOIN_ORDER_SLACK, (last, called)


@pytest.mark.parametrize("policy, topology", [("ssp", "ps"), ("esync", "ps"), ("ebsp", "ring")])
def test_a_joined_worker_answers_the_collectives_of_workers_still_training(policy, topology):
    # On the PS a joined worker waits for the others' last pushes outside any aggregation: it
    # must answer their allreduce there too, or they wait for it until the deadline.
    run = run_mpi("horovod_api_programs:joined_while_others_train", np=4,
                  args=[f"policy={policy}", f"topology={topology}"], timeout=120)
    assert all(f"JOINED-OK rank={r}" in run.rank_out(r + 1) for r in range(3)), run.report()


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
def test_collectives(backend):
    run = run_mpi("horovod_api_programs:collectives", np=4, args=[f"backend={backend}"],
                  timeout=120)
    assert all(f"COLLECTIVES-OK rank={r}" in run.rank_out(r + 1) for r in range(3)), run.report()


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
def test_optimizer_keywords(backend):
    run = run_mpi("horovod_api_programs:optimizer_keywords", np=4, args=[f"backend={backend}"],
                  timeout=120)
    assert all(f"KEYWORDS-OK rank={r}" in run.rank_out(r + 1) for r in range(3)), run.report()


@pytest.mark.parametrize("policy, topology", [("esync", "ring"), ("ssp", "ps")])
def test_meaningless_keywords_are_refused_naming_the_policy(policy, topology):
    run = run_mpi("horovod_api_programs:refusals_by_policy", np=3,
                  args=[f"policy={policy}", f"topology={topology}"], timeout=120)
    assert "REFUSALS-OK" in run.rank_out(1), run.report()


def test_init_without_arguments_takes_the_environment():
    env = dict(os.environ, MPSYNC_POLICY="dssp", MPSYNC_TOPOLOGY="ps", MPSYNC_BACKEND="mpi")
    run = run_mpi("horovod_api_programs:from_environment", np=3, env=env, timeout=120,
                  mpirun_extra=("-x", "MPSYNC_POLICY", "-x", "MPSYNC_TOPOLOGY",
                                "-x", "MPSYNC_BACKEND"))
    assert "ENV policy=dssp topology=ps backend=mpi" in run.rank_out(1), run.report()


def test_precedence_explicit_over_environment_over_the_config_defaults():
    env = {"MPSYNC_POLICY": "esync", "MPSYNC_BACKEND": "horovod"}
    cfg = SyncConfig.from_options(env=env)
    assert (cfg.policy, cfg.backend) == ("esync", "horovod")
    cfg = SyncConfig.from_options(env=env, policy="bsp", backend="mpi")
    assert (cfg.policy, cfg.backend) == ("bsp", "mpi")
    cfg = SyncConfig.from_options(env={})
    assert (cfg.policy, cfg.backend) == (SyncConfig().policy, SyncConfig().backend)


# The device tests run on the GPU by default; ``make gpu-check DEVICE=cpu`` sets
# MPSYNC_TEST_DEVICE=cpu to run the same steps on CPU tensors, so that only the device is
# untested on a machine without one.
TEST_DEVICE = os.environ.get("MPSYNC_TEST_DEVICE", "cuda")


def _horovod_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("horovod") is not None


@pytest.mark.gpu
@pytest.mark.skipif(TEST_DEVICE == "cuda" and not torch.cuda.is_available(),
                    reason="no CUDA device on this machine: GPU tensors are staged through "
                           "host memory, verified only where a GPU exists (make gpu-check)")
@pytest.mark.parametrize("backend", [
    "mpi",
    pytest.param("horovod", marks=pytest.mark.skipif(
        not _horovod_installed(), reason="Horovod is not installed here: the mpi backend "
                                         "carries the device check")),
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(
        TEST_DEVICE != "cuda", reason="NCCL reduces CUDA tensors only")),
])
def test_device_tensors(backend):
    # NCCL refuses two ranks on one GPU: with a single GPU the NCCL check is one worker's
    # (its collectives still run through the process group).
    workers = 1 if backend == "nccl" and torch.cuda.device_count() < 2 else 2
    run = run_mpi("horovod_api_programs:device_tensors", np=workers + 1,
                  args=[f"backend={backend}", f"device={TEST_DEVICE}"], timeout=120)
    for rank in range(1, workers + 1):
        assert f"DEVICE-OK rank={rank - 1} device={TEST_DEVICE}" in run.rank_out(rank), \
            run.report()
