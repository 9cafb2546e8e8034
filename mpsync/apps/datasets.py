"""Datasets for ``mpsync train``: the embedded ``digits``, ``synthetic`` and ``npz:PATH``.

Every dataset is split once (seeded) into a training set and a held-out test set; the training
set is partitioned across workers either IID (a seeded shuffle, equal shards) or non-IID
(class-sorted shards, each worker sees few classes, as in the ESync experiments, ESync §5.1).
Shuffling within a shard is a pure function of (seed, worker, epoch), so a resumed run sees the
same batches as an uninterrupted one.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpsync.config import ConfigError

__all__ = ["Dataset", "load_dataset", "partition", "Shard", "check_dataset_spec", "DATASETS"]

DATASETS = ("digits", "synthetic", "npz:PATH")
DIGITS_PATH = Path(__file__).resolve().parent.parent / "data" / "digits.npz"


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray  # float32 [n, C, H, W] or [n, D]
    y_train: np.ndarray  # int64 [n]
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def check_dataset_spec(spec: str) -> None:
    """Reject an unknown dataset before launch (one line naming the flag)."""
    if spec in ("digits", "synthetic"):
        return
    if spec.startswith("npz:"):
        path = Path(spec[4:])
        if not path.is_file():
            raise ConfigError(f"--dataset {spec}: file {str(path)!r} not found")
        _check_npz_arrays(str(path))
        return
    raise ConfigError(f"unknown --dataset {spec!r}; choose digits, synthetic or npz:PATH")


def load_dataset(spec: str, *, seed: int = 0, test_fraction: float = 0.2,
                 synthetic_samples: int = 4096, synthetic_features: int = 32,
                 synthetic_classes: int = 10, synthetic_noise: float = 1.0) -> Dataset:
    check_dataset_spec(spec)
    if spec == "digits":
        with np.load(DIGITS_PATH) as f:
            x, y = f["x"].astype(np.float32) / 16.0, f["y"].astype(np.int64)
        x = x[:, None, :, :]  # one channel, 8x8
        name = "digits"
    elif spec == "synthetic":
        x, y = _synthetic(synthetic_samples, synthetic_features, synthetic_classes,
                          synthetic_noise, seed)
        name = "synthetic"
    else:
        x, y = _load_npz(spec[4:])
        name = spec
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test fraction must be in (0, 1), got {test_fraction}")
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = max(1, int(round(len(y) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    n_classes = int(y.max()) + 1
    return Dataset(name, x[train], y[train], x[test], y[test], n_classes)


def _synthetic(n: int, d: int, k: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters around k random centres; ``noise`` sets the difficulty (overlap)."""
    if n < 2 * k or d < 1 or k < 2 or noise <= 0:
        raise ConfigError(f"synthetic dataset: need samples >= 2*classes, features >= 1, "
                          f"classes >= 2, noise > 0 (got {n}, {d}, {k}, {noise})")
    rng = np.random.default_rng(seed + 7919)
    centres = rng.normal(0.0, 1.0, size=(k, d)).astype(np.float32)
    y = rng.integers(0, k, size=n).astype(np.int64)
    x = centres[y] + rng.normal(0.0, noise, size=(n, d)).astype(np.float32)
    return x.astype(np.float32), y


def _npz_headers(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each array's shape and dtype in the ``.npz`` file, read from the headers alone (the
    launcher checks a data file of any size in milliseconds, without loading it)."""
    try:
        with zipfile.ZipFile(path) as z:
            headers = {}
            for name in z.namelist():
                if not name.endswith(".npy"):
                    continue
                with z.open(name) as f:
                    version = np.lib.format.read_magic(f)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(f)
                headers[name[:-len(".npy")]] = (shape, dtype)
            return headers
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ConfigError(f"--dataset npz:{path}: cannot read it as a .npz file of numpy "
                          f"arrays ({e})") from None


def _check_npz_arrays(path: str) -> None:
    """What can be told of a data file before any rank starts: arrays ``x`` (samples, any
    feature shape, numbers) and ``y`` (one integer class index per sample)."""
    arrays = _npz_headers(path)
    if "x" not in arrays or "y" not in arrays:
        raise ConfigError(f"--dataset npz:{path}: needs arrays 'x' (samples) and 'y' (class "
                          f"indices), has {', '.join(map(repr, sorted(arrays))) or 'none'}")
    (x_shape, x_dtype), (y_shape, y_dtype) = arrays["x"], arrays["y"]
    if len(x_shape) < 2 or not (np.issubdtype(x_dtype, np.number)
                                and not np.issubdtype(x_dtype, np.complexfloating)):
        raise ConfigError(f"--dataset npz:{path}: x must be real numbers, one row per sample "
                          f"(samples, features...), got shape {x_shape} of {x_dtype}")
    if len(y_shape) != 1 or not np.issubdtype(y_dtype, np.integer):
        raise ConfigError(f"--dataset npz:{path}: y must be one integer class index per "
                          f"sample, got shape {y_shape} of {y_dtype}")
    if x_shape[0] != y_shape[0] or y_shape[0] < 2:
        raise ConfigError(f"--dataset npz:{path}: x has {x_shape[0]} rows, y has "
                          f"{y_shape[0]}; they must be equal, and at least 2")


def _load_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    _check_npz_arrays(path)
    try:
        with np.load(path) as f:
            x, y = np.asarray(f["x"], dtype=np.float32), np.asarray(f["y"])
    except (OSError, ValueError) as e:
        raise ConfigError(f"--dataset npz:{path}: cannot read ({e})") from None
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise ConfigError(f"--dataset npz:{path}: y must hold class indices 0..K-1")
    return x, y.astype(np.int64)


@dataclass
class Shard:
    """One worker's part of the training set and its deterministic batch order."""

    x: np.ndarray
    y: np.ndarray
    worker: int
    seed: int

    def __len__(self) -> int:
        return len(self.y)

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, self.worker, epoch)).permutation(len(self.y))

    def batches_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.y) // batch_size)

    def batch(self, epoch: int, index: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``index`` of ``epoch`` (drop-last: every batch has ``batch_size`` rows)."""
        idx = self.order(epoch)[index * batch_size:(index + 1) * batch_size]
        return self.x[idx], self.y[idx]


def partition(ds: Dataset, workers: int, worker: int, how: str = "iid", seed: int = 0) -> Shard:
    """Worker ``worker``'s shard of the training set.

    ``iid``: a seeded shuffle cut into equal parts.  ``noniid``: samples sorted by class, cut
    into 2*workers shards, each worker gets two (ESync §5.1 / McMahan et al.'s pathological
    non-IID split): a worker sees about 2 of the classes.
    """
    if how not in ("iid", "noniid"):
        raise ConfigError(f"unknown --partition {how!r}; choose iid or noniid")
    n = len(ds.y_train)
    if n < workers:
        raise ConfigError(f"dataset has {n} training samples for {workers} workers")
    rng = np.random.default_rng(seed + 104729)
    if how == "iid":
        parts = np.array_split(rng.permutation(n), workers)
        mine = parts[worker]
    else:
        by_class = np.argsort(ds.y_train, kind="stable")
        shards = np.array_split(by_class, 2 * workers)
        pick = rng.permutation(2 * workers)
        mine = np.concatenate([shards[pick[2 * worker]], shards[pick[2 * worker + 1]]])
    return Shard(ds.x_train[mine], ds.y_train[mine], worker, seed)
