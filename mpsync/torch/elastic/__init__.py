"""``hvd.elastic``: Horovod's elastic API (``run``, ``TorchState``, ``ObjectState``,
``ElasticSampler``), for Open MPI, where elasticity is a restart.

Horovod's elastic mode (Gloo) keeps the surviving processes and re-forms the ring around them.
Open MPI 4.1 has no fault tolerance (no ULFM): a lost rank ends ``mpirun`` and every rank with
it.  So here the surviving *state* is what continues: each ``state.commit()`` is written, in
the background and from the copy ``save()`` already made, to the job's commit directory, and
mpsync's elastic launcher (``mpsync run --max-restarts N --min-np/--max-np
--host-discovery-script``) starts the job again on the hosts that remain, where :func:`run`
resumes from the newest commit complete on every rank.

A script written for Horovod's elastic mode runs unchanged apart from its import::

    import mpsync.torch as hvd
    hvd.init()
    ...
    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...; optimizer.step()
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: rescale_lr(hvd.size())])
    train(state)

What happens on each event:

* a worker dies or stops (SIGKILL, a lost node, a stall past ``deadline``): the job ends; the
  launcher restarts it on the remaining hosts; ``run`` loads the newest complete commit on
  worker 0, syncs it to every worker and calls the reset callbacks (the worker count changed);
* the discovery script reports new hosts: the next ``commit()`` raises
  :class:`HostsUpdatedInterrupt` on every worker at once; ``run`` flushes that commit and ends
  the job with :data:`RESTART_EXIT_CODE`, and the launcher restarts it with the new hosts;
* a collective fails without losing a worker (:class:`HorovodInternalError`, no data moved):
  as in Horovod, the state is restored from the last commit in memory and ``func`` runs again.

Without ``MPSYNC_ELASTIC_DIR`` (no elastic launcher) commits stay in memory, as in Horovod.
A commit on disk holds only data (:data:`mpsync.commits.DATA_TYPES`; an attribute of another
class is refused by ``commit()``) and is loaded without running anything in it: a commit that
is corrupt or would run code is refused with one line naming its file, and the job ends with
the status the launcher does not restart.  (The objects workers send each other in one job,
``broadcast_object`` and ``allgather_object``, stay pickles, as in Horovod.)
"""

from __future__ import annotations

import functools
import os
import sys

from mpsync.commits import ENV_COMMIT_DIR, ENV_HOSTS_FILE, ENV_HOSTS_VERSION, \
    HOSTS_CHANGED, RESTART_EXIT_CODE, USER_ERROR_EXIT_CODE, CommitStore, SealedFileError, \
    load_committed, newest_complete
from mpsync.torch import _runtime
from mpsync.torch.dataplane.waiting import CollectiveTimeout
from mpsync.torch.broadcast import broadcast_object
from mpsync.torch.elastic.sampler import ElasticSampler
from mpsync.torch.elastic.state import ObjectState, State, TorchState
from mpsync.torch.dataplane.exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HostsUpdatedInterrupt", "HorovodInternalError", "RESTART_EXIT_CODE",
           "ENV_COMMIT_DIR", "ENV_HOSTS_FILE", "ENV_HOSTS_VERSION"]


def run(func):
    """Decorate the training function ``func(state, ...)`` (Horovod's ``hvd.elastic.run``)."""
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        resumed = _attach_commits(state)
        finished = False   # a failing job does not wait for its last commit's manifest
        try:
            while True:
                state.sync()
                if resumed:
                    state.save()        # every worker's in-memory commit is the synced one
                    state.on_reset()
                    resumed = False
                try:
                    result = func(state, *args, **kwargs)
                    finished = True
                    return result
                except CollectiveTimeout:
                    raise   # a worker is gone: the job ends and is restarted from disk
                except HorovodInternalError:
                    state.restore()
                    resumed = True
                except HostsUpdatedInterrupt:
                    finished = True
                    _close_commits(state, wait=True)
                    if _runtime.worker_context("hvd.elastic.run").worker_rank == 0:
                        print(f"{HOSTS_CHANGED}: ending this job to start again on them",
                              file=sys.stderr, flush=True)
                    raise SystemExit(RESTART_EXIT_CODE) from None
        finally:
            _close_commits(state, wait=finished)
    return wrapper


def _attach_commits(state: State) -> bool:
    """Open the job's commit store (collective); on worker 0, load the newest complete commit
    into ``state``.  True on every worker when the job resumed from one."""
    root = os.environ.get(ENV_COMMIT_DIR)
    if not root:
        return False
    ctx = _runtime.worker_context("hvd.elastic.run")
    found = None
    if ctx.worker_rank == 0:
        manifest = newest_complete(root)
        if manifest is not None:
            try:
                saved = load_committed(manifest, 0)
            except SealedFileError as e:
                # Corrupt, or more than data: refused, naming the file.  Every worker hears
                # of it and the job ends with the user-error status, which the launcher does
                # not restart (the next job would find the same commit).
                found = str(e)
            else:
                state.load_saved_copy(saved)
                state.restore()
                found = (manifest.seq, manifest.size)
                print(f"mpsync elastic: resuming from commit {manifest.seq} (written by "
                      f"{manifest.size} workers) on {ctx.size} workers", file=sys.stderr,
                      flush=True)
    found = broadcast_object(found)
    if isinstance(found, str):
        if ctx.worker_rank == 0:
            print(f"mpsync elastic: error: {found}", file=sys.stderr, flush=True)
            raise SystemExit(USER_ERROR_EXIT_CODE)
        # Quietly: Open MPI ends the job at the first non-zero exit and may drop worker 0's
        # line still in flight; worker 0's status is the job's.
        raise SystemExit(0)
    state._seq = found[0] + 1 if found else 0
    state._store = CommitStore(root, ctx.workers)
    return found is not None


def _close_commits(state: State, wait: bool) -> None:
    store, state._store = state._store, None
    if store is not None:
        store.close(timeout=store.report_timeout if wait else 0.0)
