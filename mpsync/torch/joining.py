"""Horovod's ``join()``: a worker with no more data keeps taking part in the others'
collectives until every worker has joined.

Two kinds of collectives may be running on the others: their ``DistributedOptimizer``
aggregations (each strategy's own ``join``, see ``strategies``) and the script's own
collectives (``mpi_ops``).  A joined worker answers both at once: it posts a ``JOINED``
record for the script's next collective, and while its optimizers' joins wait inside an
aggregation the backend calls :meth:`JoinService.poll` between polls, so an ``allreduce``
the others call between two optimizer steps is answered (zeros, as in Horovod) instead of
waiting for the deadline.  When every worker's record says JOINED, all return.
"""

from __future__ import annotations

import time

import numpy as np

from mpsync.torch import _metadata as meta
from mpsync.torch._moves import take_part_joined
from mpsync.torch._wait import CollectiveTimeout

__all__ = ["JoinService", "join"]


class JoinService:
    """One worker's answers to the script's collectives while it is joined."""

    def __init__(self, ops):
        self.ops = ops
        ops.drain()
        self.joined_at = ops.exchanges
        self.last: int | None = None
        self._round = ops.exchange(meta.joined_record(ops.size, self.joined_at))

    def poll(self) -> bool:
        """Answer the next collective if its records are in; True if it did something."""
        if self.last is not None or not self._round.test_records():
            return False
        records = self._round.records
        if np.all(records[:, meta.Field.KIND] == meta.JOINED):
            at = records[:, meta.Field.JOINED_ROUNDS]
            self.last = int(np.flatnonzero(at == at.max())[-1])
            return True
        if self.ops.check(records) is None:
            take_part_joined(self.ops, records)
        self._round = self.ops.exchange(meta.joined_record(self.ops.size, self.joined_at))
        return True

    def finish(self, deadline: float) -> int:
        """Answer collectives until every worker has joined; the worker that joined last."""
        quiet_since = time.monotonic()
        while self.last is None:
            if self.poll():
                quiet_since = time.monotonic()
            else:
                time.sleep(2e-4)
            if time.monotonic() - quiet_since > deadline:
                raise CollectiveTimeout("join", deadline, [], why="the workers that have not "
                                        "joined neither called a collective nor joined")
        return self.last


def join(ctx) -> int:
    """``mps.join()`` on this worker (see the module doc)."""
    service = JoinService(ctx.user_ops)
    backends = {id(b): b for b in (ctx.backend, ctx.data_backend) if b is not None}
    for b in backends.values():
        b.while_waiting = service.poll
    try:
        for opt in list(ctx.optimizers):
            opt.synchronize_model()
    finally:
        for b in backends.values():
            b.while_waiting = None
    return service.finish(max(ctx.config.deadline, ctx.config.startup_timeout))
