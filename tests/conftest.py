"""Shared pytest setup: the tests directory and the repository are importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
for p in (str(TESTS_DIR), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

# Single-process tests share the 2 cores with multi-rank ones: one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
