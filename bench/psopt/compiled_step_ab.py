"""The server-side optimizer's step per push in the shard's compiled loop against its Python
loop, in one process.

A shard thread (``ShardServer``) and one worker's client (``ShardClient``) over
``COMM_SELF``: settings, the initial weights, then ``CALLS`` push+pulls of a float32 slice
of ELEMENTS (``push_pull``: the gradient, the ACK, the weights stepped), timed one by one,
the median after 20 warm-up calls.  For each repeat and each kind (the delta added as the
workers' own optimizer pushes it, server-side SGD, server-side Adam), the compiled loop
and then the Python loop (``compiled=False``), so the two alternate within the minute.

    python bench/psopt/compiled_step_ab.py 100000 3 > bench/psopt/compiled_step_ab.json
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from mpsync.server.shard_optimizer import OptimizerSettings, ServerUpdates
from mpsync.server.shard_server import ShardServer, ShardThread
from mpsync.server.shards import ShardClient

CALLS, WARM_UP = 400, 20
KINDS = ("add", "sgd", "adam")   # add: the workers run the optimizer (ps_optimizer='worker')


def session(compiled: bool, elements: int, kind: str) -> tuple[float, int]:
    """Median µs of a push+pull, and the requests the compiled loop served."""
    requests, replies = MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()
    updates = None if kind == "add" else ServerUpdates(per_round=False)
    server = ShardServer(requests, replies, 0, 1, 1.0, compiled=compiled, updates=updates,
                         log=lambda *_: None)
    thread = ShardThread(server)
    client = ShardClient(requests, replies, [0], ["PS shard 0"], 10.0)
    if updates is not None:
        settings = OptimizerSettings(kind, lr=1e-3, momentum=0.9 if kind == "sgd" else 0.0)
        client.configure(settings.to_array())
    client.init(np.zeros(elements, np.float32))
    grad = (np.random.default_rng(0).standard_normal(elements) * 1e-3).astype(np.float32)
    out = np.empty(elements, np.float32)
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        client.push_pull(client.checked_push(grad), out)
        times.append(time.perf_counter() - start)
    client.close()
    stats = thread.join(10.0)
    requests.Free()
    replies.Free()
    return float(np.median(times[WARM_UP:])) * 1e6, int(stats["served_compiled"])


def main(elements: int, repeats: int) -> dict:
    rows: dict[str, dict[str, list]] = {}
    for _ in range(repeats):
        for kind in KINDS:
            for compiled in (True, False):
                micros, served = session(compiled, elements, kind)
                row = rows.setdefault(f"{kind}, {'compiled' if compiled else 'Python'} loop",
                                      {"median_us": [], "served_compiled": []})
                row["median_us"].append(round(micros, 1))
                row["served_compiled"].append(served)
    return {"elements": elements, "dtype": "float32", "calls": CALLS, "warm_up": WARM_UP,
            "rows": rows}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2])), indent=1))
