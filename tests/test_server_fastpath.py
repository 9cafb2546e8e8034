"""The compiled serve loop must serve what the registry says it serves, and say so.

A change to the rules or to the registry that makes the compiled loop hand every message back
to the Python loop would leave every answer right and only the speed gone; these tests catch
it without timing anything: one process talks to its own server over ``COMM_SELF`` (real MPI
messages to itself), and the loop's :class:`~mpsync.server._fastpath.ServeResult` must count
the steps it served, the replies must be there, and the tables must show them.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpsync import policies as registry
from mpsync.config import SyncConfig
from mpsync.server import StateServer, rules, wire as W
from mpsync.server._fastpath import PROBED, QUIET, RECEIVED

_FAMILY = {name: registry.get(name).fast_path for name in registry.names()}
_ANSWERED_HERE = [n for n, f in _FAMILY.items() if f in ("tables", "query_state")]
_PLANNED = [n for n, f in _FAMILY.items() if f == "planned"]


def _server(policy):
    comm = MPI.COMM_SELF.Dup()
    cfg = SyncConfig.from_options(env={}, policy=policy,
                                  topology=registry.default_topology(policy),
                                  server="colocated", silent_timeout=600.0, deadline=600.0)
    return comm, StateServer(comm, cfg, workers=[0])


def _send_steps(comm, first_seq, count, tag=W.STEP):
    """``count`` well-formed step (or reset) headers from this rank to itself."""
    requests, bufs = [], []
    for i in range(count):
        msg = W.new_msg()
        msg[W.SEQ] = first_seq + i
        msg[W.ITER] = 1 + i
        msg[W.COMPUTE] = 0.01
        msg[W.ROUND] = 1
        bufs.append(msg)
        requests.append(comm.Isend([msg, MPI.DOUBLE], dest=0, tag=tag))
    return requests, bufs


def _serve_all(server):
    now = MPI.Wtime()
    return server.fast.serve(now, 0.05, now + 30.0)


@pytest.mark.parametrize("policy", _ANSWERED_HERE)
def test_the_compiled_loop_reports_every_step_it_served(policy):
    comm, server = _server(policy)
    try:
        assert server.fast is not None, f"{policy}: no compiled path on Open MPI"
        n = 25
        requests, _ = _send_steps(comm, 1, n)
        done = _serve_all(server)
        MPI.Request.Waitall(requests)
        assert done.handled == n, f"{policy}: the compiled loop served {done.handled} of {n}"
        # Then it probed its own first reply (this rank is also the worker): not its to take.
        assert (done.code, done.tag, done.error) == (PROBED, W.REPLY, 0), done
        reply = W.new_msg()
        for seq in range(1, n + 1):
            comm.Recv([reply, MPI.DOUBLE], source=0, tag=W.REPLY)
            assert reply[W.R_SEQ] == seq
            assert reply[W.R_ACTION] in (W.LOCAL, W.SYNC)
        view = server.view()
        assert view.counters["steps"][0] == n
        assert view.tables["iteration"][0] == n
        # Its resets too: the aggregation it told the worker to join is over.
        requests, _ = _send_steps(comm, n + 1, 1, tag=W.RESET)
        done = _serve_all(server)
        MPI.Request.Waitall(requests)
        assert (done.code, done.handled) == (QUIET, 1), done
        assert server.view().counters["rounds"][0] == 1
        assert not comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)   # no reply to a reset
    finally:
        comm.Free()


@pytest.mark.parametrize("policy", _PLANNED)
def test_a_step_without_a_plan_is_handed_to_the_python_loop_untouched(policy):
    comm, server = _server(policy)
    try:
        requests, bufs = _send_steps(comm, 1, 1)
        done = _serve_all(server)
        MPI.Request.Waitall(requests)
        assert done.code == RECEIVED and done.handled == 0, done
        assert done.handover[1:3] == (W.STEP, 0)
        assert np.array_equal(server._msg, bufs[0])   # received, for the Python loop to finish
        assert server.view().counters["steps"][0] == 0   # nothing written by the compiled loop
    finally:
        comm.Free()


def test_a_message_of_another_kind_is_left_in_the_queue():
    comm, server = _server(_ANSWERED_HERE[0])
    try:
        req = comm.Isend([W.new_msg(), MPI.DOUBLE], dest=0, tag=W.STATS)
        done = _serve_all(server)
        assert (done.code, done.handled, done.tag) == (PROBED, 0, W.STATS), done
        assert comm.Iprobe(0, W.STATS)
        comm.Recv([W.new_msg(), MPI.DOUBLE], source=0, tag=W.STATS)
        req.Wait()
    finally:
        comm.Free()


def test_every_compiled_family_of_the_registry_is_covered_here():
    assert set(_FAMILY.values()) - {None} <= {"tables", "query_state", "planned"}
    assert set(rules.FAST_KINDS) == {"tables", "query_state", "planned"}


def test_waiting_for_a_due_report_keeps_the_loop_in_compiled_code_until_first_by():
    """Wake-ahead's wait (``first_by``): with nothing queued the call returns only once
    ``first_by`` has passed, however short the hot window; a report that comes is served there,
    and after it the call ends as a hot window does."""
    comm, server = _server(_ANSWERED_HERE[0])
    try:
        now = MPI.Wtime()
        first_by = now + 0.02
        done = server.fast.serve(now, 0.0, now + 30.0, first_by=first_by)
        assert (done.code, done.handled) == (QUIET, 0), done
        assert MPI.Wtime() >= first_by
        requests, _ = _send_steps(comm, 1, 1)
        now = MPI.Wtime()
        done = server.fast.serve(now, 0.0, now + 30.0, first_by=now + 30.0)
        MPI.Request.Waitall(requests)
        assert done.handled == 1 and done.code in (QUIET, PROBED), done
        assert MPI.Wtime() < now + 30.0   # the served report ended the wait
        reply = W.new_msg()
        comm.Recv([reply, MPI.DOUBLE], source=0, tag=W.REPLY)
        assert reply[W.R_SEQ] == 1
    finally:
        comm.Free()
