"""The package's imports point down its layers: no cycle between modules, no import of a part
that stands above the importer.

Every ``import`` is read from the source, wherever it stands: at the top of a module, inside a
function, under ``if TYPE_CHECKING:`` or in a ``try``.  An import placed inside a function to
defer a heavy or optional module is fine; one that hides a cycle or an upward dependency is
what this test exists to catch.  Modules named by strings (the registry's ``"module:Class"``
references, the CLI's subcommand table) are plug-in points and are not imports.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "mpsync"

# The parts of mpsync from the ground up.  A module may import a part of a lower layer, and
# modules of its own part; never a part of its own layer or of a higher one.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("mpsync", "zipline_variants", "policies"),   # the version; names; the policy registry
    ("config", "transport", "commits"),            # SyncConfig, MPSYNC_*; Open MPI settings;
                                                   # durable commits
    ("slowdown", "sched", "job_end"),              # slowdown parsing; the decision kernels;
                                                   # how an error on a rank ends the job
    ("server",),                                   # the state server and its rules
    ("torch", "simulate", "cluster"),              # workers; the simulator; the virtual cluster
    ("launch", "auto"),                            # launch targets, job scripts; auto policy
    ("doctor", "bench"),                           # installation check; benchmarks
    ("apps",),                                     # train, compare, simulate, reports
    ("cli",),                                      # the `mpsync` command
)


def part_of(module: str) -> str:
    """``mpsync.server.rules`` -> ``server``; the package itself is ``mpsync``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mpsync"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The mpsync modules that ``module`` imports, anywhere in its source.

    ``from X import name`` counts as importing ``X.name`` when that is a module, else ``X``.
    A module's own enclosing packages are left out: Python runs them before the module in any
    case, and an edge to them would make every package with re-exports a cycle.
    """
    def nearest(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(nearest(a.name) for a in node.names if a.name.startswith("mpsync"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            if not base.startswith("mpsync"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else nearest(base))
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    return {m for m in found if m and m != module and m not in ancestors}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def layer_of() -> dict[str, int]:
    return {part: i for i, parts in enumerate(LAYERS) for part in parts}


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a part of the importer's own layer or a higher one (its own part excepted)."""
    layer = layer_of()
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            pa, pb = part_of(a), part_of(b)
            if pa != pb and layer.get(pb, -1) >= layer.get(pa, -1):
                bad.append(f"{a} (layer {layer.get(pa, '?')}, {pa}) imports {b} "
                           f"(layer {layer.get(pb, '?')}, {pb})")
    return bad


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(m) for m in modules()}
    layer = layer_of()
    assert sorted(parts - set(layer)) == [], "add the new part to LAYERS"
    assert sorted(set(layer) - parts) == [], "LAYERS names a part that no longer exists"
    assert len(layer) == sum(len(p) for p in LAYERS), "a part stands in two layers"


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "modules that import each other:\n" + "\n".join(map(" -> ".join, found))


def test_every_import_points_down_the_layers():
    found = upward_edges(import_graph())
    assert found == [], "imports that run up or across the layers:\n" + "\n".join(found)


# -- the checks themselves -----------------------------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "mpsync"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_hidden_inside_a_function_is_found(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "jobs.py": "from mpsync._text import PROLOGUE\n",
        "_text.py": "def f():\n    from mpsync.jobs import JobSettings\n",
    })
    assert cycles(import_graph(root)) == [["mpsync._text", "mpsync.jobs"]]


def test_a_type_checking_import_and_a_relative_import_count(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "apps/__init__.py": "",
        "apps/compare.py": "from . import repeats\n",
        "apps/repeats.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from .compare import launch_argv\n",
    })
    assert cycles(import_graph(root)) == [["mpsync.apps.compare", "mpsync.apps.repeats"]]


def test_an_import_of_a_higher_layer_is_reported(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "cluster/__init__.py": "",
        "cluster/launching.py": "def run():\n    from mpsync.apps.train import validate\n",
        "apps/__init__.py": "",
        "apps/train.py": "",
    })
    found = upward_edges(import_graph(root))
    assert len(found) == 1 and found[0].startswith("mpsync.cluster.launching (layer 4")


def test_a_package_importing_its_own_modules_is_no_cycle(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "server/__init__.py": "from mpsync.server.wire import TAG\n",
        "server/wire.py": "TAG = 1\n",
        "server/rules.py": "from mpsync.server import wire\n",
    })
    graph = import_graph(root)
    assert graph["mpsync.server.rules"] == {"mpsync.server.wire"}
    assert cycles(graph) == []


@pytest.mark.parametrize("module, part", [("mpsync", "mpsync"), ("mpsync.cli", "cli"),
                                          ("mpsync.server._loop", "server")])
def test_part_of(module, part):
    assert part_of(module) == part


# -- inside mpsync.torch: Horovod's face over the strategies over the data plane -----------------
TORCH_ROOMS: tuple[str, ...] = ("dataplane", "strategies")
"""The rooms of ``mpsync.torch`` from the ground up; every other module of the part is the face
(Horovod's API), which stands above both."""


def torch_room_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in TORCH_ROOMS:
        return TORCH_ROOMS.index(parts[2])
    return len(TORCH_ROOMS)


def upward_torch_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside ``mpsync.torch`` that reach a room above the importer's."""
    bad = []
    for a, targets in sorted(graph.items()):
        if part_of(a) != "torch":
            continue
        for b in sorted(targets):
            if part_of(b) == "torch" and torch_room_of(b) > torch_room_of(a):
                bad.append(f"{a} imports {b}")
    return bad


def test_the_data_plane_and_the_strategies_never_import_the_face():
    found = upward_torch_edges(import_graph())
    assert found == [], "imports from a lower room of mpsync.torch to a higher one:\n" + "\n".join(found)


def test_an_import_of_the_face_from_the_data_plane_is_reported(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "torch/__init__.py": "",
        "torch/optimizer.py": "from mpsync.torch.strategies.base import Strategy\n",
        "torch/strategies/__init__.py": "",
        "torch/strategies/base.py": "from mpsync.torch.dataplane.fusion import FusionBuffer\n",
        "torch/dataplane/__init__.py": "",
        "torch/dataplane/fusion.py": "def f():\n    from mpsync.torch.optimizer import step\n",
    })
    assert upward_torch_edges(import_graph(root)) == [
        "mpsync.torch.dataplane.fusion imports mpsync.torch.optimizer"]
