"""Programs that tests/test_elastic.py runs on several ranks through mpi_harness."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from mpsync.commits import CommitStore, load_committed, newest_complete


def commit_store():
    """Four commits on every rank, then a fifth that rank 2 never writes: the manifest names
    the fourth, complete on every rank, and never the fifth."""
    comm = MPI.COMM_WORLD
    root = Path(sys.argv[1])
    store = CommitStore(root, comm, keep=2)
    for seq in range(4):
        store.commit(seq, {"rank": comm.rank, "seq": seq, "w": torch.full((256,), float(seq))},
                     info={"seq": seq})
        assert store.flush(60), f"rank {comm.rank}: commit {seq} not complete"
    if comm.rank != 2:
        store.commit(4, {"rank": comm.rank, "seq": 4})
    assert store.writer.wait(60)
    comm.Barrier()
    complete = store.close(timeout=1.0)
    if comm.rank == 0:
        assert not complete, "commit 4 lacks rank 2's part and must not be complete"
        m = newest_complete(root)
        assert (m.seq, m.size, m.info) == (3, 3, {"seq": 3}), m
        parts = [load_committed(m, r) for r in range(3)]
        assert [(p["rank"], p["seq"]) for p in parts] == [(0, 3), (1, 3), (2, 3)]
        # Only the newest two complete commits are kept.
        kept = sorted(p.name for p in root.iterdir() if p.name.startswith("commit-"))
        print("RESULT " + json.dumps({"kept": kept}), flush=True)


def refused_commit():
    """``hvd.elastic.run`` under a commit directory (argv[1]) whose newest complete commit is
    refused when worker 0 loads it: the job must end before the training function runs."""
    import os

    import mpsync.torch as hvd
    from mpsync.commits import ENV_COMMIT_DIR

    os.environ[ENV_COMMIT_DIR] = sys.argv[1]
    hvd.init()
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=0)

    @hvd.elastic.run
    def train(state):
        print("TRAINING", flush=True)

    train(state)
