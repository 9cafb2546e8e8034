"""Named negotiation: the coordinator's table as pure functions, then 2 workers that submit
named collectives in different orders, skip part of a sequence, submit late, and fuse."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpi_harness import run_mpi
from mpsync.torch import _metadata as meta
from mpsync.torch import _negotiation as neg


def _rec(n=2, shape=(3,), kind=meta.ALLREDUCE, dtype=1, op=1):
    return meta.record(n, kind, dtype=dtype, shape=shape, op=op,
                       nbytes=int(np.prod(shape)) * 4)


def test_frames_and_names_round_trip():
    parts = neg.unframe(neg.frame([[neg.SUBMIT], _rec(), neg.name_words("layer.ü.weight")]))
    assert int(parts[0][0]) == neg.SUBMIT and np.array_equal(parts[1], _rec())
    assert neg.word_name(parts[2]) == "layer.ü.weight"


def test_a_name_is_ready_once_every_worker_submitted_it_in_any_order():
    t = neg.Negotiator(2)
    assert t.submit(0, "a", _rec(), 0.0) == [] and t.submit(0, "b", _rec(), 0.0) == []
    (name, recs, numbers), = t.submit(1, "b", _rec(), 0.1)
    assert name == "b" and recs.shape == (2, _rec().size) and list(numbers) == [-1, -1]
    assert [x[0] for x in t.submit(1, "a", _rec(), 0.2)] == ["a"] and not t.waiting


def test_unnamed_collectives_pair_in_order_and_again_after_a_withdrawal():
    t = neg.Negotiator(2)
    t.submit(0, "noname.1", _rec(), 0.0)
    assert t.cancel(0, "noname.1", 5.0, 5.0) == [1]  # worker 1 never submitted it
    t.submit(0, "noname.2", _rec(), 5.1)
    (name, _recs, numbers), = t.submit(1, "noname.1", _rec(), 5.2)
    assert name == "noname.1" and list(numbers) == [2, 1]
    assert neg.local_name(name, numbers, 0) == "noname.2"
    assert neg.local_name(name, numbers, 1) == "noname.1"


def test_a_withdrawal_waits_once_for_a_worker_stuck_behind_an_older_collective():
    t = neg.Negotiator(2)
    t.submit(0, "seq.2", _rec(), 0.0)      # worker 0 waits for the step worker 1 skipped
    t.submit(1, "next", _rec(), 0.01)      # worker 1 went on
    assert t.cancel(1, "next", 3.0, 3.0) == neg.EXTEND
    assert t.cancel(0, "seq.2", 3.0, 3.0) == [1]
    assert [x[0] for x in t.submit(0, "next", _rec(), 3.1)] == ["next"]
    # The other way round: the stale one is withdrawn first, the next still waits once.
    t.submit(0, "s", _rec(), 10.0)
    t.submit(1, "n", _rec(), 10.01)
    assert t.cancel(0, "s", 13.0, 3.0) == [1]
    assert t.cancel(1, "n", 13.01, 3.0) == neg.EXTEND
    assert t.cancel(1, "n", 16.0, 3.0) == [0]
    assert t.cancel(1, "n", 16.0, 3.0) is None  # not waiting any more


def test_joined_workers_count_as_present_and_the_last_one_is_reported():
    t = neg.Negotiator(3)
    t.submit(1, "a", _rec(3), 0.0)
    ready, last = t.join(0)
    assert ready == [] and last is None
    (name, recs, _n), = t.submit(2, "a", _rec(3), 0.1)
    assert recs[0, meta.Field.KIND] == meta.JOINED
    assert "Allgather is not supported with Join" in meta.mismatch(
        np.stack([meta.joined_record(2, 0), _rec(kind=meta.ALLGATHER)]), ["f"] * 12, {})
    assert t.join(2) == ([], None) and t.join(1) == ([], 1) and t.joined == []
    # With the times of the calls: the last caller, whatever the order they were read in.
    assert t.join(1, 300) == ([], None) and t.join(0, 100) == ([], None)
    assert t.join(2, 200) == ([], 1) and t.called == {}


def test_stalled_names_are_reported_once_with_the_missing_workers():
    t = neg.Negotiator(3)
    t.submit(0, "x", _rec(3), 0.0)
    t.submit(2, "x", _rec(3), 0.5)
    assert t.stalled(0.9, 1.0) == {}
    assert t.stalled(1.1, 1.0) == {"x": [1]}
    assert t.stalled(5.0, 1.0) == {}
    text = neg.stall_text({"x": [1]}, 1.0, 20.0)
    assert "worker 1: ['x']" in text and "20s deadline" in text


@pytest.mark.parametrize("threshold, sizes", [(1 << 20, [3]), (24, [2, 1]), (0, [1, 1, 1])])
def test_fusion_groups_consecutive_matching_allreduces_up_to_the_threshold(threshold, sizes):
    recs = np.stack([_rec(), _rec()])
    ready = [(f"t{i}", recs, np.array([-1, -1])) for i in range(3)]
    assert [len(g) for g in neg.fusion_groups(ready, threshold)] == sizes
    other = np.stack([_rec(dtype=0), _rec(dtype=0)])
    mixed = ready[:1] + [("d", other, np.array([-1, -1]))] + ready[1:]
    assert [len(g) for g in neg.fusion_groups(mixed, 1 << 20)] == [1, 1, 2]


def test_an_allreduce_the_workers_disagree_on_or_a_joined_worker_answers_is_never_fused():
    good = np.stack([_rec(), _rec()])
    invalid = _rec()
    invalid[meta.Field.INVALID] = 1
    cases = [np.stack([_rec(), _rec(dtype=0)]),              # a mismatch: raised, not fused
             np.stack([_rec(), meta.joined_record(2, 0)]),   # a joined worker's zeros
             np.stack([invalid, invalid]),                    # invalid arguments everywhere
             np.stack([_rec(), _rec(op=0)])]
    for bad in cases:
        ready = [("a", good, np.array([-1, -1])), ("x", bad, np.array([-1, -1])),
                 ("b", good, np.array([-1, -1]))]
        assert [[item[0] for item in g] for g in neg.fusion_groups(ready)] == \
            [["a"], ["x"], ["b"]]
    assert [len(g) for g in neg.fusion_groups([("a", good, None)])] == [1]
    assert neg.fusion_groups([]) == []


def _gather_recs(rows=(2, 2), row_bytes=12, dtype=1):
    return np.stack([meta.record(len(rows), meta.ALLGATHER, dtype=dtype, shape=(r, 3),
                                 row_bytes=row_bytes) for r in rows])


def test_allgathers_of_one_shape_on_every_worker_fuse_by_their_output_bytes():
    """Consecutive allgathers whose every worker sends one shape share a data step, whatever
    their dtypes, up to ``allgather_fusion_bytes`` of output; ragged first dimensions, an
    allreduce between them or fusion turned off keep them apart."""
    def item(name, recs):
        return (name, recs, np.array([-1, -1]))

    same = [item(f"g{i}", _gather_recs(dtype=i % 3)) for i in range(3)]
    assert [len(g) for g in neg.fusion_groups(same)] == [3]
    assert [len(g) for g in neg.fusion_groups(same, 0)] == [1, 1, 1]
    ragged = item("r", _gather_recs(rows=(1, 2)))
    assert [[x[0] for x in g] for g in neg.fusion_groups([same[0], ragged] + same[1:])] == \
        [["g0"], ["r"], ["g1", "g2"]]
    reduce = item("a", np.stack([_rec(), _rec()]))
    assert [len(g) for g in neg.fusion_groups([same[0], reduce, same[1], same[2]])] == \
        [1, 1, 2]
    # each output: 2 workers x rows x 12 bytes; three of 0.4 x the cap make two groups
    rows = int(0.4 * neg.allgather_fusion_bytes(2)) // 24
    big = [item(f"b{i}", _gather_recs(rows=(rows, rows))) for i in range(3)]
    assert [len(g) for g in neg.fusion_groups(big)] == [2, 1]
    assert [len(g) for g in neg.fusion_groups(big, 1 << 18)] == [1, 1, 1]
    # on 4 workers the cap is half as large: each of the same outputs alone
    assert neg.allgather_fusion_bytes(4) == neg.allgather_fusion_bytes(2) // 2
    rows = int(0.6 * neg.allgather_fusion_bytes(4)) // 48
    four = [item(f"f{i}", _gather_recs(rows=(rows,) * 4)) for i in range(3)]
    assert [len(g) for g in neg.fusion_groups(four)] == [1, 1, 1]


def _answered(submissions) -> np.ndarray:
    """The records member 0 answers once each worker submitted its record for ``"g"``."""
    table = neg.Negotiator(len(submissions))
    ready = []
    for w, rec in enumerate(submissions):
        if rec is None:
            ready += table.join(w)[0]
        else:
            ready += table.submit(w, "g", rec, 0.0)
    (name, records, _numbers), = ready
    return records


def _check(records):
    return meta.mismatch(records, ["f64", "f32"], {1: "Sum"})


def test_a_grouped_call_is_one_entry_whose_parts_are_checked_and_fused_one_by_one():
    group = meta.group_record([_rec(shape=(3,)), _rec(shape=(2, 2)), _rec(dtype=0)])
    records = _answered([group, group.copy()])
    assert _check(records) is None and meta.part_kinds(records) == [meta.ALLREDUCE] * 3
    parts = meta.group_parts(records)
    assert [p.shape for p in parts] == [(2, meta.HEAD + 2)] * 3
    assert all(np.array_equal(parts[1][w], _rec(shape=(2, 2))) for w in range(2))
    assert neg.group_steps(parts, 1 << 20) == [[0, 1], [2]]  # float32 together, then float64
    assert neg.group_steps(parts, 0) == [[0], [1], [2]]
    other = meta.group_record([_rec(shape=(3,)), _rec(shape=(2, 3)), _rec(dtype=0)])
    assert "worker 0 sent a tensor of shape [2, 2], but worker 1 sent a tensor of shape " \
           "[2, 3]" in _check(_answered([group, other]))


def test_a_group_of_another_size_or_a_single_call_under_its_name_is_a_mismatch():
    two = meta.group_record([_rec(), _rec()])
    three = meta.group_record([_rec(), _rec(), _rec()])
    for first, second in ((two, three), (three, two)):  # the answer's width is the first's
        msg = _check(_answered([first, second]))
        n0, n1 = (2, 3) if first is two else (3, 2)
        assert msg == (f"Mismatched grouped collectives: worker 0 grouped {n0} tensors, but "
                       f"worker 1 grouped {n1}"), msg
    for subs, g, s in (([_rec(), two], 1, 0), ([two, _rec()], 0, 1)):
        msg = _check(_answered(subs))
        assert f"worker {g} called a grouped collective, but worker {s} called allreduce" in \
            msg, msg


def test_a_joined_worker_counts_in_every_part_of_a_group():
    group = meta.group_record([_rec(n=3), _rec(n=3, kind=meta.ALLGATHER)])
    records = _answered([group, None, group.copy()])
    parts = meta.group_parts(records)
    assert [int(p[1, meta.Field.KIND]) for p in parts] == [meta.JOINED] * 2
    assert parts[0][2].tolist() == _rec(n=3).tolist()
    assert "Allgather is not supported with Join" in _check(records)  # as Horovod answers


@pytest.mark.mpi
def test_named_collectives_in_any_order_after_errors_late_and_fused():
    run = run_mpi("horovod_negotiation_programs:main", np=2, timeout=240)
    parts = ["any_order", "error_in_sequence", "stall_report", "fusion", "gather_fusion",
             "unread_handles", "grouped_as_one"]
    for r in range(2):
        for part in parts:
            assert f"PART-OK {part} rank={r}" in run.rank_out(r), run.report()
    assert "worker 1: ['late']" in run.rank_err(0), run.report()


@pytest.mark.mpi
def test_joins_read_together_are_taken_in_the_order_they_were_called():
    run = run_mpi("horovod_negotiation_programs:joins_in_call_order", np=3, timeout=60)
    for r in range(3):
        assert f"JOINED-LAST rank={r} last=1" in run.rank_out(r), run.report()


@pytest.mark.mpi
def test_a_worker_running_only_its_own_collectives_after_a_step_is_not_silent():
    run = run_mpi("horovod_negotiation_programs:busy_outside_steps", np=2, timeout=120)
    for r in range(2):
        assert f"BUSY-OK rank={r}" in run.rank_out(r), run.report()
    assert "silent for more than" not in run.rank_err(0), run.report()


def test_the_suite_runner_counts_a_test_passed_only_where_every_rank_passed(tmp_path):
    from horovod_suite import outcomes

    case = '<testcase classname="T" name="{}">{}</testcase>'
    for rank, body in ((0, ["", "", "<skipped/>"]), (1, ["", "<failure/>", "<skipped/>"])):
        cases = "".join(case.format(n, b) for n, b in zip(("a", "b", "c"), body))
        (tmp_path / f"rank{rank}.xml").write_text(f"<testsuites><testsuite>{cases}"
                                                  f"</testsuite></testsuites>")
    assert outcomes(tmp_path) == {"a": "passed", "b": "failed", "c": "skipped"}


@pytest.mark.mpi
def test_the_suite_runner_names_where_a_rank_that_wrote_no_report_was(tmp_path, capsys):
    """A rank stuck in a test (killed at the runner's deadline) wrote no report: the runner
    names the test it was in and its last failure."""
    from horovod_suite import run_suite

    suite = tmp_path / "test_stuck_suite.py"
    suite.write_text(
        "import os, time\n"
        "RANK = int(os.environ.get('OMPI_COMM_WORLD_RANK', '0'))\n"
        "def test_fine():\n    pass\n"
        "def test_fails_on_rank_1():\n    assert RANK == 0\n"
        "def test_stuck_on_rank_1():\n    time.sleep(120 if RANK == 1 else 0)\n")
    found = run_suite(suite, tmp_path, 2, 25.0, {})
    err = capsys.readouterr().err
    # (node ids are relative to pytest's root directory, which depends on where it runs)
    assert re.search(r"rank 1 wrote no report; last test started: \S*test_stuck_suite.py::"
                     r"test_stuck_on_rank_1;", err), err
    assert re.search(r"call failed \S*test_stuck_suite.py::test_fails_on_rank_1", err), err
    assert "rank 0 wrote no report" not in err, err
    assert found["test_fine"] == "passed", found  # rank 0's report is still read
