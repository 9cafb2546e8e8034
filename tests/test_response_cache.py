"""The response cache of named negotiation (Horovod's response cache) and Horovod's
negotiation variables: the cache as pure functions, then 2 workers under mpirun that repeat
names (the full exchange skipped, counted by member 0), change a cached name's shape on one
worker (today's mismatch error on both, the next collectives fine), time out and stall on a
cached name, join, use process sets, evict; then the variables honoured and a bad one refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mpi_harness import run_mpi
from mpsync.config import ConfigError, Negotiation
from mpsync.torch import _metadata as meta
from mpsync.torch import _negotiation as neg
from mpsync.torch._response_cache import MISS, ResponseCache


def _recs(n=2, shape=(3,), kind=meta.ALLREDUCE, **kw):
    return np.stack([meta.record(n, kind, dtype=1, shape=shape, op=1, **kw) for _ in range(n)])


def test_horovod_defaults_128_mb_fusion_1_ms_cycle_1024_entries():
    assert neg.FUSION_BYTES == 128 * 1024 * 1024
    assert Negotiation.from_env({}) == Negotiation(128 << 20, 1.0, 1024)


def test_a_cached_name_hits_only_with_the_same_record_of_the_same_worker():
    c = ResponseCache(4)
    recs = _recs()
    recs[1, meta.Field.DIMS] = 3  # rows may differ by worker (an allgather's first dimension)
    assert c.lookup("g", 0, recs[0]) == MISS
    c.answered("g", recs)
    number = c.lookup("g", 0, recs[0])
    assert number != MISS and c.lookup("g", 1, recs[1]) == number
    other = _recs(shape=(4,))[0]
    assert c.lookup("g", 0, other) == MISS  # another shape: submitted in full
    assert c.use(number) == ("g", c.entry(number)[1]) and np.array_equal(c.entry(number)[1], recs)
    c.answered("g", recs)  # answered in full again, unchanged: the same entry
    assert c.lookup("g", 0, recs[0]) == number and len(c) == 1


def test_a_changed_answer_replaces_the_entry_and_an_error_erases_it():
    c = ResponseCache(4, keep_retired=True)
    c.answered("x", _recs())
    first = c.lookup("x", 0, _recs()[0])
    c.applied = 5
    c.answered("x", _recs(shape=(7,)))  # every worker changed the shape together
    second = c.lookup("x", 0, _recs(shape=(7,))[0])
    assert second not in (MISS, first) and not c.live(first)
    assert c.entry(first)[0] == "x" and c.retired[first][2] == 6  # retired by answer 6
    mixed = np.stack([_recs()[0], _recs(shape=(7,))[1]])
    c.answered("x", mixed)  # a mismatch: erased, nothing cached
    assert c.lookup("x", 1, mixed[1]) == MISS and len(c) == 0
    assert c.counts == {"evicted": 0, "replaced": 1, "erased": 1}
    c.forget_retired(5)
    assert set(c.retired) == {first, second}
    c.forget_retired(7)
    assert c.retired == {}


@pytest.mark.parametrize("name, recs", [
    ("noname.3", _recs()),                                     # unnamed: never repeats
    ("bar", _recs(kind=meta.BARRIER)),
    ("j", np.stack([meta.joined_record(2, 0), _recs()[0]])),   # a worker joined
    ("bad", np.stack([_recs()[0], _recs(invalid=True)[1]])),   # a worker's invalid argument
])
def test_what_is_never_cached(name, recs):
    c = ResponseCache(4)
    c.answered(name, recs)
    assert len(c) == 0


@pytest.mark.parametrize("kind", [meta.REDUCESCATTER, meta.BROADCAST])
def test_reducescatters_and_broadcasts_are_cached_though_horovod_does_not(kind):
    c = ResponseCache(4)
    recs = _recs(kind=kind, root=0 if kind == meta.BROADCAST else -1)
    c.answered("x", recs)
    assert len(c) == 1 and c.lookup("x", 1, recs[1]) != MISS
    other = _recs(kind=kind, root=1 if kind == meta.BROADCAST else -1, shape=(5,))
    assert c.lookup("x", 1, other[1]) == MISS  # another root or shape: the full exchange


def test_an_answer_while_a_worker_is_joined_leaves_the_entry():
    c = ResponseCache(4)
    c.answered("a", _recs())
    number = c.lookup("a", 0, _recs()[0])
    c.answered("a", np.stack([_recs()[0], meta.joined_record(2, 0)]))
    assert c.lookup("a", 0, _recs()[0]) == number


def test_the_least_recently_used_entry_is_evicted_and_capacity_0_caches_nothing():
    c = ResponseCache(2)
    for name in ("a", "b"):
        c.answered(name, _recs())
    c.use(c.lookup("a", 0, _recs()[0]))  # "a" used: "b" is now the least recent
    c.answered("c", _recs())
    assert c.lookup("b", 0, _recs()[0]) == MISS and len(c) == 2
    assert c.lookup("a", 0, _recs()[0]) != MISS and c.counts["evicted"] == 1
    none = ResponseCache(0)
    none.answered("a", _recs())
    assert len(none) == 0 and none.lookup("a", 0, _recs()[0]) == MISS


def test_two_copies_given_the_same_answers_stay_the_same():
    """Member 0's copy decides (from the cache when it can); a worker's copy applies the same
    answers in the same order and finds every entry member 0 answered from."""
    member0, worker = ResponseCache(3, keep_retired=True), ResponseCache(3)
    rng = np.random.default_rng(0)
    for _ in range(300):
        name = f"t{int(rng.integers(6))}"
        recs = _recs(shape=(int(rng.integers(1, 3)),))
        number = member0.lookup(name, 0, recs[0])
        if number != MISS and rng.random() < 0.7:
            (name0, recs0), (name1, recs1) = member0.use(number), worker.use(number)
            assert name0 == name1 == name and np.array_equal(recs0, recs1)
        else:
            member0.answered(name, recs)
            worker.answered(name, recs)
        assert list(member0._names.items()) == list(worker._names.items())
    assert sum(member0.counts.values()) > 0


def test_the_variables_are_read_as_horovod_names_them():
    got = Negotiation.from_env({"HOROVOD_FUSION_THRESHOLD": "67108864",
                                "HOROVOD_CYCLE_TIME": "0.5", "HOROVOD_CACHE_CAPACITY": "0"})
    assert got == Negotiation(64 << 20, 0.5, 0) and got.cycle_s == 0.0005


@pytest.mark.parametrize("variable, value", [
    ("HOROVOD_FUSION_THRESHOLD", "64MB"), ("HOROVOD_FUSION_THRESHOLD", "-1"),
    ("HOROVOD_FUSION_THRESHOLD", "1.5"), ("HOROVOD_CYCLE_TIME", "fast"),
    ("HOROVOD_CYCLE_TIME", "-2"), ("HOROVOD_CYCLE_TIME", "nan"),
    ("HOROVOD_CACHE_CAPACITY", "lots"), ("HOROVOD_CACHE_CAPACITY", "-5"),
])
def test_a_bad_value_is_refused_in_one_line_naming_the_variable(variable, value):
    with pytest.raises(ConfigError) as e:
        Negotiation.from_env({variable: value})
    text = str(e.value)
    assert text.startswith(f"{variable}={value!r} is not ") and "\n" not in text, text


@pytest.mark.mpi
def test_repeated_names_skip_the_exchange_and_every_existing_behaviour_holds():
    run = run_mpi("response_cache_programs:main", np=2, timeout=300)
    parts = ["hits", "shape_change", "deadline_and_stall", "joined", "process_sets",
             "small_cache"]
    for r in range(2):
        for part in parts:
            assert f"PART-OK {part} rank={r}" in run.rank_out(r), run.report()
    assert "worker 1: ['d.x']" in run.rank_err(0), run.report()


@pytest.mark.mpi
def test_the_horovod_variables_are_honoured_by_every_worker():
    env = dict(os.environ, HOROVOD_FUSION_THRESHOLD="64", HOROVOD_CYCLE_TIME="2.5",
               HOROVOD_CACHE_CAPACITY="0")
    run = run_mpi("response_cache_programs:from_environment", np=2, timeout=180, env=env)
    for r in range(2):
        assert f"ENV-OK rank={r}" in run.rank_out(r), run.report()


@pytest.mark.mpi
def test_a_bad_variable_ends_the_job_with_one_line():
    script = str(Path(__file__).resolve().parent / "user_error_programs.py")
    env = dict(os.environ, HOROVOD_CACHE_CAPACITY="many")
    env.pop("MPSYNC_DEBUG", None)
    run = run_mpi(script, np=2, args=["init"], env=env, check=False, timeout=120)
    assert run.returncode == 2 and not run.timed_out, run.report()
    said = {r: o.get("stderr", "") for r, o in run.ranks.items() if o.get("stderr")}
    assert list(said) == [0], run.report()
    assert said[0].splitlines() == [
        "mpsync: error: HOROVOD_CACHE_CAPACITY='many' is not a whole number of names >= 0 (0 "
        "turns the response cache off; default 1024); set one or unset it"], run.report()
