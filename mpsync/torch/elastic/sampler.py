"""Horovod's ``ElasticSampler``: a distributed sampler that remembers which samples of the
epoch were processed, so that after a restart on a different number of workers the rest of
the epoch is split among the new workers and nothing is trained twice or skipped.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler

from mpsync.torch import _runtime

__all__ = ["ElasticSampler"]


class ElasticSampler(Sampler):
    """Shards ``dataset``'s unprocessed indices over the current workers.

    Call :meth:`record_batch` after each batch (or :meth:`record_indices`) and
    :meth:`set_epoch` at each epoch; keep it in a ``TorchState`` so commits carry the
    processed indices of every worker."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set = set()
        self.indices: list = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices) -> None:
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list:
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Split what is left of the epoch over the workers there are now."""
        ctx = _runtime.worker_context("ElasticSampler")
        self.num_replicas, self.rank = ctx.size, ctx.worker_rank
        self.remaining_indices = [i for i in range(len(self.dataset))
                                  if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        order = list(self.remaining_indices)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
        order += order[:self.total_size - len(order)]   # every worker the same count
        self.indices = order[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
