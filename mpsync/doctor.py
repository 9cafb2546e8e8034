"""``mpsync doctor``: is this installation able to run mpsync?

Prints the versions and build facts that decide whether a run can work (Python, numpy, Numba,
torch, mpi4py, Open MPI, the MPI thread level, Horovod's PyTorch/MPI/Gloo flags, the device
transports this machine has: gloo, NCCL, CUDA-aware MPI, Horovod's NCCL ops), compiles a
trivial Numba kernel, and starts ``mpirun -np 2`` to exchange one message.  Exits non-zero with
one line per broken item, so it doubles as a support checklist and as a CI smoke test.
``--warm`` then fills Numba's cache with the kernels of every policy's job (``make setup``
runs it), so that no first run compiles them (:func:`warm_jobs`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass

from mpsync.launch import mpirun_argv, run_with_deadline

__all__ = ["add_arguments", "main", "run_checks", "Check"]

# The rank program of the two-rank check: rank 1 sends a buffer, rank 0 checks it came back
# doubled.  Run with ``python -c`` so it needs nothing but mpi4py and numpy.
_PINGPONG = """
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
assert comm.Get_size() == 2, comm.Get_size()
buf = np.arange(4, dtype=np.int64)
if comm.Get_rank() == 0:
    comm.Send(buf, dest=1, tag=1)
    comm.Recv(buf, source=1, tag=2)
    assert list(buf) == [0, 2, 4, 6], buf
    print("pingpong-ok")
else:
    comm.Recv(buf, source=0, tag=1)
    comm.Send(buf * 2, dest=0, tag=2)
"""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _version(module_name: str) -> Check:
    try:
        module = __import__(module_name)
        return Check(module_name, True, getattr(module, "__version__", "?"))
    except Exception as e:  # a broken install shows up as any exception, not only ImportError
        return Check(module_name, False, f"cannot import {module_name}: {e}")


# MPI facts are read in a child process: MPI_Init in the doctor itself would take the doctor
# down with it when Open MPI is broken (e.g. it cannot start its daemon), instead of reporting.
# ``cuda``: Open MPI's run-time answer (MPIX_Query_cuda_support, exported when its CUDA
# extension is built), else null; the doctor then reads ompi_info's build flag.
_MPI_FACTS = """
import ctypes, json, mpi4py
from mpi4py import MPI
names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
         MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
query = getattr(ctypes.CDLL(None), "MPIX_Query_cuda_support", None)
if query is not None:
    query.restype = ctypes.c_int
print(json.dumps({"mpi4py": mpi4py.__version__,
                  "library": MPI.Get_library_version().strip().splitlines()[0],
                  "thread_level": names.get(MPI.Query_thread(), str(MPI.Query_thread())),
                  "cuda": None if query is None else bool(query())}))
"""


def _mpi(timeout: float, facts_out: dict | None = None) -> list[Check]:
    """``facts_out``: filled with what the MPI child reported (for the transports' line)."""
    res = run_with_deadline([sys.executable, "-c", _MPI_FACTS], timeout)
    if res.timed_out or res.returncode != 0:
        why = "timed out" if res.timed_out else _mpi_error_summary(res.stderr, res.returncode)
        return [Check("mpi4py", False, f"MPI_Init via mpi4py failed: {why}")]
    facts = json.loads(res.stdout.strip().splitlines()[-1])
    if facts_out is not None:
        facts_out.update(facts)
    library = facts["library"]
    level = facts["thread_level"]
    return [
        Check("mpi4py", True, facts["mpi4py"]),
        Check("MPI library", "Open MPI" in library,
              library if "Open MPI" in library else
              f"mpi4py is built against {library!r}, not Open MPI"),
        # Only a co-located server needs MPI_THREAD_MULTIPLE; a dedicated one works at any level.
        Check("MPI thread level", True,
              level + ("" if level == "multiple" else " (server='colocated' unavailable)")),
    ]


def _mpi_error_summary(stderr: str, returncode) -> str:
    """The one informative line of Open MPI's multi-paragraph startup failure."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:  # Open MPI prints the cause as '--> Returned value <cause> (-N) instead of ...'
        if ln.startswith("-->"):
            return ln.lstrip("-> ").split(" instead of")[0]
    return lines[-1] if lines else f"exit {returncode}"


def _horovod() -> Check:
    try:  # optional, and what this check is about: a missing or broken build is reported
        import horovod.torch as hvd
    except Exception as e:
        return Check("horovod", False, f"cannot import horovod.torch: {e}")
    import horovod

    flags = {"PyTorch": True, "MPI": hvd.mpi_built(), "Gloo": hvd.gloo_built()}
    missing = [k for k, v in flags.items() if not v]
    detail = f"{horovod.__version__} built with " + ", ".join(
        f"{k}={'yes' if v else 'no'}" for k, v in flags.items())
    if missing:
        return Check("horovod", False, f"horovod {horovod.__version__} lacks {', '.join(missing)}"
                                       " support (rerun make setup)")
    return Check("horovod", True, detail)


def _device_transports(mpi_cuda: bool | None) -> Check:
    """Which transports can move device (or, for gloo, host) tensors here.  Informational:
    a machine without a GPU is not a broken installation, so the check is always ok."""
    have: list[str] = []
    try:  # torch's own build flags; a broken torch is reported by its version check
        import torch.distributed as dist

        from mpsync.config import transport_unavailable

        have.append(f"gloo={'yes' if dist.is_available() and dist.is_gloo_available() else 'no'}")
        why = transport_unavailable("nccl")
        have.append("nccl=yes" if why is None else
                    "nccl=no (" + ("no CUDA" if "needs CUDA" in why else "torch without NCCL")
                    + ")")
    except Exception as e:
        have.append(f"gloo/nccl unknown (torch.distributed: {e})")
    if mpi_cuda is None:
        from mpsync.transport import ompi_built_with_cuda

        mpi_cuda = ompi_built_with_cuda()
    have.append("CUDA-aware MPI=" + {True: "yes", False: "no", None: "unknown"}[mpi_cuda])
    try:  # optional: Horovod's NCCL ops exist only in a build made with HOROVOD_GPU_OPERATIONS
        import horovod.torch as hvd

        have.append(f"Horovod NCCL ops={'yes' if hvd.nccl_built() else 'no'}")
    except Exception:
        have.append("Horovod NCCL ops=no (no horovod.torch)")
    return Check("device transports", True, ", ".join(have))


def _numba_kernel() -> Check:
    try:  # numba compiles here: a broken install must be a failed check, not a crash
        import numba
        import numpy as np

        @numba.njit(cache=False)
        def _sum_of_squares(x):
            total = 0.0
            for v in x:
                total += v * v
            return total

        got = _sum_of_squares(np.arange(4, dtype=np.float64))
        if got != 14.0:
            return Check("numba kernel", False, f"trivial kernel returned {got}, expected 14.0")
        return Check("numba kernel", True, "njit compiled and ran")
    except Exception as e:
        return Check("numba kernel", False, f"numba cannot compile a trivial kernel: {e}")


def _mpirun_two_ranks(timeout: float) -> Check:
    argv = mpirun_argv(2, [sys.executable, "-c", _PINGPONG])
    try:
        res = run_with_deadline(argv, timeout)
    except FileNotFoundError:
        return Check("mpirun -np 2", False, "mpirun not found on PATH (install openmpi-bin)")
    if res.timed_out:
        return Check("mpirun -np 2", False, f"two ranks did not exchange a message in {timeout:.0f}s")
    if res.returncode != 0 or "pingpong-ok" not in res.stdout:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return Check("mpirun -np 2", False, f"exit {res.returncode}: {last}")
    return Check("mpirun -np 2", True, f"two ranks exchanged a message in {res.elapsed:.1f}s")


# ``--warm``: one short ``mpsync train`` per kind of job (:func:`warm_jobs`).  Numba compiles a
# kernel at its first call and keeps it in its on-disk cache (``__pycache__`` beside the
# source, mpsync.sched._numba): a job that finds it there loads it in milliseconds.  One that
# does not compiles at its start, or, for a kernel first called while it trains, in the
# middle of its timings: on a 2-core machine the first run of the shards' optimizer after an
# install trained at 1,119 samples/s, the next at 4,619 (bench/startup/README.md).
def warm_jobs() -> list[tuple[str, ...]]:
    """The ``mpsync train`` flags of each warm-up job: every registered policy on its own
    topology (auto for 3 s: it ranks with the simulator after its first second), and the
    shards' optimizer under each policy whose shards step from an inbox on one node (the
    policies whose shards apply every push on arrival, ``shard_window``)."""
    from mpsync import policies

    jobs = [("--policy", s.name) + (("--time-budget", "3") if s.name == policies.AUTO else ())
            for s in policies.specs()]
    jobs += [("--policy", s.name, "--ps-optimizer", "server", "--lr", "0.0125")
             for s in policies.specs()
             if s.name != policies.AUTO and s.steps_unawaited and not s.ps_average]
    return jobs


def warm_cache(timeout: float = 180.0, log=print, jobs=None) -> list[Check]:
    """Run ``jobs`` (:func:`warm_jobs` by default; 2 workers, 1 s of training each unless a
    job says otherwise) so that Numba's cache holds every kernel they call; one check per
    job."""
    import tempfile

    checks = []
    with tempfile.TemporaryDirectory(prefix="mpsync-warm-") as tmp:
        for k, flags in enumerate(warm_jobs() if jobs is None else jobs):
            name = "warm " + flags[flags.index("--policy") + 1]
            if "--ps-optimizer" in flags:
                name += " (shards' optimizer)"
            argv = [sys.executable, "-m", "mpsync.cli", "train", "--np", "2",
                    "--time-budget", "1", *flags, "--out", f"{tmp}/{k}", "--no-progress",
                    "--no-plots"]
            res = run_with_deadline(argv, timeout)
            if res.timed_out or res.returncode != 0:
                last = (res.stderr.strip().splitlines() or ["no output"])[-1]
                why = f"no result in {timeout:.0f}s" if res.timed_out else \
                    f"exit {res.returncode}: {last}"
                checks.append(Check(name, False, why))
            else:
                checks.append(Check(name, True, f"{res.elapsed:.1f}s"))
            log(f"{'ok ' if checks[-1].ok else 'BAD'}  {name}  {checks[-1].detail}")
    return checks


def run_checks(timeout: float = 60.0, skip_mpirun: bool = False) -> list[Check]:
    checks = [Check("python", sys.version_info[:2] >= (3, 10), platform.python_version())]
    checks += [_version(m) for m in ("numpy", "numba", "torch")]
    facts: dict = {}
    checks += _mpi(timeout, facts)
    checks.append(_horovod())
    checks.append(_device_transports(facts.get("cuda")))
    checks.append(_numba_kernel())
    if not skip_mpirun:
        checks.append(_mpirun_two_ranks(timeout))
    return checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds allowed for the mpirun -np 2 check (default 60)")
    parser.add_argument("--skip-mpirun", action="store_true",
                        help="do not start mpirun (e.g. on a login node)")
    parser.add_argument("--warm", action="store_true",
                        help="then fill Numba's cache with the kernels of every policy's "
                             "job (one short mpsync train each, about 90 s the first "
                             "time), so that no first run compiles; make setup does this")


def main(args: argparse.Namespace) -> int:
    checks = run_checks(args.timeout, args.skip_mpirun)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{'ok ' if c.ok else 'BAD'}  {c.name:<{width}}  {c.detail}")
    if args.warm and not any(not c.ok for c in checks) and not args.skip_mpirun:
        checks += warm_cache(log=print)
    broken = [c for c in checks if not c.ok]
    for c in broken:
        print(f"mpsync doctor: {c.name}: {c.detail}", file=sys.stderr)
    return 1 if broken else 0
