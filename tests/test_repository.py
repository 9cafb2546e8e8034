"""The repository stands alone: nothing in it points at a file outside it (notes kept beside
the checkout are not there for a reader of a clone), so a comment says the fact itself."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Built from parts so that this file does not name what it looks for.
_SHARED = "shar" + "ed"
OUTSIDE = re.compile("|".join([r"\b(STYLE|FACTS|DESIGN)" + r"\.md\b", r"\.\./" + _SHARED,
                               "/work/" + _SHARED, r"\b" + _SHARED + "/(?!lib)"]))


def references_outside(paths: list[Path], root: Path = REPO) -> list[str]:
    found = []
    for path in paths:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(root)}:{i}: {line.strip()[:120]}")
    return found


def test_no_file_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    assert references_outside([REPO / p for p in tracked if (REPO / p).is_file()]) == []


def test_every_test_file_is_under_500_lines():
    """One concern a file: a test file is split by concern before it grows past 500 lines."""
    tracked = subprocess.run(["git", "ls-files", "tests/*.py"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    long = {p: n for p in tracked if (REPO / p).is_file()
            and (n := len((REPO / p).read_text().splitlines())) > 500}
    assert long == {}, f"files over 500 lines: {long}"


def test_the_check_finds_a_reference(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("ok\n# see " + "FACTS" + ".md for the numbers\n# ../" + _SHARED + "/x\n")
    assert [r.split(":")[1] for r in references_outside([probe], tmp_path)] == ["2", "3"]
