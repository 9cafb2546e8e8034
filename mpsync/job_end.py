"""How an error on one rank ends the whole job, at once and with one line saying why.

A rank that only exits leaves the others waiting for it: inside a blocking collective, until
a deadline, or in ``MPI_Finalize``, which waits for every rank (a job with a stopped or failed
rank would then never end).  So an error nothing catches, on any rank and in any thread, goes
to an abort hook that says which rank failed and why, then calls ``MPI_Abort``; a user's
mistake (a setting, a data file, a checkpoint) is one line without a traceback, a fault (a
silent peer) one line, a bug its traceback.  An error the script catches stays the script's.

Light on purpose (no mpi4py, torch or Numba at import): ``mpsync train`` sets the hooks on
each rank before it imports any of them, so no error on the way to ``init`` is left out.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback

from mpsync.config import ConfigError, debug_enabled, print_user_error

__all__ = ["end_job", "end_job_for", "install_abort_hooks", "install_unless_the_script_has",
           "launched_world_size", "rank_label", "refuse", "running_world", "is_user_error",
           "USER_ERRORS", "LONE_ERROR_WAIT"]


# How long a rank other than 0 waits for rank 0 to end the job before it reports its error.
LONE_ERROR_WAIT = 15.0


def refuse(exc: BaseException, comm=None) -> None:
    """End the job for a user error: one line on world rank 0, exit status 2.  Settings are
    the same on every rank (the launcher passes the environment on), so the other ranks wait
    for rank 0 to end the job; one still running after ``LONE_ERROR_WAIT`` had an error of its
    own (rank 0 is a dedicated server that never saw it, say), and says it: well within the
    half minute in which any error must have ended the job.  ``MPSYNC_DEBUG=1`` prints the
    traceback too."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    if debug_enabled():
        traceback.print_exception(exc)
    if rank != 0:
        time.sleep(LONE_ERROR_WAIT)
    sys.stderr.write(f"mpsync: error: {exc}\n")
    end_job(2, comm)


def running_world():
    """``MPI.COMM_WORLD`` when this process runs MPI (initialised, not yet finalised), else
    None.  Never starts MPI: mpi4py is looked at only if something imported it already."""
    if "mpi4py.MPI" not in sys.modules:
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD if MPI.Is_initialized() and not MPI.Is_finalized() else None


def end_job(code: int, comm=None) -> None:
    """End this rank with ``code``, and the whole job with it: with MPI running and other
    ranks, ``MPI_Abort`` (a rank that only exits would leave the others waiting for it, in
    a collective or in ``MPI_Finalize``, which waits for every rank); before MPI started, or
    alone, this process only (Open MPI ends a job whose rank exits non-zero).  Never
    returns; what was written to stdout and stderr is flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed or broken pipe must not keep us alive
            pass
    comm = running_world() if comm is None else comm
    if comm is not None and comm.Get_size() > 1:   # alone, there is no one else to stop
        comm.Abort(code)
    os._exit(code)


def launched_world_size() -> int:
    """The ranks of the job this process is one of, from the launcher's environment (1 when
    not launched as a rank); readable before MPI starts."""
    size = os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))
    return int(size) if size.isdigit() else 1


def install_unless_the_script_has(label: str, prog: str = "mpsync") -> None:
    """:func:`install_abort_hooks` on a rank of a job of several, before ``init`` (MPI runs
    from the import of mpi4py on: an error before ``init`` on one rank would leave the others
    waiting in it forever), unless the script has put an excepthook of its own in place."""
    if launched_world_size() > 1 and sys.excepthook is sys.__excepthook__:
        install_abort_hooks(None, label, prog)


def rank_label() -> str:
    """``rank N`` from the launcher's environment (readable before MPI starts)."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
    return f"rank {rank}" if rank is not None else "this process"


def install_abort_hooks(comm, label: str, prog: str = "mpsync") -> None:
    """An unhandled exception on this rank (any thread) ends the whole job: the other ranks
    would otherwise wait for this one until their deadlines pass, or forever inside a
    blocking collective or ``MPI_Finalize``.  A user's mistake (a setting, a data file, a
    checkpoint) is one line naming the rank, exit status 2; a fault (a silent peer) one line,
    status 1; anything else is a bug and keeps its traceback, tagged with the rank.

    ``comm`` None: the world, if MPI runs by the time of the error (the hooks can be set
    before MPI starts, so that no error on the way to ``init`` is left out)."""
    def abort(exc_type, exc, tb) -> None:
        end_job_for(exc, label, comm, tb, prog=prog)

    sys.excepthook = abort
    threading.excepthook = lambda a: abort(a.exc_type, a.exc_value, a.exc_traceback)


def end_job_for(exc: BaseException, label: str, comm=None, tb=None, *,
                prog: str = "mpsync") -> None:
    """Say why this rank (``label``, e.g. ``rank 2 (worker 1)``) fails and end the job
    (:func:`end_job`): a user's mistake is ``PROG (LABEL): error: ...``, status 2; a fault
    (a deadline that passed: a silent or lost peer) ``PROG: fault: LABEL on HOST: ...``,
    status 1; each one line, with its traceback only under ``MPSYNC_DEBUG=1``.  Anything else
    is a bug: its traceback, tagged ``MPSYNC-RANK-FAILED`` with the rank.  Never returns."""
    if isinstance(exc, ConfigError) and comm is not None:
        refuse(exc, comm)
    if is_user_error(exc):
        print_user_error(f"{prog} ({label})", exc)
        end_job(2, comm)
    host = socket.gethostname()
    deadline_exceeded = getattr(sys.modules.get("mpsync.server._client"), "DeadlineExceeded",
                                None)
    if deadline_exceeded is not None and isinstance(exc, deadline_exceeded) \
            and not debug_enabled():
        # A fault, not a bug: its message names what was waited for and who is silent.
        text = f"{prog}: fault: {label} on {host}: {type(exc).__name__}: {exc}\n"
    else:
        text = (f"MPSYNC-RANK-FAILED {label} on {host}: unhandled {type(exc).__name__}, "
                f"aborting the job\n" + "".join(traceback.format_exception(
                    type(exc), exc, tb if tb is not None else exc.__traceback__)))
    try:
        sys.stderr.write(text)
    finally:
        end_job(1, comm)


# The exceptions that mean "the user asked for something impossible" (module, class): each
# names the setting in its message.  Looked up only in modules already imported, so that
# this list costs no import (torch, for the checkpoint's error).
USER_ERRORS = (("mpsync.config", "ConfigError"), ("mpsync.policies", "PolicyError"),
               ("mpsync.launch.target", "LaunchError"),
               ("mpsync.launch.settings", "JobTemplateError"),
               ("mpsync.transport", "TransportError"), ("mpsync.cluster.layout", "ClusterError"),
               ("mpsync.apps.checkpoint", "CheckpointError"))


def is_user_error(exc: BaseException) -> bool:
    for module, name in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return True
    return False
