"""Which device a worker of ``mpsync train`` trains on: ``--device auto|cpu|cuda``.

One GPU per worker, as Horovod and DDP scripts do (``torch.cuda.set_device(local_rank)``):
worker ``i`` of a node takes that node's GPU ``i``.  The local rank counts *workers* only
(``mps.local_rank()``: the dedicated state-server rank is no worker and takes no GPU), so
``mpsync train --np 8`` on a node of 8 GPUs starts 8 workers and the server, and uses all 8.

More workers on a node than it has GPUs: with ``--device cuda`` (one each was asked for) it
is refused in one line; with ``auto`` the workers share the GPUs round robin (worker ``i``
on GPU ``i mod G``), which still trains and is what a laptop with one GPU wants, and local
worker 0 says so in one line.  Without CUDA, ``auto`` is the CPU and ``cuda`` is refused.
"""

from __future__ import annotations

from mpsync.config import ConfigError

__all__ = ["DEVICES", "check_device_flag", "choose_device", "check_device_before_launch"]

DEVICES = ("auto", "cpu", "cuda")


def check_device_flag(device: str) -> None:
    if device not in DEVICES:
        raise ConfigError(f"unknown --device {device!r}; choose from {', '.join(DEVICES)}")


def choose_device(requested: str, local_rank: int, local_size: int,
                  gpus: int) -> tuple[str, str | None]:
    """The device of the ``local_rank``-th of ``local_size`` workers on a node with ``gpus``
    GPUs, and a note to print once per node (or None); ConfigError where ``requested``
    cannot be had."""
    check_device_flag(requested)
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return "cpu", None
    if gpus == 0:
        raise ConfigError("--device cuda: this node has no CUDA GPU (torch.cuda.is_available() "
                          "is False); use --device cpu or --device auto")
    if local_size > gpus:
        if requested == "cuda":
            raise ConfigError(f"--device cuda: {local_size} workers on this node and only "
                              f"{gpus} GPU{'s' * (gpus != 1)}, one each was asked for; start "
                              f"at most {gpus} workers per node, or --device auto to share "
                              f"the GPUs")
        return (f"cuda:{local_rank % gpus}",
                f"--device auto: {local_size} workers share this node's {gpus} "
                f"GPU{'s' * (gpus != 1)} (worker i on GPU i mod {gpus})")
    return f"cuda:{local_rank}", None


def check_device_before_launch(requested: str, workers_here: int | None) -> None:
    """Before ``mpirun`` starts: ``--device cuda`` where this host has no GPU, or fewer than
    the ``workers_here`` workers it will run (None: the workers go to other hosts, which
    check for themselves).  Imports torch only for ``--device cuda``."""
    check_device_flag(requested)
    if requested != "cuda":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 or workers_here is not None:
        choose_device(requested, 0, workers_here or 1, gpus)
