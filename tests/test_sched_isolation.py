"""mpsync.sched from the outside, each in a fresh interpreter: un-jitted mode gives the same
results, the package stays free of mpi4py/torch, and the ZipLine benchmark's JSON mode works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mpsync.sched import EXACT_VARIANTS, ZIPLINE_VARIANTS

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# The sched test modules whose kernel comparisons are repeated un-jitted. This module is not one
# of them: it would start itself again.
SCHED_TEST_FILES = ("test_sched_zipline.py", "test_sched_policies.py", "test_sched_references.py",
                    "test_sched_policy_references.py")
# Interpreted, the large-input agreement tests take minutes (n*R up to 60,000 with O(Rn^2)
# variants); the same comparisons run un-jitted on the small seeded and hypothesis inputs.
UNJITTED_DESELECT = "not agree_on"


def fresh_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def test_sched_tests_pass_without_jit(tmp_path):
    """NUMBA_DISABLE_JIT=1 turns every kernel into the Python function it is written as (the
    debugging mode the package promises); the results must not change. Among others this runs
    the uint64 index arithmetic of merge_pushes and scan_optbs on numpy scalars instead of machine ints."""
    report = tmp_path / "unjitted.xml"
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        # A uint64 index that wraps around un-jitted shows up as numpy's overflow RuntimeWarning.
        "-W", "error::RuntimeWarning",
        "-k", UNJITTED_DESELECT, f"--junitxml={report}",
        *(str(TESTS / f) for f in SCHED_TEST_FILES),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=fresh_env(NUMBA_DISABLE_JIT="1"), capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    cases = ET.parse(report).getroot().iter("testcase")
    outcome = {c.get("name"): [child.tag for child in c] for c in cases}
    # test_jit_state_matches_environment fails unless the kernels really ran un-jitted.
    assert outcome.get("test_jit_state_matches_environment") == []
    ran = [name for name, tags in outcome.items() if "skipped" not in tags]
    assert any(name.startswith("test_merge_builds_omega") for name in ran)
    assert any(name.startswith("test_exact_variants_match_brute_force") for name in ran)
    assert any(name.startswith("test_dssp_on_push") for name in ran)


def test_import_pulls_in_neither_mpi4py_nor_torch():
    """mpsync.sched must load on a machine (or in a process) without MPI or torch."""
    code = "import json, sys, mpsync.sched; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "mpsync.sched.zipline" in modules  # the import did happen in that interpreter
    heavy = [m for m in modules if m.split(".")[0] in ("mpi4py", "torch", "horovod")]
    assert heavy == []


def bench_commands() -> list[pytest.param]:
    args = ["bench", "zipline", "--n", "4", "--R", "15", "--json", "--samples", "1", "--no-startup"]
    script = Path(sys.executable).with_name("mpsync")
    return [
        pytest.param([sys.executable, "-m", "mpsync.bench", *args[1:]], id="python -m mpsync.bench"),
        pytest.param(
            [str(script), *args],
            id="mpsync bench",
            marks=pytest.mark.skipif(not script.exists(), reason="console script mpsync not installed"),
        ),
    ]


@pytest.mark.parametrize("cmd", bench_commands())
def test_bench_zipline_json_smoke(cmd, tmp_path):
    # --samples 1 keeps the run to about a second per variant set; cwd is a scratch directory
    # so nothing the benchmark might write lands in the repository.
    proc = subprocess.run(cmd, cwd=tmp_path, env=fresh_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # the whole output is one JSON object
    assert isinstance(result, dict)
    assert {"n", "R", "median_us", "sort_us"} <= result.keys()
    assert (result["n"], result["R"]) == (4, 15)
    assert set(result["median_us"]) == set(ZIPLINE_VARIANTS)
    for variant, us in result["median_us"].items():
        assert isinstance(us, float) and us > 0.0, variant
    assert isinstance(result["sort_us"], float) and result["sort_us"] > 0.0
    if "d" in result:  # the exact variants found one and the same optimum
        assert len({result["d"][v] for v in EXACT_VARIANTS}) == 1
