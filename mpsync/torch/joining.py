"""Horovod's ``join()``: a worker with no more data keeps taking part in the others'
collectives until every worker has joined.

Two kinds of collectives may be running on the others: their ``DistributedOptimizer``
aggregations (each strategy's own ``join``, see ``strategies``) and the script's own
collectives (``mpi_ops``).  A joined worker answers both at once: member 0's negotiation
counts it as present for every name (:mod:`~mpsync.torch._negotiation`), and while its
optimizers' joins wait inside an aggregation the backend calls :meth:`JoinService.poll`
between polls, so an ``allreduce`` the others call between two optimizer steps is answered
(zeros, as in Horovod) instead of waiting for the deadline (on the PS, also while its join
waits for the others' last pushes); an allgather, broadcast, alltoall or reducescatter raises
on the others, as in Horovod 0.28.1.  When every worker has joined, all return the worker that
joined last: the last to call ``join()``, by the wall-clock time each join carries (member 0
reads the joins only at its own steps and while it waits, and reads several waiting ones by
source, not arrival; ``_negotiation.Negotiator.join``).
"""

from __future__ import annotations

import time

from mpsync.torch._moves import take_part_joined
from mpsync.torch.dataplane.waiting import CollectiveTimeout

__all__ = ["JoinService", "join"]


class JoinService:
    """One worker's answers to the script's collectives while it is joined: it tells member 0
    it has joined, and takes part in every collective member 0 answers that it has not
    submitted itself, until member 0 says every worker has joined."""

    def __init__(self, ops):
        self.ops = ops
        self.last: int | None = None
        ops.all_joined = None
        ops.joined = self._take_part
        ops.channel.join()
        if ops.coordinator is not None:
            ops.coordinator.step()  # member 0's own join counts from now, not from its next read

    def _take_part(self, records):
        return take_part_joined(self.ops, records) if self.ops.check(records) is None else None

    def poll(self) -> bool:
        """Answer what member 0 has sent; True if it did something."""
        if self.last is not None:
            return False
        busy = self.ops.advance()
        if self.ops.all_joined is not None and not self.ops.background:
            self.last = self.ops.all_joined
            self.ops.joined = None
            self.ops.all_joined = None
            return True
        return busy

    def finish(self, deadline: float) -> int:
        """Answer collectives until every worker has joined; the worker that joined last."""
        quiet_since = time.monotonic()
        while self.last is None:
            if self.poll():
                quiet_since = time.monotonic()
            else:
                time.sleep(2e-4)
            if time.monotonic() - quiet_since > deadline:
                self.ops.joined = None
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
        for opt in ctx.optimizers.live():
            opt.synchronize_model()
    finally:
        for b in backends.values():
            b.while_waiting = None
    return service.finish(max(ctx.config.deadline, ctx.config.startup_timeout))
