"""A Horovod training script runs under mpsync with only its import and init lines changed.

``HOROVOD_SCRIPT`` is an ordinary Horovod PyTorch script (model, DistributedOptimizer,
broadcast_parameters / broadcast_optimizer_state, a DistributedSampler-style shard, an epoch
loop, hvd.allreduce of a metric).  The test derives the mpsync version by replacing exactly two
lines and runs it under ``mpirun -np 4`` (through the harness) and under ``horovodrun -np 4``.
With a co-located server (4 workers) the result must equal the original Horovod script's.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from mpi_harness import REPO, run_mpi
from mpsync.launch import run_with_deadline

pytestmark = pytest.mark.mpi

HOROVOD_IMPORT = "import horovod.torch as hvd"
HOROVOD_INIT = "hvd.init()"

HOROVOD_SCRIPT = textwrap.dedent('''
    import hashlib

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(42)
    torch.set_default_dtype(torch.float64)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 4)

        def forward(self, x):
            return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


    g = torch.Generator().manual_seed(7)
    data = torch.randn(384, 16, generator=g)
    target = (data[:, :4].argmax(dim=1) + (data[:, 4] > 1).long()) % 4
    dataset = torch.utils.data.TensorDataset(data, target)
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(3):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
        avg_loss = hvd.allreduce(torch.tensor(loss.item()), name="avg_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch} loss {avg_loss.item():.6f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"FINAL rank={hvd.rank()} size={hvd.size()} digest={digest} "
          f"params={' '.join(f'{v:.12e}' for v in flat[:64].tolist())}", flush=True)
''')


def mpsync_version(init_line: str) -> str:
    """The Horovod script with only the import and the init line changed."""
    assert HOROVOD_SCRIPT.count(HOROVOD_IMPORT) == 1 and HOROVOD_SCRIPT.count(HOROVOD_INIT) == 1
    return (HOROVOD_SCRIPT.replace(HOROVOD_IMPORT, "import mpsync.torch as hvd")
            .replace(HOROVOD_INIT, init_line))


def finals(text: str) -> dict[int, dict]:
    out = {}
    for m in re.finditer(r"FINAL rank=(\d+) size=(\d+) digest=(\w+) params=([^\n]*)", text):
        out[int(m.group(1))] = {"size": int(m.group(2)), "digest": m.group(3),
                                "params": [float(v) for v in m.group(4).split()]}
    return out


def untag(output: str) -> str:
    """horovodrun's output with each rank's stream put back together.

    Open MPI tags every chunk it forwards with ``[job,rank]<stdout>:``; a long line can reach
    it in two chunks with another rank's chunk in between, so stripping the tags in place can
    glue two ranks' half lines together.  Each chunk is appended to its own rank's stream."""
    streams: dict[str, list[str]] = {}
    parts = re.split(r"\[\d+,(\d+)\]<(?:stdout|stderr)>:", output)
    for rank, chunk in zip(parts[1::2], parts[2::2]):
        streams.setdefault(rank, []).append(chunk)
    return "".join("".join(chunks) + "\n" for chunks in streams.values())


def run_script(tmp_path: Path, name: str, text: str, np: int = 4):
    path = tmp_path / name
    path.write_text(text)
    run = run_mpi(str(path), np=np, timeout=180)
    return finals("".join(run.rank_out(r) for r in run.ranks)), run


def test_horovod_script_under_mpirun_matches_horovod(tmp_path):
    reference, _ = run_script(tmp_path, "horovod_original.py", HOROVOD_SCRIPT)
    assert sorted(reference) == [0, 1, 2, 3]
    mine, run = run_script(tmp_path, "mpsync_colocated.py", mpsync_version(
        'hvd.init(policy="bsp", backend="mpi", server="colocated")'))
    assert sorted(mine) == [0, 1, 2, 3], run.report()
    assert len({r["digest"] for r in mine.values()}) == 1  # every worker holds the same model
    for a, b in zip(mine[0]["params"], reference[0]["params"]):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (a, b)
    assert "epoch 2 loss" in run.rank_out(0)


def test_horovod_script_with_a_dedicated_server_trains_on_the_other_ranks(tmp_path):
    mine, run = run_script(tmp_path, "mpsync_dedicated.py", mpsync_version(
        'hvd.init(policy="bsp", backend="horovod", server="dedicated")'))
    # Rank 0 served and exited cleanly; ranks 1-3 are workers 0-2.
    assert sorted(mine) == [0, 1, 2] and all(r["size"] == 3 for r in mine.values()), run.report()
    assert len({r["digest"] for r in mine.values()}) == 1


def test_horovod_script_under_horovodrun(tmp_path):
    horovodrun = Path(sys.executable).with_name("horovodrun")
    path = tmp_path / "mpsync_horovodrun.py"
    path.write_text(mpsync_version('hvd.init(policy="bsp", backend="horovod")'))
    argv = [str(horovodrun), "-np", "4", "--mpi",
            "--mpi-args=--oversubscribe --allow-run-as-root --bind-to none "
            "--mca mpi_yield_when_idle 1",
            sys.executable, str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = run_with_deadline(argv, 240, env=env)  # hard timeout, kills the process group
    assert res.returncode == 0 and not res.timed_out, res.stdout[-3000:] + res.stderr[-3000:]
    text = untag(res.stdout)
    mine = finals(text)
    assert sorted(mine) == [0, 1, 2] and len({r["digest"] for r in mine.values()}) == 1, text[-3000:]
