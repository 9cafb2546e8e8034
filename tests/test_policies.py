"""The policy registry: one entry per policy, read by everything else; a policy added from
outside mpsync runs on the ring under mpirun; policy names are compared nowhere else."""

from __future__ import annotations

import ast
import inspect
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_harness import REPO, run_mpi

from mpsync import policies
from mpsync.config import ConfigError, SyncConfig

BUILTIN = policies.names()   # mpsync's own, read before any test registers one
# "auto" is also what other settings say for "choose for me" (ps_shards, the simulator's
# engine, model names): a string equal to it is no comparison with the policy's name.
NAMES_TO_SCAN = tuple(n for n in BUILTIN if n != policies.AUTO)


@pytest.fixture
def scratch_policy():
    """Registers nothing itself; removes whatever the test registered under ``name``."""
    names = []
    yield names.append
    for name in names:
        if name in policies.names():
            policies.unregister(name)


# -- the registry ------------------------------------------------------------------------------
def test_every_builtin_entry_resolves_to_its_classes():
    from mpsync.server import Policy
    from mpsync.torch.strategies import Strategy

    assert BUILTIN == ("bsp", "asp", "ssp", "dssp", "ebsp", "esync", "osp", "auto")
    for spec in policies.specs():
        assert issubclass(spec.server_class(), Policy), spec.name
        for topology in spec.topologies:
            assert issubclass(spec.strategy_class(topology), Strategy), (spec.name, topology)
        assert spec.fast_path in policies.FAST_PATH_KINDS + (None,)
        assert spec.paper and spec.description
        fields = set(SyncConfig.__dataclass_fields__)
        assert set(spec.options) <= fields, (spec.name, set(spec.options) - fields)


def test_importing_the_registry_and_config_loads_no_numba_torch_or_mpi():
    code = ("import sys, mpsync.config, mpsync.policies, mpsync.launch.jobs, mpsync.apps.train; "
            "print(sorted(m for m in ('numba', 'torch', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_docs_policy_table_is_the_registry():
    page = (REPO / "docs" / "policies.md").read_text()
    table = policies.policy_table()
    assert table in page, "docs/policies.md's table differs from policies.policy_table():\n" + table


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="Bad Name"), "lower-case"),
    (dict(strategies={"mesh": "m:C"}), "unknown topology 'mesh'"),
    (dict(strategies={}), "at least one topology"),
    (dict(server="no_colon"), "server must be 'module:Class'"),
    (dict(fast_path="warp"), "fast_path must be None or one of"),
])
def test_register_rejects_malformed_entries(kwargs, message):
    entry = dict(name="toy", description="d", server="m:C", strategies={"ring": "m:S"})
    entry.update(kwargs)
    with pytest.raises(policies.PolicyError, match=message):
        policies.register(entry.pop("name"), **entry)
    assert "toy" not in policies.names()


def test_register_refuses_to_overwrite_a_different_entry():
    with pytest.raises(policies.PolicyError, match="already registered"):
        policies.register("bsp", description="other", server="m:C", strategies={"ring": "m:S"})
    assert policies.get("bsp").server.endswith(":BSP")


def test_a_registered_policy_is_configurable_with_its_topology_rules(scratch_policy):
    scratch_policy("ps-toy")
    policies.register("ps-toy", description="d", server="mpsync.server.policies:ASP",
                      strategies={"ps": "default"})
    cfg = SyncConfig.from_options(env={}, policy="ps-toy")
    assert cfg.topology == "ps"
    assert policies.get("ps-toy").strategy_class("ps").__name__ == "ParameterServer"
    with pytest.raises(ConfigError, match="policy='ps-toy' needs a central copy"):
        SyncConfig.from_options(env={}, policy="ps-toy", topology="ring")


def test_plugins_are_imported_by_validation_and_a_bad_one_is_named(scratch_policy):
    scratch_policy("every3")
    sys.modules.pop("toy_policy", None)
    cfg = SyncConfig.from_options(env={"MPSYNC_PLUGINS": "toy_policy"}, policy="every3")
    assert (cfg.policy, cfg.topology) == ("every3", "ring")
    with pytest.raises(ConfigError, match="plugins: cannot import 'no_such_plugin_module'"):
        SyncConfig.from_options(env={"MPSYNC_PLUGINS": "no_such_plugin_module"})
    with pytest.raises(ConfigError, match="unknown policy 'every4'.*MPSYNC_PLUGINS"):
        SyncConfig.from_options(env={}, policy="every4")


def test_make_policy_builds_the_registered_server_class():
    from mpsync.server.policies import make_policy
    from mpsync.server.step_policies import ElasticBSP

    cfg = SyncConfig.from_options(env={}, policy="ebsp")
    assert type(make_policy(cfg, 3)) is ElasticBSP
    with pytest.raises(ValueError, match="runs only on topology='ring'"):
        make_policy(SyncConfig(policy="osp", topology="ps"), 2)


# -- a policy from outside mpsync, on the ring, under mpirun -------------------------------------
@pytest.mark.mpi
def test_toy_policy_syncs_every_third_iteration_on_the_ring():
    env = dict(os.environ, MPSYNC_PLUGINS="toy_policy")
    run = run_mpi("toy_policy:train_ring", np=3, timeout=120, env=env)
    results = [json.loads(line[7:]) for r in (1, 2) for line in run.rank_out(r).splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == 2, run.report()
    for res in results:
        # 7 steps: SYNC after local iterations 3 and 6 only; the models are equal right after
        # those aggregations and differ after every local step (different data per worker).
        assert res["equal_after_step"] == [False, False, True, False, False, True, False], res
        assert (res["iterations"], res["rounds"]) == (7, 2), res
        assert res["server_policy"] == "every3" and res["final_equal"], res


# -- names are compared only in the registry -------------------------------------------------------


def _policy_name_literals(path: Path) -> list[tuple[int, str]]:
    """String constants equal to a policy name, except docstrings and ``help=`` texts."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skip.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg in ("help", "description"):
            skip.update(id(n) for n in ast.walk(node.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value in NAMES_TO_SCAN and id(n) not in skip]


def test_policy_names_appear_only_in_the_registry():
    found = {}
    for path in sorted((REPO / "mpsync").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == "mpsync/policies.py":
            continue
        hits = _policy_name_literals(path)
        if hits:
            found[rel] = hits
    assert not found, f"policy names compared outside mpsync/policies.py: {found}"


def _baseline_comparisons(path: Path) -> list[int]:
    """Lines that compare something with the registry's BASELINE name (is_baseline's job)."""
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and any(isinstance(side, ast.Name) and side.id == "BASELINE"
                    or isinstance(side, ast.Attribute) and side.attr == "BASELINE"
                    for side in (n.left, *n.comparators))]


def test_the_baseline_is_compared_only_in_the_registry(tmp_path):
    found = {path.relative_to(REPO).as_posix(): _baseline_comparisons(path)
             for path in sorted((REPO / "mpsync").rglob("*.py"))
             if path.name != "policies.py" or path.parent.name != "mpsync"}
    assert {k: v for k, v in found.items() if v} == {}
    probe = tmp_path / "probe.py"
    probe.write_text("from mpsync import policies\ndef f(p):\n"
                     "    return p != policies.BASELINE\n")
    assert _baseline_comparisons(probe) == [3]


# -- the policy resolved once ---------------------------------------------------------------------
def test_validate_resolves_the_policy_once_with_the_settings_it_reads():
    config = SyncConfig.from_options(env={}, policy="esync", epsilon=0.5)
    choice = config.choice
    assert (choice.name, choice.topology, choice.baseline) == ("esync", "ring", policies.BASELINE)
    assert dict(choice.parameters) == {"epsilon": 0.5, "esync_slack": 0.0,
                                       "esync_delayed_ack": False}
    assert choice.spec is policies.get("esync") and config.resolved() is choice
    assert SyncConfig.from_options(env={}, policy="ssp").choice.topology == "ps"
    assert "choice" not in config.to_dict()
    with pytest.raises(ConfigError, match="unknown option 'choice'"):
        SyncConfig.from_options(env={}, choice=None)
    unvalidated = SyncConfig(policy="dssp")
    assert unvalidated.choice is None and unvalidated.resolved().parameters == {
        "staleness_low": 3, "staleness_high": 15}


def test_choose_names_what_does_not_fit():
    with pytest.raises(policies.PolicyError, match="runs only on topology='ps'"):
        policies.choose("ssp", "ring", {"staleness": 3})
    with pytest.raises(policies.PolicyError, match="reads staleness"):
        policies.choose("ssp", "ps")
    assert policies.baseline().is_baseline and not policies.get("esync").is_baseline
    assert policies.is_baseline(policies.BASELINE) and not policies.is_baseline("nonesuch")


def test_the_name_check_catches_a_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""bsp in a docstring is fine."""\n'
                     'import argparse\n'
                     'argparse.ArgumentParser().add_argument("--p", help="esync")\n'
                     'def f(c):\n    return c.policy == "ssp"\n')
    assert _policy_name_literals(probe) == [(5, "ssp")]


# -- the fidelity table and the departures the code states ------------------------------------
# In the code a departure from a paper is stated where it is made as ``Departure [key]``; in
# the registry (and so docs/fidelity.md) each departure carries the same ``[key]`` and is followed
# by the ``(module:Class)`` refs whose source states it.
_STATED = re.compile(r"Departure\s+\[([a-z0-9-]+)\]")
_UNKEYED = re.compile(r"\bDepartures?\b(?!\s+\[)")
_KEY = re.compile(r"\[([a-z0-9-]+)\]")
_REF = re.compile(r"mpsync\.[\w.]+:\w+")


def _stated_in_code() -> dict[str, set[str]]:
    """key -> the files under mpsync/ that state ``Departure [key]``."""
    out: dict[str, set[str]] = {}
    for path in sorted((REPO / "mpsync").rglob("*.py")):
        for key in _STATED.findall(path.read_text()):
            out.setdefault(key, set()).add(path.relative_to(REPO).as_posix())
    return out


def _source_file(ref: str) -> str:
    obj = policies.resolve(ref)
    obj = getattr(obj, "py_func", obj)     # a Numba dispatcher: its Python function
    return Path(inspect.getsourcefile(obj)).resolve().relative_to(REPO).as_posix()


def _builtin_rows():
    for spec in policies.specs():
        if spec.server.startswith("mpsync."):
            for topology, (as_written, departures) in spec.fidelity.items():
                yield spec, topology, as_written, departures


def test_every_departure_stated_in_the_code_carries_its_key():
    unkeyed = {}
    for path in sorted((REPO / "mpsync").rglob("*.py")):
        text = path.read_text()
        hits = [text[:m.start()].count("\n") + 1 for m in _UNKEYED.finditer(text)]
        if hits:
            unkeyed[path.relative_to(REPO).as_posix()] = hits
    assert not unkeyed, ("state a departure as 'Departure [key]: ...' and list [key] in the "
                         f"policy's fidelity entry (mpsync/policies.py): {unkeyed}")


def test_docs_fidelity_table_and_the_code_state_the_same_departures():
    """Every departure the registry lists is stated in the source of a class it names, every
    departure stated anywhere in mpsync is in some policy's row, and docs/fidelity.md holds the
    table: a departure added to the code without the table, or to the table without the
    code, or dropped from either, fails here."""
    page = (REPO / "docs" / "fidelity.md").read_text()
    table = policies.fidelity_table()
    assert table in page, "docs/fidelity.md's table differs from policies.fidelity_table():\n" + table
    stated = _stated_in_code()
    listed: set[str] = set()
    for spec, topology, as_written, departures in _builtin_rows():
        assert set(spec.fidelity) == set(spec.topologies), spec.name
        where = (spec.name, topology)
        assert as_written, where
        keys, refs = _KEY.findall(departures), _REF.findall(departures)
        if departures == "none":
            continue
        assert keys and refs, (where, "a departure needs its [key] and (module:Class)")
        files = {_source_file(ref) for ref in refs}
        for key in keys:
            assert stated.get(key, set()) & files, (
                f"{where}: [{key}] is not stated as 'Departure [{key}]' in {sorted(files)}")
        for ref, file in zip(refs, map(_source_file, refs)):
            mine = {k for k, fs in stated.items() if file in fs}
            assert mine & set(keys), f"{where}: {ref} states none of this row's departures"
        listed |= set(keys)
    missing = {k: sorted(fs) for k, fs in stated.items() if k not in listed}
    assert not missing, f"departures stated in the code but in no fidelity row: {missing}"


def test_the_departure_check_reads_the_keys_it_must():
    assert _STATED.findall("x. Departure [a-b1]: y; Departure\n    [c]: z") == ["a-b1", "c"]
    assert _UNKEYED.findall("Departures: a. Departure [k]: b. three departures") == \
        ["Departures"]
    assert _KEY.findall("clipped to [0, U_max] [osp-clip] (m:C)") == ["osp-clip"]
