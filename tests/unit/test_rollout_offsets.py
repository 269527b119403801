"""OffsetTracker: contiguous commit points under out-of-order completion, gaps and revocation."""

from __future__ import annotations

import random

from aiokafka.structs import TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.rollout_workers.offsets import OffsetTracker

P0 = TopicPartition("prompts", 0)
P1 = TopicPartition("prompts", 1)


def test_nothing_taken_nothing_committable() -> None:
    assert OffsetTracker().committable() == {}


def test_in_order_completion_commits_next_offset() -> None:
    t = OffsetTracker()
    for o in (5, 6, 7):
        t.add(P0, o)
    assert t.committable() == {P0: 5}
    t.done(P0, 5)
    assert t.committable() == {P0: 6}
    t.done(P0, 6)
    t.done(P0, 7)
    assert t.committable() == {P0: 8}
    assert t.in_flight() == 0


def test_out_of_order_completion_waits_for_the_lowest() -> None:
    t = OffsetTracker()
    for o in range(4):
        t.add(P0, o)
    t.done(P0, 3)
    t.done(P0, 1)
    assert t.committable() == {P0: 0}
    t.done(P0, 0)
    assert t.committable() == {P0: 2}
    t.done(P0, 2)
    assert t.committable() == {P0: 4}


def test_gaps_in_offsets_never_block() -> None:
    # read_committed skips transaction markers and aborted records: offsets jump.
    t = OffsetTracker()
    for o in (10, 13, 20):
        t.add(P0, o)
    t.done(P0, 10)
    assert t.committable() == {P0: 13}
    t.done(P0, 20)
    assert t.committable() == {P0: 13}
    t.done(P0, 13)
    assert t.committable() == {P0: 21}


def test_partitions_are_independent() -> None:
    t = OffsetTracker()
    t.add(P0, 0)
    t.add(P1, 100)
    t.add(P1, 101)
    t.done(P1, 100)
    assert t.committable() == {P0: 0, P1: 101}
    assert t.in_flight() == 2
    assert t.in_flight(P1) == 1


def test_done_is_idempotent_and_ignores_unknown() -> None:
    t = OffsetTracker()
    t.add(P0, 1)
    t.done(P0, 1)
    t.done(P0, 1)
    t.done(P0, 99)  # never taken
    t.done(P1, 0)  # unknown partition
    assert t.committable() == {P0: 2}
    assert P1 not in t.committable()


def test_add_twice_counts_once() -> None:
    t = OffsetTracker()
    t.add(P0, 3)
    t.add(P0, 3)
    assert t.in_flight() == 1
    t.done(P0, 3)
    assert t.committable() == {P0: 4}


def test_revocation_forgets_and_ignores_late_completions() -> None:
    t = OffsetTracker()
    t.add(P0, 0)
    t.add(P1, 0)
    t.forget([P0])
    assert t.committable() == {P1: 0}
    t.done(P0, 0)  # a prompt of the revoked partition finishing later
    assert P0 not in t.committable()
    assert t.in_flight() == 1
    t.forget([P0])  # idempotent


def test_reassigned_partition_starts_fresh() -> None:
    t = OffsetTracker()
    t.add(P0, 0)
    t.add(P0, 1)
    t.done(P0, 1)
    t.forget([P0])
    t.add(P0, 0)  # the new assignment re-reads from the committed offset
    assert t.committable() == {P0: 0}
    t.done(P0, 0)
    assert t.committable() == {P0: 1}


def test_advance_moves_idle_partition_past_markers() -> None:
    t = OffsetTracker()
    t.add(P0, 4)
    t.advance(P0, 6)  # a commit marker at 5
    assert t.committable() == {P0: 4}
    t.done(P0, 4)
    assert t.committable() == {P0: 6}
    t.advance(P0, 2)  # never backwards
    assert t.committable() == {P0: 6}


def test_advance_of_new_partition_commits_its_position() -> None:
    t = OffsetTracker()
    t.advance(P1, 7)
    assert t.committable() == {P1: 7}


def _reference(taken: list[int], done: set[int]) -> int:
    for o in taken:
        if o not in done:
            return o
    return taken[-1] + 1


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=30),
    seed=st.integers(min_value=0, max_value=10_000),
    fraction=st.floats(min_value=0.0, max_value=1.0),
)
def test_committable_never_passes_an_unfinished_prompt(gaps: list[int], seed: int, fraction: float) -> None:
    taken = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    order = taken[:]
    random.Random(seed).shuffle(order)
    finished = set(order[: int(len(order) * fraction)])
    t = OffsetTracker()
    for o in taken:
        t.add(P0, o)
    for o in order:
        if o in finished:
            t.done(P0, o)
        commit = t.committable()[P0]
        done_so_far = set(order[: order.index(o) + 1]) & finished
        assert commit == _reference(taken, done_so_far)
        assert all(x in done_so_far for x in taken if x < commit)
