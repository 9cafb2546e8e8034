"""Regenerate ``mpsync/data/digits.npz`` from scikit-learn's ``load_digits`` (run once; the file
ships inside the wheel so ``mpsync train`` works offline and without scikit-learn's data cache).

    python -m mpsync.apps.make_digits
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

__all__ = ["DIGITS_PATH", "write_digits"]

DIGITS_PATH = Path(__file__).resolve().parent.parent / "data" / "digits.npz"


def write_digits(path: Path = DIGITS_PATH) -> Path:
    from sklearn.datasets import load_digits

    d = load_digits()
    # 8x8 images with values 0..16; uint8 keeps the file at ~120 kB.
    np.savez_compressed(path, x=d.images.astype(np.uint8), y=d.target.astype(np.int64))
    return path


if __name__ == "__main__":
    print(write_digits(Path(sys.argv[1]) if len(sys.argv) > 1 else DIGITS_PATH))
