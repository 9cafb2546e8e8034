"""Every command block of the README runs as written, so that none goes stale.

Each fenced ```bash / ```sh block is one test: its commands run in one bash (``set -e``, each
command echoed) with the repository's Python environment first on PATH and the checkout on
PYTHONPATH, as after the quick start's ``export PATH=...``, under a hard timeout (per command of
the block) that kills the whole process group.  The block fails, named by its README line, with
its output, on a non-zero exit, a timeout, a traceback printed by a command that still exited 0,
or a run that did not print what it prints when it trains (``PRINTS``).

Excepted: ``make setup``, ``make demo`` and ``make test`` (CI and the quick start run them), and
blocks whose fence says ``skip-test`` (they need a scheduler that is not here; the README says
so in the paragraph above each).  Blocks run from a scratch directory that links the
repository's files, so what they write (``runs/``, rendered job scripts) never lands in the
checkout.  The Python block of "Using it from your own script" is an excerpt of
examples/train_digits.py, which the commands run; a test keeps the two equal.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpsync import cluster
from mpsync.launch import run_with_deadline

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
EXAMPLE = REPO / "examples" / "train_digits.py"
MAX_LINES = 300
# Seconds per command of a block (a block's limit is this times its commands): room for a
# machine that other jobs load (a 5 s run took 126 s at a load average of 40 on 2 cores); each
# command takes 5-40 s on a quiet one.
COMMAND_TIMEOUT = 600.0
EXCEPTED = {("make", "setup"), ("make", "demo"), ("make", "test")}
SKIP_FLAG = "skip-test"
# Entries of the checkout that are not linked into the scratch directory: its environment is
# linked as .venv from the running interpreter, and outputs must not reach the checkout.
NOT_LINKED = {".git", ".venv", "runs", "build", ".pytest_cache", ".hypothesis"}
# What a block must print when it runs a command containing the key: training that exits 0
# without its summary has not trained.
PRINTS = {"mpsync train ": "mpsync train: policy=", "train_digits.py": "test accuracy",
          "train_digits_elastic.py": "elastic, ", "jobs/horovodrun/train.sh": "mpsync: job "}
# What every training run of the README must end above: the digits' 10 classes put chance at
# 0.1, and a run of the README that learns ends near 0.98.
MIN_FINAL_ACCURACY = 0.5


@dataclass(frozen=True)
class Block:
    line: int  # the README line of the opening fence
    lang: str
    flags: tuple[str, ...]
    text: str
    before: str  # the paragraph above the fence

    @property
    def name(self) -> str:
        first = next((c for c in commands(self.text)), "(empty)")
        return f"README.md:{self.line} {first[:60]}"


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, with its info string split into language and
    flags."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^\s*```(\S*)\s*(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        above = "\n".join(lines[max(0, start - 4):start])
        blocks.append(Block(start + 1, opening.group(1), tuple(opening.group(2).split()),
                            "\n".join(body), above))
        i += 1
    return blocks


def commands(text: str) -> list[str]:
    """The logical command lines of a shell block: continuations joined, blank lines and
    comment-only lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]


def excepted(command: str) -> bool:
    words = shlex.split(command, comments=True)
    return tuple(words[:2]) in EXCEPTED


def shell_blocks() -> list[Block]:
    return [b for b in fenced_blocks(README.read_text()) if b.lang in ("bash", "sh")]


def runnable_blocks() -> list[Block]:
    return [b for b in shell_blocks()
            if SKIP_FLAG not in b.flags and any(not excepted(c) for c in commands(b.text))]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A directory that looks like the checkout (its files linked) with the running
    interpreter's environment as .venv."""
    root = tmp_path_factory.mktemp("readme")
    for entry in REPO.iterdir():
        if entry.name not in NOT_LINKED and not entry.name.startswith("mpsync-train-"):
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(Path(sys.prefix))
    return root


def block_env(cluster_name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPSYNC_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(REPO)
    env["MPSYNC_CLUSTER"] = cluster_name  # several suites may run at once on one host
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: f"line{b.line}")
def test_readme_block_runs(block: Block, scratch: Path):
    script = "\n".join(c for c in commands(block.text) if not excepted(c))
    needs_cluster = "mpsync cluster up" in script
    if needs_cluster:
        ok, why = cluster.available()
        if not ok:
            pytest.skip(f"network namespaces unavailable: {why}")
    env = block_env(f"rd{os.getpid() % 100000}")
    limit = COMMAND_TIMEOUT * len(script.splitlines())
    try:
        res = run_with_deadline(["bash", "-c", "set -exo pipefail\n" + script], limit,
                                env=env, cwd=str(scratch))
    finally:
        if needs_cluster:  # a block that failed half-way must not leave its nodes behind
            subprocess.run(["mpsync", "cluster", "down"], env=env, cwd=str(scratch),
                           capture_output=True, timeout=120)
    output = res.stdout + res.stderr
    unprinted = [want for key, want in PRINTS.items() if key in script and want not in output]
    # A run that exits 0 and prints its summary may still not have learned (the PS example at
    # a learning rate its shards' optimizer cannot take fell to chance, 0.09, and passed).
    unlearned = [a for a in re.findall(r"final accuracy ([0-9.]+)", output)
                 if float(a) < MIN_FINAL_ACCURACY]
    why = (f"timed out after {limit:.0f} s" if res.timed_out
           else f"exited {res.returncode}" if res.returncode != 0
           else "printed a traceback" if "Traceback (most recent call last)" in output
           else f"did not print {unprinted}" if unprinted
           else f"ended at final accuracy {unlearned} (below {MIN_FINAL_ACCURACY})"
           if unlearned else "")
    assert not why, f"{block.name} {why}:\n{output[-6000:]}"


def test_blocks_are_found_and_the_excepted_ones_are_only_make_and_marked():
    """The parser sees the quick start's make lines as excepted and everything else as run;
    a block left out with skip-test says so in the paragraph above it."""
    blocks = shell_blocks()
    assert len(runnable_blocks()) >= 5, [b.name for b in blocks]
    made = {tuple(shlex.split(c)[:2]) for b in blocks for c in commands(b.text) if excepted(c)}
    assert made == EXCEPTED
    skipped = [b for b in blocks if SKIP_FLAG in b.flags]
    assert len(skipped) <= 1, [b.name for b in skipped]
    for b in skipped:
        assert "not run by the tests" in b.before, f"{b.name}: say why above the block"


def test_the_parser_on_a_sample():
    sample = ("text\n```bash\nmake demo\nmpirun -np 2 \\\n    echo a   # two ranks\n\n# c\n```\n"
              "```bash skip-test\nsbatch x\n```\n```python\nx = 1\n```\n")
    blocks = fenced_blocks(sample)
    assert [(b.lang, b.flags) for b in blocks] == [("bash", ()), ("bash", ("skip-test",)),
                                                    ("python", ())]
    assert commands(blocks[0].text) == ["make demo", "mpirun -np 2 echo a   # two ranks"]
    assert [excepted(c) for c in commands(blocks[0].text)] == [True, False]


def test_readme_is_a_guide_of_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_the_readme_script_is_an_excerpt_of_the_example():
    """Every line of the README's Python block is in examples/train_digits.py, in order
    (``...`` marks what the README leaves out)."""
    python = [b for b in fenced_blocks(README.read_text()) if b.lang == "python"]
    assert python, "the README shows no Python script"
    example = EXAMPLE.read_text().splitlines()
    at = 0
    for line in python[0].text.splitlines():
        if not line.strip() or line.strip() == "...":
            continue
        while at < len(example) and example[at] != line:
            at += 1
        assert at < len(example), f"not in {EXAMPLE.name} (or out of order): {line!r}"


def test_every_relative_link_of_the_docs_points_at_a_file():
    pages = [README, *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("bench/*/README.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.relative_to(REPO)}: {target}")
    assert missing == []
