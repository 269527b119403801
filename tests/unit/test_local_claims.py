"""What a rollout worker answers for itself, without Redis (rollout_workers/local_claims.py)."""

from __future__ import annotations

from aiokafka.structs import TopicPartition

from rollstream.rollout_workers.local_claims import Known, LocalClaims

P0, P1 = TopicPartition("prompts", 0), TopicPartition("prompts", 1)


def test_running_and_finished_records_are_known_by_their_identity() -> None:
    local = LocalClaims()
    local.started(P0, 5, "t:a")
    assert local.known(P0, 5, "t:a") is Known.MINE
    assert local.known(P0, 5, "u:a") is None  # another record at that offset (a recreated topic)
    local.finished(P0, 5, "t:a")
    assert local.known(P0, 5, "t:a") is Known.DONE and not local.running
    assert local.known(P1, 5, "t:a") is None


def test_a_commit_forgets_the_finished_records_below_it_and_names_them() -> None:
    local = LocalClaims()
    for offset in (1, 2, 4):
        local.finished(P0, offset, f"r{offset}")
    assert local.committed(P0, 3) == [1, 2]
    assert local.known(P0, 2, "r2") is None and local.known(P0, 4, "r4") is Known.DONE
    assert local.committed(P0, 3) == []


def test_only_records_at_or_beyond_the_frontier_of_a_partition_taken_are_fresh() -> None:
    local = LocalClaims()
    assert not local.fresh(P0, 100)  # not taken: nothing is known
    local.taken(P0, 10)
    assert not local.fresh(P0, 9) and local.fresh(P0, 10) and local.fresh(P0, 11)
    local.taken(P1, None)  # the last stable offset could not be read
    assert not local.fresh(P1, 10**9)
    local.lost(P0)
    assert not local.fresh(P0, 11)


def test_a_lost_partitions_finished_records_above_its_commit_stay_done_and_are_not_written_again() -> None:
    """The release commits what it can first (:meth:`LocalClaims.committed` forgets what that
    passed); what is left is above the commit point, whether a record still runs here or not
    (one held below it, a commit that failed): the worker may read it again."""
    local = LocalClaims()
    local.finished(P0, 1, "a")
    local.started(P0, 2, "b")
    local.finished(P1, 1, "c")
    local.finished(P1, 5, "d")
    assert local.committed(P1, 2) == [1]  # the release's commit: a record held at 2 stops it there
    local.lost(P0)
    local.lost(P1)
    assert local.known(P0, 1, "a") is Known.DONE  # above a prompt still running here: not committed yet
    assert local.known(P1, 1, "c") is None  # committed past: nobody reads it again
    assert local.known(P1, 5, "d") is Known.DONE  # above the commit: read again if P1 comes back
    assert local.to_assert() == [(P0, 2, "b", False), (P0, 1, "a", True)]  # P1's left behind: not written


def test_what_is_written_again_after_redis_forgot() -> None:
    local = LocalClaims()
    local.started(P1, 3, "x")
    local.started(P0, 7, "y")
    local.finished(P0, 2, "z")
    assert local.to_assert() == [(P0, 7, "y", False), (P1, 3, "x", False), (P0, 2, "z", True)]
    local.stopped(P1, 3)
    assert local.running_on([P1]) == 0 and local.running_on([P0]) == 1


def test_records_that_end_after_their_partition_was_lost_stay_done_until_committed_past() -> None:
    """The suite saw it: a prompt ended just after its partition was revoked, the partition came
    back to the same worker at once, and the record, re-read from the commit point below it,
    ran again, because the worker had forgotten it and Redis still said "running here" (the
    done claim is written when Redis answers)."""
    local = LocalClaims()
    local.taken(P0, 0)
    local.finished(P0, 1, "a")
    local.started(P0, 2, "b")
    local.started(P0, 3, "c")
    local.lost(P0)
    local.finished(P0, 2, "b")
    local.finished(P0, 3, "c")  # the last of them ends after the loss
    assert [local.known(P0, o, r) for o, r in ((1, "a"), (2, "b"), (3, "c"))] == [Known.DONE] * 3
    assert local.to_assert() == []  # not written again: the new owner commits past them
    local.taken(P0, 4)  # taken back: all still DONE without Redis, and this worker's again
    assert local.known(P0, 3, "c") is Known.DONE and len(local.to_assert()) == 3
    assert local.committed(P0, 4) == [1, 2, 3] and local.known(P0, 3, "c") is None  # committed past: forgotten
