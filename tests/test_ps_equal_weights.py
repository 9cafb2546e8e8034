"""ElasticBSP's barriers and ESync's rounds on the sharded parameter server, on real ranks:
every worker restarts from bitwise-identical weights, with the window that once let a fast
worker's next push into a slower worker's read forced open (that worker's reads of the shards
are delayed after the state server granted them)."""

from __future__ import annotations

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


def test_ebsp_on_the_ps_every_worker_holds_the_same_weights_at_every_barrier():
    # Speeds 1:4; the slow worker reads 60 ms after its barrier pull was granted, time for
    # the fast one to read, compute and push (10 ms) well before it.
    run = run_mpi("ps_programs:ebsp_barrier_weights", np=3, timeout=180,
                  args=["rounds=5", "delay=0.06"])
    res = run.results()
    assert sorted(res) == [1, 2], run.report()
    barriers = [r["at_barrier"] for r in res.values()]
    assert all(len(b) == 5 for b in barriers), barriers
    for k in range(5):
        assert barriers[0][k] == barriers[1][k], (k, barriers)


def test_esync_on_the_ps_every_worker_starts_every_round_alike_around_a_join():
    # Worker 2 joins one local iteration after round 2 while the others' round-2 reads are
    # still 150 ms away; the others go on to round 6 with it inside join().
    run = run_mpi("ps_programs:esync_join_rounds", np=4, timeout=180,
                  args=["rounds=6", "join_at=2", "delay=0.15"])
    res = run.results()
    assert sorted(res) == [1, 2, 3], run.report()
    rounds = [r["after_round"] for r in res.values()]
    for k in map(str, range(1, 7)):
        assert all(k in r for r in rounds), (k, rounds)
        assert len({r[k] for r in rounds}) == 1, (k, rounds)
