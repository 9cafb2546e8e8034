"""``mpsync bench commit``: what a durable commit costs a training step.

The model is the wide MLP's shape (``mpsync.apps.models.WideMLP`` on 8x8 digits: 64 -> 1024
-> 1024 -> 1024 -> 10, 2.18 M parameters) with SGD and momentum, batch 32, one thread.  In
one process, interleaved per repeat so background load hits all rows alike:

* ``step``: forward, backward and optimizer step -- the baseline;
* ``copy``: what a commit costs the training thread: a deep copy of the model's and the
  optimizer's state dicts (Horovod's ``TorchState.save``), handed to the background writer;
* ``write``: writing that copy as a sealed file (torch.save, sha256, fsync, rename), on the
  training thread -- what a commit would cost without the background writer;
* ``steps, commit every K``: K steps with a commit at the last one, the writer busy in the
  background, against K plain steps: the real overhead per step of committing every K steps.
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=int, default=15, help="samples per row (median)")
    p.add_argument("--every", default="1,10", help="commit every K steps, K in this list")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary "
                                                  "directory; give a node-local or shared disk)")
    p.add_argument("--json", action="store_true")


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dims = [64, 1024, 1024, 1024]
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model, opt, step


def run(args) -> int:
    from mpsync.commits import BackgroundWriter, write_sealed

    model, opt, step = _model()
    every = [int(k) for k in args.every.split(",") if k.strip()]
    with tempfile.TemporaryDirectory(prefix="mpsync-bench-commit-", dir=args.dir) as d:
        path = Path(d)
        writer = BackgroundWriter()

        def copy_state():
            return {"model": copy.deepcopy(model.state_dict()),
                    "optimizer": copy.deepcopy(opt.state_dict())}

        def commit(seq):
            snapshot = copy_state()
            writer.submit(lambda: write_sealed(path / "bg.pt", snapshot, seq=seq))

        for _ in range(3):   # warm-up: optimizer state exists, caches and files warm
            step()
            write_sealed(path / "fg.pt", copy_state(), seq=0)
        rows: dict[str, list[float]] = {"step": [], "copy": [], "write": []}
        rows.update({f"steps_plain_{k}": [] for k in every})
        rows.update({f"steps_commit_{k}": [] for k in every})
        seq = 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            step()
            rows["step"].append(time.perf_counter() - t)
            writer.wait()
            t = time.perf_counter()
            commit(seq)
            rows["copy"].append(time.perf_counter() - t)
            writer.wait()
            snapshot = copy_state()
            t = time.perf_counter()
            write_sealed(path / "fg.pt", snapshot, seq=seq)
            rows["write"].append(time.perf_counter() - t)
            for k in every:
                writer.wait()
                t = time.perf_counter()
                for _ in range(k):
                    step()
                rows[f"steps_plain_{k}"].append((time.perf_counter() - t) / k)
                t = time.perf_counter()
                for i in range(k):
                    step()
                    if i == k - 1:
                        seq += 1
                        commit(seq)
                rows[f"steps_commit_{k}"].append((time.perf_counter() - t) / k)
            seq += 1
        writer.close(60)
        size = (path / "fg.pt").stat().st_size
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    result = {"state_bytes": size, "median_ms": med, "repeats": args.repeats,
              "step_ratio": {k: v / med["step"] for k, v in med.items()},
              "background_writes": writer.written, "superseded": writer.superseded}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"commit of the wide MLP ({size / 1e6:.1f} MB: parameters and momentum), "
          f"median of {args.repeats}")
    print(f"  {'row':<34} {'ms':>8} {'x step':>7}")
    names = {"step": "step (baseline)", "copy": "commit on the training thread",
             "write": "write on the training thread"}
    for k in every:
        names[f"steps_plain_{k}"] = f"per step, {k} plain steps"
        names[f"steps_commit_{k}"] = f"per step, commit every {k}"
    for key, label in names.items():
        print(f"  {label:<34} {med[key]:>8.2f} {med[key] / med['step']:>7.2f}")
    print(f"  background writes {writer.written}, superseded before writing "
          f"{writer.superseded}")
    return 0
