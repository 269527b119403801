"""Groups that cannot become a batch: dead-lettered and dropped, never retried forever.

Each sample of these groups decodes on its own (the decoder checks one record); what breaks is
the group as a whole (extra tensors of different ranks or dtypes per sample), or its size.
"""

from __future__ import annotations

import msgspec
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.episodes import scored
from rollstream.consumers.grouping.emission import Emission
from rollstream.consumers.grouping.groups import CompleteGroup
from rollstream.consumers.grouping.trainer_version import VersionReading
from rollstream.kafka.consume_transform_produce import PartitionOutput
from rollstream.kafka.topics import TopicNames
from rollstream.wire import EmittedGroup, GroupDropped, ScoredEpisode, WireDecodeError, decode_group, decode_scored, encode
from rollstream.wire.torch_tensors import group_tensors, encode_tensor


NAMES = TopicNames("x", "t0")


def with_extra(sample: ScoredEpisode, key: str, tensor: torch.Tensor) -> ScoredEpisode:
    trajectory = {**sample.episode.trajectory, key: encode_tensor(tensor)}
    return msgspec.structs.replace(sample, episode=msgspec.structs.replace(sample.episode, trajectory=trajectory))


def group(task: str, samples: list[ScoredEpisode], offset: int = 0) -> CompleteGroup:
    return CompleteGroup(task, len(samples), False, tuple(samples), 0, 0, offset, offset + len(samples), 0.0)


def emitted(out: PartitionOutput) -> tuple[list[EmittedGroup], list[GroupDropped]]:
    messages = [decode_group(r.value) for r in out.records if r.topic == NAMES.batches]
    return [m for m in messages if isinstance(m, EmittedGroup)], [m for m in messages if isinstance(m, GroupDropped)]


def test_a_group_whose_samples_do_not_concatenate_is_dead_lettered_and_the_others_emitted() -> None:
    bad = group("bad", [with_extra(scored("bad", 0, 2), "x", torch.zeros(1, 2)),
                        with_extra(scored("bad", 1, 2), "x", torch.zeros(1, 2, 2))], offset=10)
    good = [group(t, [with_extra(scored(t, i, 2), "x", torch.zeros(1, 2)) for i in range(2)]) for t in ("a", "b")]
    out = PartitionOutput(0, 16 * 1024 * 1024)
    _, refused = Emission(NAMES, 0.0).emit([good[0], bad, good[1]], VersionReading(3, known=True), out)
    assert [(d.task_id, d.reason) for d in refused] == [("bad", "dead_lettered")]
    batches, drops = emitted(out)
    assert sorted(b.task_id for b in batches) == ["a", "b"]
    assert [(d.task_id, d.reason) for d in drops] == [("bad", "dead_lettered")]
    assert "cannot concatenate 'x'" in drops[0].detail
    [letter] = out.dead_letters
    assert (letter.key, letter.offset, letter.source_topic, letter.error_type) == (b"bad", 10, NAMES.scored, "ValueError")
    outcomes = [r.key for r in out.records if r.topic == NAMES.grouping_changelog]
    assert sorted(outcomes) == [b"a", b"b", b"bad"]  # every group ended, each once


def test_a_batch_larger_than_the_producer_may_send_is_dead_lettered() -> None:
    big = group("big", [scored("big", 0, 1, gen_len=5000)])
    out = PartitionOutput(0, max_record_bytes=20_000)
    _, refused = Emission(NAMES, 0.0).emit([big], VersionReading(0, known=True), out)
    assert [d.reason for d in refused] == ["dead_lettered"]
    assert "exceeds kafka.max_message_bytes=20000" in refused[0].detail
    assert emitted(out)[0] == [] and len(out.dead_letters) == 1


DTYPES = [torch.int32, torch.int64, torch.float32, torch.bool, torch.float16]


@st.composite
def extra_tensor(draw: st.DrawFn) -> torch.Tensor | None:
    if draw(st.booleans()):
        return None  # this sample has no extra key
    rank = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 3)) for _ in range(rank)]
    return torch.zeros(shape, dtype=draw(st.sampled_from(DTYPES)))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(extras=st.lists(st.lists(extra_tensor(), min_size=1, max_size=4), min_size=1, max_size=3))
def test_any_mix_of_per_sample_shapes_ranks_and_dtypes_ends_every_group_once(
    extras: list[list[torch.Tensor | None]],
) -> None:
    """Each group is emitted (and its batch decodes) or dead-lettered; emission never raises."""
    groups = []
    for g, samples in enumerate(extras):
        task = f"t{g}"
        members = []
        for i, extra in enumerate(samples):
            sample = scored(task, i, len(samples))
            if extra is not None:
                sample = with_extra(sample, "extra", extra)
            try:  # what the grouping tier would have received
                members.append(decode_scored(encode(sample)))
            except WireDecodeError:
                continue  # dead-lettered at decode, before any group sees it
        if members:
            groups.append(group(task, members))
    out = PartitionOutput(0, 16 * 1024 * 1024)
    _, refused = Emission(NAMES, 0.0).emit(groups, VersionReading(1, known=True), out)
    good, drops = emitted(out)
    for batch in good:
        group_tensors(batch)  # what the trainer reads
    ended = [b.task_id for b in good] + [d.task_id for d in drops]
    assert sorted(ended) == sorted(g.task_id for g in groups)
    assert {d.task_id for d in refused} == {d.task_id for d in drops} and len(out.dead_letters) == len(drops)
