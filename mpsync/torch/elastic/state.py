"""Horovod's elastic state objects (``horovod.common.elastic`` and ``horovod.torch.elastic``),
with commits that outlive the job.

Semantics kept from Horovod 0.28.1: ``save()`` copies the tracked values into memory,
``restore()`` puts the last saved copy back, ``sync()`` makes every worker hold worker 0's
state (parameters, optimizer state, other attributes), ``commit()`` is ``save()`` followed by
``check_host_updates()``, which is collective (every worker raises
:class:`HostsUpdatedInterrupt` at the same commit, or none does).

What mpsync adds: when the job runs with a commit directory (``MPSYNC_ELASTIC_DIR``, set by
mpsync's elastic launcher), each commit's saved copy is also written there in the background
(:class:`mpsync.commits.CommitStore`), so the state survives the job itself -- with Open
MPI a lost rank ends every rank, and a restarted job starts from the newest commit that is
complete on every rank (:func:`mpsync.torch.elastic.run` loads it).
"""

from __future__ import annotations

import copy
import json
import os

import torch

from mpsync.commits import ENV_HOSTS_FILE, ENV_HOSTS_VERSION
from mpsync.torch import _runtime
from mpsync.torch.broadcast import broadcast_object, broadcast_optimizer_state, \
    broadcast_parameters
from mpsync.torch.elastic.sampler import ElasticSampler
from mpsync.torch.dataplane.exceptions import HostsUpdatedInterrupt
from mpsync.torch.mpi_ops import allgather_object

__all__ = ["State", "ObjectState", "TorchState"]



def _worker_rank() -> int:
    return _runtime.worker_context("elastic state").worker_rank


def hosts_version() -> int:
    """The launcher's current hosts version (0 without a launcher)."""
    path = os.environ.get(ENV_HOSTS_FILE)
    if not path:
        return 0
    try:
        with open(path) as f:
            return int(json.load(f)["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # being rewritten or gone: no news is no update


class State:
    """Tracked state of a training process (Horovod's ``State``); subclasses say what
    ``save``, ``restore`` and ``sync`` do."""

    def __init__(self, bcast_object=broadcast_object, get_rank=_worker_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list = []
        self._last_updated = int(os.environ.get(ENV_HOSTS_VERSION, "0") or 0)
        self._notified = 0   # a version handed to on_hosts_updated
        self._store = None   # a CommitStore while elastic.run runs with a commit directory
        self._seq = 0        # the next commit's number (continues across restarts)

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called after the set of workers changed (here: after a restart that
        resumed from a commit), e.g. to rescale the learning rate to the new ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res=None) -> None:
        """A host update notice (Horovod's listener call); the next check raises."""
        self._notified = max(self._notified, int(timestamp))

    def commit(self) -> None:
        """Save the state in memory, write that copy to the commit directory in the background
        (if the job has one), then check for host updates.  Commit less often than every batch
        when the model is large: ``save()`` copies every tracked tensor."""
        self.save()
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every worker at once when the launcher's
        discovery script reported a change since this job started (collective)."""
        prev = self._last_updated
        seen = max(hosts_version(), self._notified) if self._rank() == 0 else prev
        prev, newest = self._bcast_object((prev, max(prev, seen)))
        self._last_updated = newest
        if newest > prev:
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    # -- durable commits (mpsync) --------------------------------------------------------------
    def saved_copy(self) -> dict:
        """The last saved state, as one dict of data (what a durable commit holds: tensors,
        numbers, strings, numpy arrays and containers of them; see
        :func:`mpsync.commits.check_data`)."""
        raise NotImplementedError

    def load_saved_copy(self, saved: dict) -> None:
        """Make ``saved`` (a :meth:`saved_copy` of an earlier job) the last saved state."""
        raise NotImplementedError

    def _persist(self) -> None:
        if self._store is None:
            return
        self._store.commit(self._seq, self.saved_copy(), info={"seq": self._seq})
        self._seq += 1


class ObjectState(State):
    """Plain Python attributes, given as keyword arguments (Horovod's ``ObjectState``).  With a
    commit directory they must be data (numbers, strings, tensors, numpy arrays, containers of
    them): a commit on disk is loaded without running anything in it."""

    def __init__(self, bcast_object=broadcast_object, get_rank=_worker_rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def saved_copy(self) -> dict:
        # Attributes may be mutable objects the script keeps changing while the copy is
        # written in the background.
        return {"objects": copy.deepcopy(self._saved_state)}

    def load_saved_copy(self, saved: dict) -> None:
        self._saved_state = {**self._saved_state, **saved["objects"]}

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class _Handler:
    """Save / restore / sync of one tracked object of a known kind."""

    def __init__(self, value):
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self) -> None:
        # Every worker's processed samples, so a restart on other workers skips all of them.
        state = copy.deepcopy(self.value.state_dict())
        state["processed_indices"] = set().union(*allgather_object(self.value.processed_indices))
        self.saved = state


def _handler_for(value):
    kinds = ((torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
             (torch.optim.lr_scheduler.LRScheduler, _Handler), (ElasticSampler, _SamplerHandler))
    for kind, handler in kinds:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """A PyTorch training process's state (Horovod's ``TorchState``): models, optimizers,
    LR schedulers and :class:`ElasticSampler` s by keyword, plus plain attributes."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, rest = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is not None:
                handlers[name] = handler
            else:
                rest[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**rest)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def saved_copy(self) -> dict:
        # The handlers' saved state dicts are fresh deep copies made by save(), never changed
        # afterwards (the next save makes new ones), so the writer may read them as they are.
        return {**super().saved_copy(),
                "handlers": {name: h.saved for name, h in self._handlers.items()}}

    def load_saved_copy(self, saved: dict) -> None:
        super().load_saved_copy(saved)
        for name, state in saved.get("handlers", {}).items():
            if name in self._handlers:
                self._handlers[name].saved = state

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
