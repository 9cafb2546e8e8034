"""``mpsync bench memory --np N [--json]``: what each policy keeps per worker, in bytes.

The memory target: at most one extra copy of the parameters per worker for ESync and
ElasticBSP (the global model), none for BSP beyond the fusion buffer.  This measures it instead
of deriving it from the code.  One ``mpirun`` job of ``--np`` workers and a dedicated state
server runs the cases one after another (BSP, ESync, ElasticBSP and OSP on the ring; ASP and
ESync on the PS topology, backend mpi), each its own ``mps.init`` ... ``mps.shutdown()``:
an MLP of ``--layers`` x Linear(width, width) trained through ``mps.DistributedOptimizer`` for
``--steps`` steps, then the shutdown's final aggregation.  After every step and after the
shutdown each worker:

* walks every object the wrapper, its strategy, the fusion buffers, the aggregation backend
  and the state-server client hold (attributes, containers, closures), collects the memory of
  every ``torch.Tensor`` storage, ``np.ndarray`` buffer and ``bytearray`` among them, and
  merges the address ranges (views and ``.numpy()`` aliases of one buffer count once);
* removes the model's own parameter storage and its gradient storage from that set (the
  gradients are reported on their own: under BSP they *are* the fusion buffer);
* reads its RSS (psutil) as a cross-check: growth since just before the wrapper was built,
  after a warm-up of the same loop with the plain optimizer, so the gradients, activations
  and MPI/torch start-up are already in the baseline.  glibc's mmap threshold is pinned
  (``MALLOC_MMAP_THRESHOLD_``) so buffers of 64 KB and more go back to the system when freed;
  with the default dynamic threshold freed 1 MB blocks stay in the heap and RSS would count
  memory nobody holds.

Per case the row has the maximum over steps and workers: ``extra_bytes`` (held by mpsync,
neither parameters nor gradients), ``extra_beyond_fusion_bytes`` (the same without the
fusion buffer), both also as a multiple of the parameter bytes, ``rss_growth_bytes``, the
fusion buffer's and the gradients' bytes, aggregation rounds, and ``held``: every distinct
buffer with the attribute path that holds it (rank side of the largest extra).
``bookkeeping_bytes``: held buffers under min(4 KB, 1 % of the parameters) (control messages,
layer tables); counted in ``extra_bytes`` but not as a parameter copy in ``meets_target``.

The dedicated state server's memory (for PS the server keeps the global weights) is not a
worker's and is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import types

from mpsync import policies as registry
from mpsync.launch import mpirun_argv, python_argv, run_with_deadline

__all__ = ["add_arguments", "run", "CASES"]



def _registry_cases() -> tuple[tuple[str, str, str], ...]:
    """(label, policy, topology): every policy that runs on the ring (each ring strategy holds
    its own buffers: none beyond the fusion buffer, a global model copy, OSP's in-flight
    In-Computation Sync), and the parameter-server strategy under a policy whose pushes the
    server applies as they come and under one whose pushes it averages."""
    specs = registry.specs()
    cases = [(s.name, s.name, "ring") for s in specs if "ring" in s.topologies]
    for pick in (lambda s: s.default_topology == "ps", lambda s: s.ps_average):
        spec = next((s for s in specs if "ps" in s.topologies and pick(s)), None)
        if spec is not None:
            cases.append((f"{spec.name}-ps", spec.name, "ps"))
    return tuple(cases)


CASES = _registry_cases()
MMAP_THRESHOLD = 65536  # bytes; see the module docstring (RSS cross-check)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="worker ranks (plus 1 state server)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers in the model (default 8)")
    p.add_argument("--width", type=int, default=512, help="Linear(width, width) (default 512)")
    p.add_argument("--steps", type=int, default=6, help="training steps per case (default 6)")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated subset of {','.join(c[0] for c in CASES)}")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows, one per case")
    p.add_argument("--out", default=None, help="also write the rows to this JSON file")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the mpirun job")


def _cases(text: str | None) -> list[tuple[str, str, str]]:
    if not text:
        return list(CASES)
    by_label = {c[0]: c for c in CASES}
    wanted = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in by_label]
    if unknown or not wanted:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {', '.join(by_label)}")
    return [by_label[x] for x in wanted]


def run(args: argparse.Namespace) -> int:
    if args.np < 1 or args.layers < 1 or args.width < 1 or args.steps < 1:
        raise SystemExit("--np, --layers, --width and --steps must be >= 1")
    cases = _cases(args.cases)
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    child = python_argv("mpsync.bench.memory", "--child", ",".join(c[0] for c in cases),
                        str(args.layers), str(args.width), str(args.steps))
    argv = mpirun_argv(args.np + 1, child,
                       forward_env=("OMP_NUM_THREADS", "PYTHONPATH", "MALLOC_MMAP_THRESHOLD_"))
    res = run_with_deadline(argv, args.timeout, env=env)
    reports: dict[str, list[dict]] = {c[0]: [] for c in cases}
    for ln in res.stdout.splitlines():
        if ln.startswith("MEM "):
            rep = json.loads(ln[4:])
            reports[rep["case"]].append(rep)
    short = [label for label, reps in reports.items() if len(reps) != args.np]
    if res.returncode != 0 or short:
        sys.stderr.write(res.stdout[-3000:] + res.stderr[-3000:])
        why = "timeout" if res.timed_out else f"exit {res.returncode}"
        raise SystemExit(f"bench memory (np={args.np}) failed: {why}; cases without a report "
                         f"from every worker: {short}")
    rows = [_combine(label, policy, topology, args, reports[label])
            for label, policy, topology in cases]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_table(rows)
    return 0


def _combine(label, policy, topology, args, per_worker: list[dict]) -> dict:
    """One row per case: the worst worker for every byte count (workers differ: e.g. only
    worker 0 initialises the PS weights)."""
    worst = max(per_worker, key=lambda w: w["extra_bytes"])
    pb = worst["param_bytes"]
    row = {"case": label, "policy": policy, "topology": topology, "backend": "mpi",
           "np": args.np, "model": f"{args.layers} x Linear({args.width},{args.width}) float32",
           "param_bytes": pb}
    for key in ("grad_bytes", "fusion_bytes", "extra_bytes", "extra_beyond_fusion_bytes",
                "bookkeeping_bytes", "rss_growth_bytes", "rss_growth_max_bytes"):
        row[key] = max(w[key] for w in per_worker)
    row["grads_in_fusion_buffer"] = all(w["grads_in_fusion_buffer"] for w in per_worker)
    row["rounds"] = min(w["rounds"] for w in per_worker)
    for key in ("extra", "extra_beyond_fusion", "rss_growth"):
        row[f"{key}_vs_params"] = round(row[f"{key}_bytes"] / pb, 3)
    row["target"] = _target(policy, topology)
    if row["target"] is not None:
        limit = 0 if row["target"].startswith("none") else pb
        row["meets_target"] = row["extra_beyond_fusion_bytes"] - row["bookkeeping_bytes"] <= limit
    row["held"] = worst["held"]
    return row


def _target(policy: str, topology: str) -> str | None:
    """The memory target of the case's worker strategy, if it promises one."""
    return registry.get(policy).strategy_class(topology).memory_target


def _print_table(rows: list[dict]) -> None:
    mb = 1 << 20
    print(f"{'case':>9} {'params MB':>9} {'fusion MB':>9} {'extra MB':>9} {'extra/params':>12} "
          f"{'beyond fusion':>13} {'RSS growth':>10} {'rounds':>6}  target")
    for r in rows:
        target = "" if r["target"] is None else \
            f"{r['target']}: {'met' if r['meets_target'] else 'MISSED'}"
        print(f"{r['case']:>9} {r['param_bytes'] / mb:>9.2f} {r['fusion_bytes'] / mb:>9.2f} "
              f"{r['extra_bytes'] / mb:>9.2f} {r['extra_vs_params']:>12.2f} "
              f"{r['extra_beyond_fusion_vs_params']:>13.2f} {r['rss_growth_vs_params']:>10.2f} "
              f"{r['rounds']:>6}  {target}")


# -- accounting ---------------------------------------------------------------------------------
def _held_buffers(roots: list[tuple[str, object]], skip: set[int]) -> list[dict]:
    """Every tensor storage / ndarray buffer / bytearray reachable from ``roots`` through
    mpsync objects, containers and closures: ``{"start", "nbytes", "path", "dtype"}``.

    Only objects of mpsync's own classes (and containers, dataclasses, closures) are entered;
    torch optimizers, modules, mpi4py handles and threads are leaves, and ids in ``skip`` (the
    wrapped optimizer and what it shares) are not followed.
    """
    import numpy as np  # the parent process that launches the ranks needs neither
    import torch

    found: list[dict] = []
    seen: set[int] = set()
    stack = list(reversed(roots))
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or id(obj) in skip or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            found.append({"start": st.data_ptr(), "nbytes": st.nbytes(), "path": path,
                          "dtype": str(obj.dtype).replace("torch.", "")})
            continue
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            found.append({"start": base.__array_interface__["data"][0], "nbytes": base.nbytes,
                          "path": path, "dtype": str(obj.dtype)})
            continue
        if isinstance(obj, bytearray):
            found.append({"start": -id(obj), "nbytes": len(obj), "path": path, "dtype": "bytes"})
            continue
        if isinstance(obj, (str, bytes, int, float, bool, complex, type, types.ModuleType)):
            continue
        children: list[tuple[str, object]] = []
        if isinstance(obj, dict):
            children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, types.MethodType):
            children = [(f"{path}.__self__", obj.__self__), (path, obj.__func__)]
        elif isinstance(obj, types.FunctionType):
            # A closure (e.g. a Pending's finish) can hold the buffer it works on.
            children = [(f"{path}<closure>", c.cell_contents) for c in (obj.__closure__ or ())
                        if _cell_filled(c)]
        elif type(obj).__module__.startswith("mpsync") or dataclasses.is_dataclass(obj):
            attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        attrs[name] = getattr(obj, name)
            children = [(f"{path}.{k}", v) for k, v in attrs.items()]
        stack.extend(reversed(children))
    return found


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _size(ranges: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in ranges)


def _minus(ranges: list[tuple[int, int]], remove: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union ``ranges`` without anything in union ``remove`` (both sorted and disjoint)."""
    out = []
    for a, b in ranges:
        pieces = [(a, b)]
        for c, d in remove:
            nxt = []
            for x, y in pieces:
                if d <= x or c >= y:
                    nxt.append((x, y))
                    continue
                if x < c:
                    nxt.append((x, c))
                if d < y:
                    nxt.append((d, y))
            pieces = nxt
        out.extend(pieces)
    return out


def account(dopt, model, extra_roots: list[tuple[str, object]]) -> dict:
    """Bytes ``dopt`` (a DistributedOptimizer) and ``extra_roots`` hold beyond ``model``'s
    parameters and gradients (see the module docstring)."""
    opt = dopt.optimizer
    skip = {id(opt), id(opt.param_groups), id(opt.state), id(opt.defaults)}
    buffers = _held_buffers([("opt", dopt)] + extra_roots, skip)
    params = list(model.parameters())
    p_ranges = _union([(p.untyped_storage().data_ptr(),
                        p.untyped_storage().data_ptr() + p.untyped_storage().nbytes())
                       for p in params])
    # Each gradient's own bytes (a gradient bound into the fusion buffer is a view of it).
    g_ranges = _union([(p.grad.data_ptr(), p.grad.data_ptr() + p.grad.nbytes)
                       for p in params if p.grad is not None])
    # The fusion buffer is the parameters' layout; the few numbers a strategy sends after it
    # in the same collective (FusionBuffer.header) count as extra.
    f_ranges = _union([(b.flat.data_ptr(), b.flat.data_ptr() + b.flat.nbytes)
                       for b in dopt.strategy.buffers])
    held = _union([(b["start"], b["start"] + b["nbytes"]) for b in buffers])
    extra = _minus(_minus(held, p_ranges), g_ranges)
    # Per distinct buffer: the first path that reached it, what it is, bytes counted as extra.
    listing: dict[tuple[int, int], dict] = {}
    # Constant-size bookkeeping (control-message buffers, layer tables, the fusion buffer's
    # header: tens of bytes) is listed and counted in extra_bytes, but it is not a copy of
    # the parameters.
    small = min(4096, _size(p_ranges) // 100)
    for b in buffers:
        r = (b["start"], b["start"] + b["nbytes"])
        if r in listing or b["nbytes"] == 0:
            continue
        inside = {name: _size(_minus([r], ranges)) == 0 for name, ranges in
                  (("p", p_ranges), ("g", g_ranges), ("f", f_ranges))}
        if inside["p"]:
            continue  # the model's own parameters: not the framework's memory
        # The fusion buffer's storage: its layout plus a small header after it.
        header = _size(_minus([r], f_ranges))
        if not inside["f"] and header < small and header < r[1] - r[0]:
            inside["f"] = True
            layout = _minus([r], _minus([r], f_ranges))
            inside["g"] = _size(_minus(layout, g_ranges)) == 0
        else:
            header = 0
        kind = ("fusion buffer holding the gradients" if inside["f"] and inside["g"] else
                "gradients" if inside["g"] else "fusion buffer" if inside["f"] else "extra")
        listing[r] = {"path": b["path"], "dtype": b["dtype"], "bytes": b["nbytes"], "kind": kind,
                      "header_bytes": header}
    return {
        "bookkeeping_bytes": sum(h["bytes"] for h in listing.values()
                                 if h["kind"] == "extra" and h["bytes"] < small)
        + sum(h["header_bytes"] for h in listing.values()),
        "grad_bytes": _size(g_ranges),
        "fusion_bytes": _size(f_ranges),
        "extra_bytes": _size(extra),
        "extra_beyond_fusion_bytes": _size(_minus(extra, f_ranges)),
        "grads_in_fusion_buffer": bool(g_ranges) and _size(_minus(g_ranges, f_ranges)) == 0,
        "held": sorted(listing.values(), key=lambda h: -h["bytes"]),
    }


# -- rank side ----------------------------------------------------------------------------------
def _child(labels: list[str], layers: int, width: int, steps: int) -> None:
    """Every case in turn in the same processes (one ``mpirun``: starting torch on 3 ranks
    costs more than all the measuring).  Each case measures against its own baseline, taken
    after the previous case's objects are gone."""
    import torch  # the rank side only

    from mpsync.torch import _runtime

    torch.set_num_threads(1)
    by_label = {c[0]: c for c in CASES}
    for label in labels:
        _, policy, topology = by_label[label]
        try:
            _run_case(label, policy, topology, layers, width, steps)
        except SystemExit:
            # The dedicated server rank leaves init() through sys.exit once every worker has
            # shut down; here it goes on to serve the next case.
            if not _runtime.context().is_server:
                raise
        gc.collect()


def _run_case(label: str, policy: str, topology: str, layers: int, width: int,
              steps: int) -> None:
    import psutil  # the rank side only, with torch
    import torch

    import mpsync.torch as mps
    from mpsync.torch import _runtime

    # The walk and gc.collect() after every step are slow on a loaded node; the server's
    # silent-worker check (10 s by default) is not what is measured here.
    mps.init(policy=policy, topology=topology, backend="mpi", server="dedicated",
             silent_timeout=120.0)
    ctx = _runtime.context()  # a worker from here on (the server rank never returns)
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods)
    mps.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(1 + mps.rank())
    x, y = torch.randn(16, width, generator=gen), torch.randn(16, width, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    proc = psutil.Process()

    def one_step(o) -> None:
        o.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        o.step()

    for _ in range(3):  # the baseline already has gradients, activations, allocator warm-up
        one_step(opt)
    gc.collect()
    rss0 = proc.memory_info().rss
    dopt = mps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    roots = [("backend", ctx.data_backend), ("client", ctx.client)]
    worst: dict | None = None
    rss_max = 0

    def sample() -> None:
        nonlocal worst, rss_max
        gc.collect()
        rss_max = max(rss_max, proc.memory_info().rss - rss0)
        acc = account(dopt, model, roots)
        if worst is None or acc["extra_bytes"] > worst["extra_bytes"]:
            worst = acc

    for _ in range(steps):
        one_step(dopt)
        sample()
    mps.shutdown()  # the final aggregation: every policy has aggregated at least once now
    sample()
    row = dict(worst, case=label, worker=ctx.worker_rank,
               param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
               rss_growth_bytes=proc.memory_info().rss - rss0, rss_growth_max_bytes=rss_max,
               rounds=dopt.strategy.round)
    print("MEM " + json.dumps(row), flush=True)


if __name__ == "__main__":
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        names, nl, w, st = sys.argv[i + 1:i + 5]
        _child(names.split(","), int(nl), int(w), int(st))
    else:
        parser = argparse.ArgumentParser(prog="mpsync bench memory")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
