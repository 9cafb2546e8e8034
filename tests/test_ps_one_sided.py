"""One-sided pushes and pulls (``mpsync.server.shard_window``): where a job uses them, what
the shards store and count through them, and the same answers as the messages give."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from mpi_harness import run_mpi
from mpsync.config import SyncConfig
from mpsync.server.shard_window import (SLOTS, ShardInbox, add_into_shards, inbox_layout,
                                        slot_bytes, unavailable_reason, window_layout)
from mpsync.server.weights import WeightStore


def test_a_shards_window_holds_its_weights_then_aligned_times_counts_and_a_lock_line():
    # 20 bytes of weights -> 24; times and counts 24 each -> 72; the lock on the next line.
    assert window_layout(5, np.float32, 3) == (24, 48, 128, 192)
    assert window_layout(4, np.float64, 2) == (32, 48, 64, 128)
    assert window_layout(0, np.float32, 1) == (0, 8, 64, 128)


def test_a_push_passes_over_a_locked_shard_and_comes_back_to_it_adding_each_once():
    weights = [np.zeros(3, np.float32), np.zeros(2, np.float32)]
    locks = np.zeros((2, 8), np.int64)   # a cache line each
    at = np.array([w.ctypes.data for w in weights])
    locks_at = np.array([locks[0].ctypes.data, locks[1].ctypes.data])
    sizes, starts = np.array([3, 2]), np.array([0, 3])
    delta, out = np.arange(1, 6, dtype=np.float32), np.zeros(5, np.float32)
    visit, done = np.array([0, 1]), np.zeros(2, np.bool_)

    def push(into):
        return add_into_shards(at, sizes, locks_at, visit, starts, delta, into, 1, done, 5)

    locks[0, 0] = 2   # worker 1 is adding into shard 0
    assert push(out) == 1
    assert done.tolist() == [False, True] and locks[1, 0] == 0   # taken, added, let go
    assert weights[0].tolist() == [0, 0, 0] and weights[1].tolist() == [4, 5]
    assert out.tolist() == [0, 0, 0, 4, 5]   # each range copied out as this add left it
    weights[1][:] += 10   # another worker's push into shard 1 meanwhile
    locks[0, 0] = 0
    assert push(out) == 0
    assert weights[0].tolist() == [1, 2, 3] and weights[1].tolist() == [14, 15]
    assert out.tolist() == [1, 2, 3, 4, 5] and locks[0, 0] == 0
    done[:] = False   # a push alone: added, nothing copied
    assert push(np.empty(0, np.float32)) == 0
    assert weights[0].tolist() == [2, 4, 6] and weights[1].tolist() == [18, 20]


@contextlib.contextmanager
def _one_shard_here(elements: int, size: int, dtype, n: int, **options):
    """A one-shard window of ``size`` bytes in this process (zeroed) and this worker's
    ``ShardWindow`` on it: a model of ``elements``, worker 0 of ``n``, the shard named
    "PS shard 0 (here)"."""
    from mpi4py import MPI

    from mpsync.server.shard_window import ShardWindow

    win = MPI.Win.Allocate_shared(size, 1, comm=MPI.COMM_SELF)
    memory = np.frombuffer(win.tomemory(), dtype=np.uint8)
    memory[:] = 0
    try:
        yield memory, ShardWindow(win, [(0, elements)], [0], dtype, n, worker=0,
                                  names=["PS shard 0 (here)"], deadline=0.2, **options)
    finally:
        win.Unlock_all()
        win.Free()


def test_a_shard_locked_past_the_deadline_names_the_shard_and_its_holder():
    from mpsync.server._client import DeadlineExceeded

    _, _, lock_at, size = window_layout(4, np.float32, 2)
    with _one_shard_here(4, size, np.float32, 2) as (memory, window):
        delta, out = np.ones(4, np.float32), np.zeros(4, np.float32)
        window.push_pull(delta, out)
        assert out.tolist() == [1] * 4 and memory[lock_at] == 0
        for wrong in (np.ones(5, np.float32), np.ones(4, np.float64), np.ones(8, np.float32)[::2]):
            with pytest.raises(ValueError, match="contiguous float32 arrays of the model's 4"):
                window.push_pull(wrong, out)
        memory[lock_at:lock_at + 8].view(np.int64)[0] = 2   # worker 1 stopped inside its add
        with pytest.raises(DeadlineExceeded, match=r"PS shard 0 \(here\) stayed locked by "
                                                   r"worker\(s\) \[1\]"):
            window.push(delta)
        weights = memory[:16].view(np.float32)
        assert weights.tolist() == [1] * 4   # nothing added where it could not lock


def test_a_pinned_store_keeps_its_weights_in_the_window_through_init_apply_and_detach():
    window = np.zeros(4, dtype=np.float32)
    store = WeightStore()
    store.pinned = window
    store.init(np.arange(4, dtype=np.float32))
    assert store.weights is window and window.tolist() == [0, 1, 2, 3]
    # A sum offered another buffer is still made in the window: the workers add into it.
    spare = np.full(4, -1, dtype=np.float32)
    assert store.apply(np.ones(4, dtype=np.float32), into=spare) is None
    store.detach()
    assert store.weights is window and window.tolist() == [1, 2, 3, 4]
    assert spare.tolist() == [-1] * 4 and store.version == 1


def test_an_inbox_follows_the_window_with_counts_then_aligned_slots_per_worker():
    assert slot_bytes(5, np.float32) == 64 and slot_bytes(16, np.float32) == 64
    assert slot_bytes(17, np.float32) == 128
    # 3 workers: the window's 192 B (above); posted 192, taken 216, slots at 256.
    assert inbox_layout(5, np.float32, 3) == (192, 216, 256, 256 + SLOTS * 3 * 64)


def _inbox(workers=2, elements=3):
    rows = np.zeros((SLOTS * workers, 16))
    return ShardInbox(np.zeros(workers, np.int64), np.zeros(workers, np.int64), rows,
                      elements), rows


def test_an_inbox_sums_each_slot_written_since_the_last_take_once():
    inbox, rows = _inbox()
    inbox.ready = True
    assert not inbox.waiting()
    rows[SLOTS * 0 + 0, :3] = [1, 2, 3]        # worker 0's push 0
    rows[SLOTS * 1 + 0, :3] = [10, 20, 30]     # worker 1's pushes 0 and 1
    rows[SLOTS * 1 + 1, :3] = [100, 200, 300]
    rows[:, 3:] = np.nan                       # padding past the range is never read
    inbox.posted[:] = [1, 2]
    assert inbox.waiting()
    total, pushes, counts = inbox.take()
    assert total.tolist() == [111, 222, 333] and pushes == 3
    inbox.done(counts)
    assert inbox.taken.tolist() == [1, 2] and not inbox.waiting()
    rows[SLOTS * 0 + 1, :3] = [5, 5, 5]        # worker 0's push 1 goes to its other slot
    inbox.posted[0] = 2
    total, pushes, counts = inbox.take()
    assert total.tolist() == [5, 5, 5] and pushes == 1


def test_a_shard_steps_in_place_on_its_inbox_in_compiled_code_or_refuses_all_of_it():
    from mpsync.server import _shard_loop
    from mpsync.server.shard_optimizer import STEP_SGD

    inbox, rows = _inbox()
    posted, taken, _, total = inbox.compiled_form()
    weights = np.array([1.0, 1.0, 1.0])
    momentum = np.zeros(3)
    sgd = np.array([0.0, 0.0, 1.0, 0.5, 0.0])   # wd, momentum, 1-dampening, lr, nesterov
    cells = np.zeros(_shard_loop.N_CELLS, np.int64)

    def take():
        return _shard_loop._take_inbox(posted, taken, rows, total, STEP_SGD, weights, sgd,
                                       momentum, momentum, momentum, cells)

    assert take() == 0 and weights.tolist() == [1, 1, 1]
    rows[0, :3], rows[SLOTS, :3] = [2, 4, 6], [2, 0, 2]
    posted[:] = [1, 1]
    assert take() == 1
    assert weights.tolist() == [-1, -1, -3]     # 1 - 0.5 * (g0 + g1), one step
    assert taken.tolist() == [1, 1] and cells[_shard_loop.C_VERSION] == 2
    rows[1, :3] = [np.inf, 0, 0]
    posted[0] = 2
    assert take() == -1 and weights.tolist() == [-1, -1, -3]   # refused: nothing applied
    assert taken.tolist() == [2, 1] and cells[_shard_loop.C_VERSION] == 2


def test_a_bounded_read_waits_for_the_steps_its_bound_needs_and_names_a_shard_behind():
    from mpsync.server._client import DeadlineExceeded

    n, elements = 3, 4
    posted_at, taken_at, _, size = inbox_layout(elements, np.float64, n)
    with _one_shard_here(elements, size, np.float64, n, inbox=True, read_gap=1) as (memory, window):
        memory[:8 * elements].view(np.float64)[:] = [1, 2, 3, 4]
        posted = memory[posted_at:taken_at].view(np.int64)
        taken = memory[taken_at:taken_at + 8 * n].view(np.int64)
        posted[:], taken[:] = [6, 5, 2], [4, 4, 2]   # worker 2 wrote its last push at 2
        window.await_steps(4)   # each worker's first 4 taken, or all it wrote
        with pytest.raises(DeadlineExceeded, match=r"PS shard 0 \(here\) did not step"):
            window.await_steps(5)
        window._pushes[0] = 6   # this worker's sixth push is written: a read needs 5 each
        out = np.zeros(elements)
        with pytest.raises(DeadlineExceeded):
            window.pull(out)
        assert out.tolist() == [0] * elements   # nothing read before the steps it needs
        taken[:] = [5, 5, 2]
        window.pull(out)
        assert out.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("settings, reason", [
    (dict(policy="bsp", topology="ps"), "bsp's shards hold its rounds or barriers"),
    (dict(policy="ebsp", topology="ps"), "ebsp's shards hold its rounds or barriers"),
    (dict(policy="asp", ps_optimizer="server"), None),
    (dict(policy="ssp", ps_optimizer="server"), None),
    (dict(policy="dssp", ps_optimizer="server"), None),
    (dict(policy="gapless", ps_optimizer="server"),
     "the shards run the optimizer and gapless's reads must hold every push the state "
     "server counted (no staleness bound: ps_read_gap)"),
    (dict(policy="asp", ps_one_sided=False), "ps_one_sided is off"),
    (dict(policy="asp"), None),
    (dict(policy="ssp"), None),
    (dict(policy="dssp"), None),
])
def test_only_policies_whose_shards_apply_on_arrival_push_one_sided(settings, reason):
    from mpi4py import MPI

    from mpsync import policies

    ssp = policies.get("ssp")   # "gapless": SSP's rules without a bound a read may rely on
    policies.register("gapless", description="ssp without ps_read_gap", server=ssp.server,
                      strategies=ssp.strategies, options=ssp.options,
                      ps_server_optimizer=True, steps_unawaited=True)
    try:
        config = SyncConfig(**settings).validate()
        assert unavailable_reason(config, MPI.COMM_SELF) == reason
    finally:
        policies.unregister("gapless")


def test_a_read_gap_names_one_of_the_policys_options_and_reads_its_value():
    from mpsync import policies

    assert policies.get("ssp").read_gap(SyncConfig(staleness=5)) == 5
    assert policies.get("dssp").read_gap(SyncConfig(staleness_low=1, staleness_high=7)) == 7
    assert policies.get("asp").read_gap(SyncConfig()) is None
    with pytest.raises(policies.PolicyError, match="ps_read_gap 'bound' must be one of"):
        policies.register("nogap", description="", server="mpsync.server.policies:SSP",
                          strategies={"ps": "default"}, options=("staleness",),
                          ps_read_gap="bound")


STEPS, WORKERS = 20, 2


def _pushes_land_once(*args):
    """``ps_one_sided_programs:pushes_land_once`` on WORKERS workers for STEPS steps: each
    worker's result by rank, every rank's stderr, and the run (for its report)."""
    run = run_mpi("ps_one_sided_programs:pushes_land_once", np=WORKERS + 1, timeout=180,
                  args=[f"steps={STEPS}", *args])
    res = {r["rank"]: r for r in run.results().values()}
    assert len(res) == WORKERS, run.report()
    return res, "".join(run.rank_err(r) for r in run.ranks), run


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["asp", "ssp"])
def test_one_sided_pushes_land_once_and_the_shards_count_and_hear_them(policy):
    res, text, run = _pushes_land_once(f"policy={policy}")
    assert all(r["window"] for r in res.values()), res
    assert all(r["silent"] == [] for r in res.values()), res
    assert "PS pushes and pulls one-sided" in text, run.report()
    for r in res.values():   # each worker hosts a shard: every push of both, and the last
        shard = r["shard"]
        assert shard["one_sided_pushes"] >= WORKERS * STEPS, res
        assert shard["version"] >= shard["one_sided_pushes"], res


@pytest.mark.mpi
def test_without_the_window_the_same_pushes_come_as_messages():
    res, text, run = _pushes_land_once("policy=asp", "one_sided=0")
    assert not any(r["window"] for r in res.values()), res
    assert "PS pushes and pulls as messages (ps_one_sided is off)" in text, run.report()
    for r in res.values():
        assert r["shard"]["one_sided_pushes"] == 0, res
        assert r["shard"]["version"] >= WORKERS * STEPS, res


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["asp", "ssp"])
def test_the_shards_optimizer_steps_on_every_pushed_gradient_once_through_the_inbox(policy):
    # Under SSP at bound 0 the k-th pull must hold every worker's first k pushes, the
    # reader's own last one too, which its shard may not have stepped on yet: the read waits
    # for the shards (the program fails at the first pull lacking one).
    res, text, run = _pushes_land_once(f"policy={policy}", "optimizer=server", "staleness=0")
    assert all(r["window"] for r in res.values()), res
    assert "the shards step on the gradients written since their last step" in text, \
        run.report()
    for r in res.values():   # every push stepped on once (the program checks the weights)
        assert r["shard"]["dropped"] == 0, res
        assert r["shard"]["version"] == WORKERS * STEPS, res
