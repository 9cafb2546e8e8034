"""The Layout table of docs/layout.md is written from the package itself: one row per part of
mpsync, in the layer order that tests/test_layers.py enforces, each with its docstring's first
paragraph and the names of its modules.

    python tests/test_docs_layout.py      # prints the table to paste into docs/layout.md
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_layers import LAYERS, PACKAGE, REPO  # noqa: E402


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return re.sub(r"``(.+?)``", r"`\1`", first).replace(":mod:", "").replace("|", "\\|")


def layout_table() -> str:
    """Markdown: the parts of mpsync from the top layer down."""
    rows = ["| layer | path | what |", "|---|---|---|"]
    for layer in range(len(LAYERS) - 1, -1, -1):
        for part in LAYERS[layer]:
            if part == "mpsync":
                continue
            folder = PACKAGE / part
            if folder.is_dir():
                modules = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
                what = _summary(folder / "__init__.py")
                what += " Modules: " + ", ".join(f"`{m}`" for m in modules) + "."
                rooms = sorted(d.name for d in folder.iterdir() if (d / "__init__.py").is_file())
                if rooms:
                    what += " Folders: " + ", ".join(f"`{d}/`" for d in rooms) + "."
                path = f"mpsync/{part}/"
            else:
                what, path = _summary(folder.with_suffix(".py")), f"mpsync/{part}.py"
            rows.append(f"| {layer} | `{path}` | {what} |")
    return "\n".join(rows)


def test_docs_layout_is_the_package():
    page = (REPO / "docs" / "layout.md").read_text()
    table = layout_table()
    assert table in page, ("docs/layout.md's table differs from the package; paste the "
                           "output of `python tests/test_docs_layout.py`:\n" + table)


def test_every_part_and_module_is_in_the_table():
    table = layout_table()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py" or len(rel.parts) > 2:
            continue
        name = f"`mpsync/{rel}`" if len(rel.parts) == 1 else f"`{rel.name}`"
        assert name in table, f"{rel} is missing from the Layout table"


if __name__ == "__main__":
    print(layout_table())
