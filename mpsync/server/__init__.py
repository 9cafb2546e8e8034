"""The control plane: a state server on one rank answering every worker, per iteration,
"keep training locally" (LOCAL) or "synchronize now" (SYNC), over mpi4py point-to-point
messages with fixed-size numpy buffers; and the parameter server's shard servers, which only
store, apply and serve the model's bytes (``shards``).

Server side::

    from mpsync.server import StateServer
    stats = StateServer(control_comm, config, server_rank=0).serve()   # until all shut down

Worker side::

    client = SyncClient(control_comm, config, server_rank=0)
    decision = client.step(k, compute_time)      # after local iteration k
    if decision.sync: ...aggregate...; client.reset(round_, aggregation_time)
    client.shutdown()

``control_comm`` is a ``Dup()`` of the job's communicator made by the caller on every rank, so
no user message can ever match the server's receives.  The policies are ``Policy`` subclasses
(``mpsync.server.policies``), looked up in the registry :mod:`mpsync.policies`; their
decisions are the kernels of ``mpsync.sched``.  A policy of your own subclasses ``Policy``
(tables in ``WorkerTable``) and registers itself with ``mpsync.policies.register``.
"""

from mpsync.server._client import (
    LOCAL,
    SYNC,
    DeadlineExceeded,
    Decision,
    PendingDecision,
    ServerError,
    SyncClient,
)
from mpsync.server._stats import write_chrome_trace, write_stats_json

__all__ = [
    "StateServer", "SyncClient", "Decision", "PendingDecision", "LOCAL", "SYNC",
    "ServerError", "DeadlineExceeded", "start_colocated", "ColocatedServer",
    "write_stats_json", "write_chrome_trace", "ServerView", "make_policy", "WorkerTable",
    "Policy", "WeightStore", "compiled_path_unavailable",
]


def __getattr__(name):
    # The server side (and with it Numba and the kernels) is imported only where it runs, so
    # a worker process starts without compiling or loading any kernel.
    if name == "compiled_path_unavailable":
        from mpsync.server._fastpath import unavailable_reason

        return unavailable_reason
    if name == "StateServer":
        from mpsync.server._loop import StateServer

        return StateServer
    if name in ("start_colocated", "ColocatedServer"):
        from mpsync.server import _colocated

        return getattr(_colocated, name)
    if name in ("ServerView", "make_policy", "WorkerTable", "Policy", "WeightStore"):
        from mpsync.server import _view, policies, weights

        for module in (policies, _view, weights):
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module 'mpsync.server' has no attribute {name!r}")
