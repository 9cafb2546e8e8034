"""The GPU check: every CUDA path of mpsync, and what it costs, on a machine that has a GPU.

    make gpu-check                 # on a machine with a CUDA device
    make gpu-check DEVICE=cpu      # every step on CPU tensors (only the device is untested)

Meant for a machine with the usual CUDA PyTorch stack (torch, numba, mpi4py with an Open MPI
``mpirun``, pytest) and a copy of this repository, no network and no Horovod; it may run another
Python and torch than ``make setup`` installs, so it needs nothing from the virtualenv.  It
takes under 6 minutes on one GPU.  Steps, all on the built-in ResNet-style CNN
(``mpsync.apps.models.ResNet``) on synthetic 3x32x32 images made on the device (no download,
no input copies in the measured steps), at a batch of 64 per rank:

1. the device tests (``pytest -m gpu``);
2. plain PyTorch in one process: the baseline samples/s;
3. mpsync BSP at 1 rank (its overhead; the target is >= 0.95x plain PyTorch);
4. 2 ranks sharing the device under bsp, ebsp, esync and osp on the ring (mpi backend,
   buckets during backward; gradients staged through pinned host mirrors, ``HostStaged``) and
   asp on the parameter server: each must end with bitwise-equal weights on both ranks;
   host<->device copies per step counted with ``torch.profiler`` (one profiled BSP step; the
   target on the host transport: 2 per bucket, one each way) beside ``HostStaged``'s own count;
5. a 1-rank NCCL smoke (gloo with DEVICE=cpu; NCCL refuses two ranks on one GPU): the
   collective ran, and the transport made no host copy;
6. one Chrome trace (``torch.profiler``) of a BSP step, and the order of its events: the first
   bucket's allreduce starts before backward has ended.

Prints one table (step, result, samples/s, ratio to plain PyTorch, detail) and exits non-zero
if a step failed (a rate below its target is said in the table, not failed on).  Without a
CUDA device and with DEVICE=cuda it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RING_POLICIES = ("bsp", "ebsp", "esync", "osp")
IMAGE = (3, 32, 32)
CLASSES = 10
BATCHES = 4          # distinct synthetic batches, resident on the device, used in turn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the tensors live (default: cuda)")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steps per run (default: 60 on cuda, 4 on cpu)")
    parser.add_argument("--batch", type=int, default=64, help="per rank (default: 64)")
    parser.add_argument("--width", type=int, default=None,
                        help="the ResNet's first-stage channels (default: 64 on cuda, 4 on cpu)")
    parser.add_argument("--timeout", type=float, default=150.0,
                        help="seconds each multi-rank step may take (default: 150)")
    parser.add_argument("--trace-dir", default=None,
                        help="where the Chrome trace goes (default: $OUT or a temporary dir)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reports", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-device-tests", action="store_true",
                        help="leave out step 1 (the suite runs those tests on CPU itself)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.steps = args.steps or (4 if cpu else 60)
    args.width = args.width or (4 if cpu else 64)
    if args.worker is not None:
        return worker(args)

    import torch  # after argparse: --help works without torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}); nothing "
              f"checked. `make gpu-check DEVICE=cpu` runs every step on CPU tensors.")
        return 0
    sys.path.insert(0, str(REPO))
    where = (torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU")
    print(f"gpu-check on {where}: Python {sys.version.split()[0]}, torch {torch.__version__}; "
          f"ResNet width {args.width}, batch {args.batch}, {args.steps} steps", flush=True)
    rows: list[tuple[str, str, float | None, str]] = []
    env = dict(os.environ, MPSYNC_TEST_DEVICE=args.device, PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))

    # 1. the device tests
    started = time.perf_counter()
    if args.no_device_tests:
        test = subprocess.CompletedProcess([], 0, "left out (--no-device-tests)", "")
    else:
        test = None
    test = test or subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p",
                           "no:cacheprovider", str(REPO / "tests" / "test_horovod_api.py"),
                           str(REPO / "tests" / "test_device.py")],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout * 2)
    summary = (test.stdout.strip().splitlines() or ["(no output)"])[-1]
    if test.returncode != 0:
        print(test.stdout[-3000:], test.stderr[-2000:], sep="\n", flush=True)
    rows.append(("device tests (pytest -m gpu)", "ok" if test.returncode == 0 else "FAILED",
                 None, f"{summary} in {time.perf_counter() - started:.0f} s"))
    print(f"  device tests: {time.perf_counter() - started:.0f} s", flush=True)

    # 2. plain PyTorch
    plain = plain_torch_rate(args)
    rows.append(("plain PyTorch, 1 process", "ok", plain, "the baseline"))

    trace_dir = Path(args.trace_dir or os.environ.get("OUT") or tempfile.mkdtemp(
        prefix="mpsync-gpu-check-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, str(Path(__file__).resolve()), "--device", args.device,
            "--steps", str(args.steps), "--batch", str(args.batch), "--width", str(args.width)]

    def launch(np_: int, worker_spec: str, extra=()):
        from mpsync.launch import mpirun_argv, run_with_deadline

        reports_dir = Path(tempfile.mkdtemp(prefix="mpsync-gpu-check-reports-"))
        argv = mpirun_argv(np_, base + ["--worker", worker_spec, "--reports", str(reports_dir),
                                        *extra], forward_env=(
            "PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "MPSYNC_TEST_DEVICE"))
        t0 = time.perf_counter()
        res = run_with_deadline(argv, args.timeout, env=env)
        print(f"  {worker_spec} on {np_} rank(s): {time.perf_counter() - t0:.0f} s", flush=True)
        reports = [json.loads(f.read_text()) for f in sorted(reports_dir.glob("*.json"))]
        failed = res.timed_out or res.returncode != 0 or len(reports) != np_
        if failed:
            print(f"--- {worker_spec}: mpirun output ---\n{res.stdout[-3000:]}\n"
                  f"{res.stderr[-3000:]}", flush=True)
        why = "timed out" if res.timed_out else f"exit code {res.returncode}"
        return (None if failed else reports), why

    # 3. BSP at 1 rank, with the profiled step and the trace
    reports, why = launch(1, "bsp:ring:mpi", ["--trace-dir", str(trace_dir)])
    if reports is None:
        rows.append(("mpsync BSP, 1 rank (overhead)", "FAILED", None, why))
    else:
        r = reports[0]
        rate = r["rate"]
        target = "target >= 0.95x met" if rate >= 0.95 * plain else "BELOW the 0.95x target"
        rows.append(("mpsync BSP, 1 rank (overhead)", "ok", rate, target))
        order = r["order"]
        overlap = "end" in order and any(isinstance(e, int) for e in order[:order.index("end")])
        rows.append(("trace: allreduce before backward ends", "ok" if overlap else "FAILED",
                     None, f"bucket starts vs backward end: {order}; {r.get('trace')}"))

    # 4. two ranks sharing the device
    for policy, topology in [(p, "ring") for p in RING_POLICIES] + [("asp", "ps")]:
        name = f"2 ranks, {policy} ({topology}{', mpi' if topology == 'ring' else ''})"
        reports, why = launch(2, f"{policy}:{topology}:mpi")
        if reports is None:
            rows.append((name, "FAILED", None, why))
            continue
        digests = {r["digest"] for r in reports}
        rate = sum(r["samples"] for r in reports) / max(r["seconds"] for r in reports)
        detail = "weights equal on both ranks" if len(digests) == 1 else "WEIGHTS DIFFER"
        if policy == "bsp":
            r = reports[0]
            detail += (f"; copies/step: profiler {r['profiled_copies']}, staged "
                       f"{r['staged_copies']} for {r['buckets']} bucket(s)")
            if args.device == "cuda" and r["staged_copies"] != 2 * r["buckets"]:
                detail += " (target 2 per bucket NOT met)"
        rows.append((name, "ok" if len(digests) == 1 else "FAILED", rate, detail))

    # 5. the device transport, 1 rank
    transport = "gloo" if cpu else "nccl"
    reports, why = launch(1, f"bsp:ring:{transport}")
    name = f"{transport} smoke, 1 rank"
    if reports is None:
        rows.append((name, "FAILED", None, why))
    else:
        r = reports[0]
        ok = r["rounds"] > 0 and r["staged_copies"] == 0
        rows.append((name, "ok" if ok else "FAILED", r["rate"],
                     f"{r['rounds']} rounds aggregated; copies/step: profiler "
                     f"{r['profiled_copies']}, transport {r['staged_copies']}"))
    print(_table(rows, plain, where))
    return 0 if all(r[1] == "ok" for r in rows) else 1


def _data(torch, device, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, *IMAGE, generator=g).to(device) for _ in range(BATCHES)]
    ys = [torch.randint(0, CLASSES, (batch,), generator=g).to(device) for _ in range(BATCHES)]
    return xs, ys


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_torch_rate(args) -> float:
    """Samples/s of the ResNet trained by plain PyTorch in one process."""
    import torch

    sys.path.insert(0, str(REPO))
    from mpsync.apps.models import ResNet

    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as each rank runs
    torch.manual_seed(0)
    model = ResNet(IMAGE[0], CLASSES, width=args.width).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs, ys = _data(torch, dev, args.batch, 0)

    def step(i):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[i % BATCHES]), ys[i % BATCHES]).backward()
        opt.step()

    for i in range(3):   # warm-up: cuDNN's algorithm search, the allocator
        step(i)
    _sync(torch, dev)
    start = time.perf_counter()
    for i in range(args.steps):
        step(i)
    _sync(torch, dev)
    return args.steps * args.batch / (time.perf_counter() - start)


def _count_copies(prof) -> int:
    """Host<->device copies in a profile: CUDA memcpy activities (HtoD and DtoH)."""
    n = 0
    for e in prof.events():
        name = e.name
        if "Memcpy" in name and ("HtoD" in name or "DtoH" in name):
            n += 1
    return n


def worker(args) -> int:
    """One rank of a measured run: ``--worker POLICY:TOPOLOGY:BACKEND``; prints ``REPORT``."""
    import torch

    sys.path.insert(0, str(REPO))
    import mpsync.torch as mps
    from mpsync.apps.models import ResNet

    policy, topology, backend = args.worker.split(":")
    # Buckets small enough that the model has several (DDP's 25 MB would hold all of it).
    mps.init(policy=policy, topology=topology, backend=backend, server="colocated",
             deadline=120, bucket_mb=0.01 if args.device == "cpu" else 2.0)
    me = mps.rank()
    if args.device == "cuda":
        dev = torch.device("cuda", mps.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ResNet(IMAGE[0], CLASSES, width=args.width).to(dev)
    opt = mps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    xs, ys = _data(torch, dev, args.batch, 1 + me)
    strategy = opt.strategy
    order: list = []
    buckets = getattr(strategy, "buckets", None)
    if buckets is not None:
        buckets.on_event = order.append

    def step(i):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[i % BATCHES]), ys[i % BATCHES]).backward()
        opt.step()

    for i in range(3):
        step(i)
    _sync(torch, dev)
    staged = getattr(strategy, "backend", None)
    copies_before = getattr(staged, "copies", 0)
    order.clear()
    start = time.perf_counter()
    for i in range(args.steps):
        step(i)
    _sync(torch, dev)
    seconds = time.perf_counter() - start
    staged_per_step = (getattr(staged, "copies", 0) - copies_before) / args.steps
    first_order = _first_step_order(order)
    # One profiled step: host<->device copies, and the trace of a step.
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step(0)
        _sync(torch, dev)
    trace = None
    if args.trace_dir and me == 0:
        trace = str(Path(args.trace_dir) / f"gpu-check-{args.worker.replace(':', '-')}.json")
        prof.export_chrome_trace(trace)
    opt.synchronize()
    rounds = strategy.round
    mps.shutdown()   # the final aggregation: every worker ends with the same model
    flat = torch.cat([p.detach().reshape(-1).to("cpu") for p in model.parameters()])
    report = dict(rank=me, samples=args.steps * args.batch, seconds=seconds,
                  rate=args.steps * args.batch / seconds, rounds=rounds,
                  digest=hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16],
                  profiled_copies=_count_copies(prof) if dev.type == "cuda" else "-",
                  staged_copies=staged_per_step,
                  buckets=len(buckets.buckets) if buckets is not None else 0,
                  order=first_order, trace=trace)
    (Path(args.reports) / f"{me}.json").write_text(json.dumps(report))
    return 0


def _first_step_order(order: list) -> list:
    """The events of the first measured step: bucket indices as they started, then "end"
    (backward's end), then the buckets started after it."""
    if "end" not in order:
        return order
    cut = order.index("end") + 1
    rest = order[cut:]
    # The buckets of this step still unstarted at the end of backward start right after it;
    # the next step begins with bucket 0 again.
    tail = []
    for e in rest:
        if e == 0 or e == "end":
            break
        tail.append(e)
    return order[:cut] + tail


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
