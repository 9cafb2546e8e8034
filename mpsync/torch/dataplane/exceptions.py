"""The exception types a Horovod script catches, with ``horovod.common.exceptions``' names and
bases, so ``except hvd.HorovodInternalError`` (or ``except RuntimeError``) means the same here.

A collective that cannot run as asked (tensors whose shapes, dtypes, reduce ops or roots
differ between workers; a broadcast whose root has joined) raises
:class:`HorovodInternalError` on every worker taking part, with the same message, and no data
has moved: the next collective runs normally.  A deadline that passes while waiting
(:class:`mpsync.torch.CollectiveTimeout`) is one too.
"""

from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError"]


class HorovodInternalError(RuntimeError):
    """A collective failed; every worker that took part raises it with the same message."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic-mode interrupt (the set of hosts changed): raised by
    ``state.commit()`` / ``state.check_host_updates()`` on every worker at once when the
    elastic launcher's discovery script found new hosts (see :mod:`mpsync.torch.elastic`)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__(f"hosts updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """Horovod's error for a framework version other than the one it was built against."""

    def __init__(self, name: str, version: str, installed_version: str):
        super().__init__(f"framework {name} installed with version {installed_version} but "
                         f"found version {version}")
        self.name, self.version, self.installed_version = name, version, installed_version
