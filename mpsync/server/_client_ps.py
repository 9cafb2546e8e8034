"""The parameter-server calls of the worker's state-server client (``SyncClient``): the
initial weights, push and pull, push and pull in one exchange (ASP's, and SSP's and
DSSP's while their bound cannot bind) whose state-server replies are collected later, and
the push, grant and pull of a pull the bound may hold in three round trips (the
plumbing, ``_call``, ``_header``, ``_wait``, is ``SyncClient``'s, in
:mod:`mpsync.server._client`).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpsync.server import wire as W

__all__ = ["ParameterServerCalls"]

_MSG_BYTES = W.MSG_LEN * 8


class ParameterServerCalls:
    """Mixed into ``SyncClient``; ``self.shards`` is the sharded PS's data plane
    (``shards.ShardClient``) or None (the state server's own store)."""

    # How many of this worker's next pushes have pulls the state server grants whatever the
    # others do meanwhile (``Policy.sure_pulls``: SSP's and DSSP's bound cannot bind on
    # them), from the latest pull's reply; one is used up by each push.
    sure_pulls = 0

    def ps_init(self, flat: np.ndarray, replace: bool = False) -> None:
        """The initial weights (sharded: to every shard first, then the state server learns
        that the model is there).  ``replace``: the shards' weights are replaced if they have
        some (``auto`` switching to the PS again)."""
        if self.shards is not None:
            flat = np.ascontiguousarray(flat)
            (self.shards.load if replace else self.shards.init)(flat)
            self._call(W.PS_INIT, "ps_init", header=self._header(count=0))
            return
        data = np.ascontiguousarray(flat, dtype=np.float64)
        self._call(W.PS_INIT, "ps_init", header=self._header(count=data.size), data=data)

    def push(self, delta: np.ndarray, iteration: int, final: bool = False,
             finite: bool = False) -> int:
        """Send an update; the server applies it on arrival.  ``final``: this worker's last
        push (others' pulls stop waiting for it under SSP/DSSP).  Returns the model version.
        ``finite`` (sharded): every value of ``delta`` is known to be finite
        (``ShardClient.checked_push``).
        Sharded: every shard applies its slice first, and only then is the push counted by
        the state server, so its staleness rules count updates that are in on every shard."""
        if self.shards is not None:
            # Empty (the server's optimizer, no gradient since the last push): an idle
            # iteration's push still reaches every shard, which hears from the worker (the
            # liveness checks read that); it adds nothing to a round (ServerUpdates.take).
            # A last push (``final``) reaches none: it ends this worker's rounds.
            if delta.size or not final:
                self.shards.push(np.ascontiguousarray(delta), finite)
            self._call(W.PUSH, f"push {iteration}",
                       header=self._header(iteration, count=0, flag=int(final)))
        else:
            data = np.ascontiguousarray(delta, dtype=np.float64)
            self._call(W.PUSH, f"push {iteration}",
                       header=self._header(iteration, count=data.size, flag=int(final)),
                       data=data)
        self.sure_pulls = max(0, self.sure_pulls - 1)
        return int(self._rep[W.R_VERSION])

    def pull_is_sure(self) -> bool:
        """Will the state server grant the pull after this worker's next push whatever the
        others do meanwhile (``sure_pulls``, with the replies still to collect collected)?
        Then :meth:`push_pull` may read it without asking (``gated``)."""
        if self._later:
            self._collect_later(steps_if_in=True)   # (a step's reply says nothing of pulls)
        return self.sure_pulls > 0

    def push_pull(self, delta: np.ndarray, out: np.ndarray, iteration: int,
                  gated: bool = False, finite: bool = False, in_slots: bool = False) -> int:
        """Sharded PS: push ``delta`` and read the weights after it into ``out`` in one round
        trip per shard (``ShardClient.push_pull``), for a pull the state server never holds
        (ASP) or, ``gated``, one it is sure to grant (:meth:`pull_is_sure`: SSP, DSSP while
        their bound cannot bind).  Its replies are collected before this client's next call
        that waits for one (missing: ``DeadlineExceeded`` there).  Under ASP the server is
        told of the push and the pull while the shards work; ``gated``, once every shard
        has applied the push (the staleness rules count only pushes that are in on every
        shard, which the sure pulls of others rely on).  Returns the model version of the
        latest pull reply collected.  ``finite``: as :meth:`push`'s; ``in_slots``: ``delta``
        is in the inbox's slots already (``ShardClient.next_slots``).

        Under ASP the reply to the previous ``push_pull`` is collected after this one's
        exchange, not before it: the server need not wake up for a request whose reply
        nobody waits for (``StateServer._not_awaited``), so, back to back, the reply may
        still be on its way when the next exchange starts."""
        wire = self.shards.checked_push(np.ascontiguousarray(delta), finite)  # before any send
        if self._later and (gated or len(self._later) >= len(self._later_bufs)):
            self._collect_later(steps_if_in=True)
        if gated:
            if self.sure_pulls < 1:
                raise ValueError("push_pull(gated=True) of a pull the server may hold "
                                 "(pull_is_sure() is False): push, then pull")
            self.sure_pulls -= 1

        def tell_server():   # one header for both (``PUSH_PULL``), its reply the pull's
            self._post_later(W.PUSH_PULL, self._header(iteration), f"push_pull {iteration}")

        if gated:
            self.shards.push_pull(wire, out, applied=tell_server, in_slots=in_slots)
        else:
            self.shards.push_pull(wire, out, meanwhile=tell_server, in_slots=in_slots)
            # The one before had this exchange's time to come; a step reported without
            # waiting (ASP's) is taken if it is in, else at the next collection.
            self._collect_later(keep=1, steps_if_in=True)
        return self._version

    def push_then_pull(self, delta: np.ndarray, out: np.ndarray, iteration: int,
                       finite: bool = False, in_slots: bool = False) -> int:
        """Sharded PS, a pull the state server may hold (SSP's and DSSP's while their bound
        may bind): push ``delta`` to every shard, then one exchange with the state server
        that counts the push and grants the pull (``PUSH_PULL``, its reply held while the
        rule holds the pull), then read the weights into ``out``.  Three round trips, each
        one the rule needs: the push is counted only once it is in on every shard, the pull
        is granted only once counted, and the weights are read only once granted.
        :meth:`push` and :meth:`pull` make four (a reply to the push, then the pull's
        request).  Returns the model version of the grant.  ``finite``, ``in_slots``: as
        :meth:`push_pull`'s."""
        if self.shards is None:
            raise ValueError("push_then_pull needs the sharded parameter server (without "
                             "shards: push, then pull)")
        if not out.flags.c_contiguous:
            raise ValueError("push_then_pull needs a contiguous array for the weights")
        self.shards.push(np.ascontiguousarray(delta), finite, in_slots)
        self._call(W.PUSH_PULL, f"push_pull {iteration}", header=self._header(iteration))
        version = int(self._rep[W.R_VERSION])
        self.sure_pulls = int(self._rep[W.R_EXTRA])
        round_, left_out = self._round_told(f"push_pull {iteration}")
        self.shards.pull(out, round_=round_, excluded=left_out, granted=True)
        return version

    def pull(self, out: np.ndarray, iteration: int, final: bool = False,
             barrier: int = 0) -> int:
        """Current global weights into ``out`` (contiguous; float64 from the state server's
        store, the model's dtype from shards), as soon as the policy's staleness rule
        allows: the state server grants the pull, then every shard sends its slice.
        ``final``: the last pull of training, after every worker's last push (nobody will
        push again, so no staleness rule can be waited for).  Returns the model version
        (updates applied so far).  ``barrier`` (sharded): > 0, the pull at that barrier;
        ``ALL_PUSHES_IN``, after every worker's last push (``ShardClient.pull``)."""
        if not out.flags.c_contiguous or (self.shards is None and out.dtype != np.float64):
            raise ValueError("pull needs a contiguous array (float64 without shards)")
        count = 0 if self.shards is not None else out.size
        self._call(W.PULL, f"pull {iteration}",
                   header=self._header(iteration, count=count, flag=int(final)),
                   reply_data=None if self.shards is not None else out)
        version = int(self._rep[W.R_VERSION])
        self.sure_pulls = int(self._rep[W.R_EXTRA])
        if self.shards is not None:
            round_, left_out = self._round_told(f"pull {iteration}")
            self.shards.pull(out, barrier=barrier, round_=round_, excluded=left_out)
        return version

    def _round_told(self, what: str) -> tuple[int, np.ndarray | tuple]:
        """The round a sharded pull's grant names and the workers whose pushes it leaves
        out (their indices follow the reply: ``wire.R_PULL_ROUND``); ``(0, ())`` where the
        grant names none (a policy whose shards do not step once per round)."""
        round_ = int(self._rep[W.R_PULL_ROUND])
        count = int(self._rep[W.R_COUNT]) if round_ > 0 else 0
        if count <= 0:
            return round_, ()
        left_out = np.empty(count, dtype=np.float64)
        self._wait(self.comm.Irecv([left_out, MPI.DOUBLE], source=self.server,
                                   tag=W.REPLY_DATA), what + " (the workers left out)")
        self.control_received += left_out.nbytes
        return round_, left_out.astype(np.int64)

