"""The state server as a thread of a training rank (``server='colocated'``)."""

from __future__ import annotations

import threading

from mpi4py import MPI

from mpsync.config import ConfigError
from mpsync.server._loop import StateServer

__all__ = ["ColocatedServer", "start_colocated"]


class ColocatedServer:
    """The server as a thread on a training rank; ``join()`` returns its stats."""

    def __init__(self, server: StateServer):
        self.server = server
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mpsync-state-server", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.result = self.server.serve()
        except BaseException as e:  # surface it in join(); the job cannot go on without it
            self.error = e
            self.server.log(f"mpsync server: the co-located server failed: {e!r}; aborting")
            self.server.comm.Abort(3)

    def join(self, timeout: float | None = None) -> dict:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError("the co-located state server did not finish")
        if self.error is not None:
            raise self.error
        return self.result


def start_colocated(comm, config, *, server_rank: int = 0, workers=None, log=None):
    """Start the state server as a thread of this rank (``server='colocated'``).  Needs
    MPI_THREAD_MULTIPLE: the trainer and the server call MPI at the same time."""
    if workers is None:
        workers = list(range(comm.Get_size()))  # co-located: every rank trains
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ConfigError("server='colocated' needs MPI_THREAD_MULTIPLE, but MPI was initialised "
                          f"with thread level {MPI.Query_thread()}; use server='dedicated' or "
                          "initialise MPI with MPI_THREAD_MULTIPLE")
    return ColocatedServer(StateServer(comm, config, server_rank=server_rank, workers=workers,
                                       log=log))
