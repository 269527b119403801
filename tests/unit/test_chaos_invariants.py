"""The chaos run's invariants as plain functions: each finds the breach it exists for, and says
nothing about a run that kept it (bench/chaos/invariants.py)."""

from __future__ import annotations

import numpy as np

from bench.chaos import invariants as inv
from harness.episodes import group
from harness.ledger import Ledger
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.trainer.ledger import LedgerEntry
from rollstream.wire import GroupDropped, decode_group, encode


def entry(step: int, tasks: list[str], written_at: float = 0.0) -> LedgerEntry:
    return LedgerEntry(step=step, offsets={0: step}, task_ids=tasks, records=[[0, step]] * len(tasks),
                       ranks=[tasks], written_at=written_at)


def view(versions: list[list[int]], loss: list[list[int]] | None = None, trainer: int = 5, head: int = 2,
         tail: int = 3, known: bool = True, staleness: int | None = None) -> inv.BatchView:
    array = np.array(versions, dtype=np.int32)
    mask = np.array(loss, dtype=np.int32) if loss is not None else (array >= 0).astype(np.int32)
    return inv.BatchView("t", trainer, known, head, tail, trainer - head if staleness is None else staleness,
                         array, mask)


# -- ends exactly once --


def test_a_task_that_ends_twice_is_found_the_moment_it_does() -> None:
    ledger = Ledger()
    first = decode_group(encode(build_emitted_group(group("a", [1, 1]), trainer_version=2)))
    ledger.add(first)
    assert inv.repeated_ends(ledger, ["a"]) == []
    ledger.add(GroupDropped(task_id="a", reason="timeout"))
    found = inv.repeated_ends(ledger, ["a"])
    assert [v.invariant for v in found] == [inv.ENDS_ONCE] and "emitted 1, dropped 1" in found[0].saw
    ledger.add(first)
    assert inv.repeated_rows(ledger, [("a", 0), ("a", 1)])[0].saw == "row a/0 emitted 2 times"


def test_accounting_at_the_end_names_the_lost_the_unknown_and_the_repeated() -> None:
    ledger = Ledger()
    ledger.add(GroupDropped(task_id="a", reason="stale"))
    ledger.add(GroupDropped(task_id="x", reason="stale"))
    assert inv.accounting({"a"}, 1, Ledger()) and not inv.accounting({"a", "x"}, 2, ledger)
    found = " / ".join(v.saw for v in inv.accounting({"a", "b"}, 3, ledger))
    assert "1 admitted tasks never ended: ['b']" in found and "ended tasks were never admitted: ['x']" in found
    assert "1 prompts published twice" in found


# -- trained at most once --


def test_a_group_in_two_committed_steps_is_trained_twice() -> None:
    assert inv.trained_twice([entry(1, ["a", "b"]), entry(2, ["c", "d"])]) == []
    found = inv.trained_twice([entry(1, ["a", "b"]), entry(2, ["c", "a"])])
    assert [v.saw for v in found] == ["task a trained in steps [1, 2]"]
    assert inv.trained_unknown([entry(1, ["a", "z"])], {"a", "b"})[0].saw.startswith("1 trained task ids")


def test_the_trainers_steps_go_one_by_one() -> None:
    assert inv.step_sequence([entry(1, []), entry(2, []), entry(3, [])]) == []
    assert inv.step_sequence([entry(1, []), entry(3, [])])[0].invariant == inv.VERSIONS_UP
    assert "is step 2" in inv.step_sequence([entry(1, []), entry(2, []), entry(2, [])])[0].saw


# -- the staleness bound --


def test_a_version_counts_from_the_first_time_its_line_was_seen_cut_to_the_millisecond() -> None:
    timeline = inv.VersionTimeline()
    timeline.saw([entry(1, [], written_at=10.0), entry(2, [], written_at=20.0004)])
    timeline.saw([entry(2, [], written_at=25.0)])  # written again after a crash: the first time holds
    assert [timeline.version_at(t) for t in (9.999, 10.0, 19.999, 20.0, 30.0)] == [0, 1, 1, 2, 2]
    assert timeline.latest == 2


def test_a_redis_sample_over_the_bound_is_a_violation_and_one_at_it_is_not() -> None:
    # eta 1, version 2, B 4: capacity 16
    assert inv.budget_excess(16, 0, 2, 1, 4) is None and inv.budget_excess(20, 4, 2, 1, 4) is None
    found = inv.budget_excess(20, 3, 2, 1, 4, at=5.0)
    assert found is not None and found.invariant == inv.STALENESS and "17 > (eta 1 + v 2 + 1) * B 4 = 16" in found.saw


def test_admissions_from_the_topics_against_versions_and_drops() -> None:
    timeline = inv.VersionTimeline()
    # eta 1, B 2: capacity 4 at version 0, 6 at version 1
    prompts = [1.0, 2.0, 3.0, 4.0, 5.0]
    over = inv.admission_excess(prompts, [], timeline, 1, 2)
    assert len(over) == 1 and "admission 5" in over[0].saw and "(excess 1)" in over[0].saw
    assert inv.admission_excess(prompts, [4.5], timeline, 1, 2) == []  # a slot returned before
    assert len(inv.admission_excess(prompts, [5.5], timeline, 1, 2)) == 1  # returned after: too late
    timeline.saw([entry(1, [], written_at=5.0004)])  # published just after a line written at 5.0004
    assert inv.admission_excess(prompts, [], timeline, 1, 2) == []  # the record says 5.000: no false alarm


# -- versions only go up --


def test_the_version_in_redis_goes_down_only_after_a_restart_that_may_have_lost_data() -> None:
    assert inv.version_regression(4, 5, forgetting=False) is None and inv.version_regression(4, 4, False) is None
    assert inv.version_regression(4, 0, forgetting=True) is None  # empty
    assert inv.version_regression(4, 2, forgetting=True) is None  # an earlier snapshot
    assert inv.version_regression(4, 3, forgetting=False).invariant == inv.VERSIONS_UP  # type: ignore[union-attr]


def test_a_batch_below_a_known_tag_of_its_partition_is_a_regression() -> None:
    assert inv.batch_tag_regression(5, view([[2, 3]], trainer=5), partition=1) is None
    low = inv.batch_tag_regression(6, view([[2, 3]], trainer=5), partition=1)
    assert low is not None and low.invariant == inv.VERSIONS_UP and "batches[1] tagged version 5" in low.saw


# -- token versions in bounds --


def test_a_real_batch_passes_and_its_view_reads_its_tensors() -> None:
    batch = decode_group(encode(build_emitted_group(group("a", [2, 3, 3]), trainer_version=5)))
    seen = inv.batch_view(batch)
    assert (seen.task_id, seen.head_version, seen.tail_version, seen.trainer_version) == ("a", 2, 3, 5)
    assert seen.trainer_version_known and int(seen.loss_mask.sum()) == 9 and inv.batch_versions(seen) == []


def test_tokens_outside_the_batchs_bounds_or_going_down_are_found() -> None:
    assert inv.batch_versions(view([[-1, 2, 3], [-1, 3, 3]])) == []
    outside = inv.batch_versions(view([[-1, 2, 4]]))
    assert [v.invariant for v in outside] == [inv.TOKEN_VERSIONS] and "2..4 outside head 2 .. tail 3" in outside[0].saw
    down = inv.batch_versions(view([[-1, 3, 2]]))
    assert [v.invariant for v in down] == [inv.VERSIONS_UP]
    # a prompt token's -1 is not a generated token's
    assert inv.batch_versions(view([[-1, 2, 3]], loss=[[1, 1, 1]]))[0].invariant == inv.TOKEN_VERSIONS


def test_a_trainer_version_older_than_the_tokens_is_a_violation_unless_the_batch_says_it_does_not_know() -> None:
    assert inv.batch_versions(view([[2, 3]], trainer=2))[0].saw.endswith("(tail 3) and said to be known")
    assert inv.batch_versions(view([[2, 3]], trainer=2, known=False)) == []
    assert "staleness 9 != trainer version 5 - head 2" in inv.batch_versions(view([[2, 3]], staleness=9))[0].saw


# -- trained within eta --


def test_a_trained_group_more_than_eta_behind_its_steps_version_is_a_violation() -> None:
    heads = {"ok": 2, "old": 1, "unknown": -1}
    assert inv.trained_staleness(entry(4, ["ok", "unknown", "not read yet"]), heads, eta=1) == []  # step 4 trains 3
    found = inv.trained_staleness(entry(4, ["ok", "old"]), heads, eta=1)
    assert [v.invariant for v in found] == [inv.TRAINED_STALENESS] and "2 versions behind version 3" in found[0].saw


# -- nothing in flight --


def test_in_flight_at_the_end() -> None:
    ledger = Ledger()
    ledger.add(GroupDropped(task_id="a", reason="stale"))
    assert inv.left_in_flight({"a"}, ledger, {"grouping": 0}, trainer_waiting=3, trainer_step=4) == []
    found = inv.left_in_flight({"a", "b"}, ledger, {"grouping": 2, "reward-worker": 0}, 4, 4)
    assert [v.saw.split(":")[0] for v in found] == ["1 admitted prompts never ended", "grouping", "trainer"]
