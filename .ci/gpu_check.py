"""The GPU check: every CUDA path of mpsync, run on a machine that has a GPU.

    make gpu-check                 # on a machine with a CUDA device
    make gpu-check DEVICE=cpu      # every step on CPU tensors (only the device is untested)

Meant for a machine with the usual CUDA PyTorch stack (torch, numba, mpi4py with an Open MPI
``mpirun``, pytest) and a copy of this repository, no network and no Horovod; it may run another
Python and torch than ``make setup`` installs, so it needs nothing from the virtualenv. Steps:

1. the device tests (``pytest -m gpu``): mpsync's collectives and DistributedOptimizer on
   device tensors, staged through host memory, on the mpi backend (and on Horovod's where
   Horovod is installed);
2. the Horovod-style example (tests/horovod_scripts/pytorch_digits.py, its import line changed
   to ``import mpsync.torch as hvd``) on 2 ranks with device tensors under three policies on the
   ring (mpi backend, the state server colocated on rank 0): it must finish, every rank with the
   same final weights, at the accuracy a healthy run reaches;
3. plain PyTorch on the same device, one process, the same model, batch and epochs: the
   baseline of the table.

Prints one table (step, result, samples/s, ratio to plain PyTorch) and exits non-zero if a step
failed. Without a CUDA device and with DEVICE=cuda it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "horovod_scripts" / "pytorch_digits.py"
DIGITS = REPO / "mpsync" / "data" / "digits.npz"
HOROVOD_IMPORT = "import horovod.torch as hvd"
POLICIES = ("bsp", "ebsp", "esync")
# A run of the example that learns reaches about 0.9 on the held-out digits in 5 epochs; a
# broken aggregation (wrong scale, stale weights on one rank) stays far below.
MIN_ACCURACY = 0.80
BATCH = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the tensors live (default: cuda)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs of each run (default: 5)")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds each multi-rank step may take (default: 240)")
    args = parser.parse_args(argv)

    import torch  # after argparse: --help works without torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}); nothing "
              f"checked. `make gpu-check DEVICE=cpu` runs every step on CPU tensors.")
        return 0
    sys.path.insert(0, str(REPO))
    from mpsync.launch import mpirun_argv, run_with_deadline

    where = (torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU")
    print(f"gpu-check on {where}: Python {sys.version.split()[0]}, torch {torch.__version__}",
          flush=True)
    rows: list[tuple[str, str, float | None, str]] = []

    # 1. the device tests
    env = dict(os.environ, MPSYNC_TEST_DEVICE=args.device,
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    started = time.perf_counter()
    test = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p",
                           "no:cacheprovider", str(REPO / "tests" / "test_horovod_api.py")],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout * 2)
    summary = (test.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(test.stdout[-3000:], test.stderr[-2000:], sep="\n", flush=True)
    rows.append(("device tests (pytest -m gpu)", "ok" if test.returncode == 0 else "FAILED",
                 None, f"{summary} in {time.perf_counter() - started:.0f} s"))

    # 2. the Horovod-style example on 2 ranks, three policies
    with tempfile.TemporaryDirectory(prefix="mpsync-gpu-check-") as tmp:
        script = Path(tmp) / "pytorch_digits_mpsync.py"
        script.write_text(SCRIPT.read_text().replace(HOROVOD_IMPORT, "import mpsync.torch as hvd"))
        for policy in POLICIES:
            run_env = dict(env, MPSYNC_POLICY=policy, MPSYNC_TOPOLOGY="ring",
                           MPSYNC_SERVER="colocated", MPSYNC_BACKEND="mpi",
                           PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
            command = [sys.executable, str(script), "--data", str(DIGITS), "--epochs",
                       str(args.epochs), "--batch-size", str(BATCH), "--device", args.device]
            argv = mpirun_argv(2, command, forward_env=(
                "PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "MPSYNC_POLICY",
                "MPSYNC_TOPOLOGY", "MPSYNC_SERVER", "MPSYNC_BACKEND"))
            res = run_with_deadline(argv, args.timeout, env=run_env)
            rows.append(_example_row(policy, res))
            if rows[-1][1] != "ok":
                print(f"--- {policy}: mpirun output ---\n{res.stdout[-3000:]}\n"
                      f"{res.stderr[-3000:]}", flush=True)

    # 3. plain PyTorch on the same device
    rate = plain_torch_rate(torch, args.device, args.epochs)
    rows.append(("plain PyTorch, 1 process", "ok", rate, "the baseline"))
    print(_table(rows, rate, where))
    return 0 if all(r[1] == "ok" for r in rows) else 1


def _example_row(policy: str, res) -> tuple[str, str, float | None, str]:
    name = f"example, 2 ranks, {policy} (ring, mpi)"
    if res.timed_out or res.returncode != 0:
        why = "timed out" if res.timed_out else f"exit code {res.returncode}"
        return (name, "FAILED", None, why)
    out = res.stdout
    rates = [(int(s), float(t)) for s, t in
             re.findall(r"THROUGHPUT rank=\d+ samples=(\d+) seconds=([\d.]+)", out)]
    finals = re.findall(r"FINAL rank=\d+ size=\d+ steps=\d+ digest=(\w+) accuracy=([\d.]+)", out)
    if len(rates) != 2 or len(finals) != 2:
        return (name, "FAILED", None, "missing THROUGHPUT/FINAL lines")
    digests = {d for d, _ in finals}
    accuracy = min(float(a) for _, a in finals)
    # All ranks train at once: the job's rate is the samples of all ranks over the slowest one.
    rate = sum(s for s, _ in rates) / max(t for _, t in rates)
    ok = len(digests) == 1 and accuracy >= MIN_ACCURACY
    detail = (f"accuracy {accuracy:.3f}, "
              + ("weights equal on both ranks" if len(digests) == 1 else "WEIGHTS DIFFER"))
    return (name, "ok" if ok else "FAILED", rate, detail)


def plain_torch_rate(torch, device: str, epochs: int) -> float:
    """Samples/s of the example's model trained by plain PyTorch in one process."""
    import numpy as np

    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as each rank of the example runs
    raw = np.load(DIGITS)
    x = torch.from_numpy(raw["x"].reshape(len(raw["x"]), -1).astype(np.float32) / 16.0)
    y = torch.from_numpy(raw["y"]).long()
    cut = int(0.8 * len(x))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:cut], y[:cut]),
                                         batch_size=BATCH, shuffle=True)
    torch.manual_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 10),
                                torch.nn.LogSoftmax(dim=1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    start = time.perf_counter()
    for _ in range(epochs):
        for data, target in loader:
            data, target = data.to(dev), target.to(dev)
            opt.zero_grad()
            loss = torch.nn.functional.nll_loss(model(data), target)
            loss.backward()
            opt.step()
            loss.item()  # as the example does: one host read per step
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return epochs * cut / (time.perf_counter() - start)


def _table(rows, baseline: float, where: str) -> str:
    head = f"| step on {where} | result | samples/s | vs plain PyTorch | detail |"
    lines = [head, "|---|---|---|---|---|"]
    for name, status, rate, detail in rows:
        shown = f"{rate:,.0f}" if rate else "-"
        ratio = f"{rate / baseline:.2f}x" if rate else "-"
        lines.append(f"| {name} | {status} | {shown} | {ratio} | {detail} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
