"""A batch's trainer version is never older than its tokens' versions, or the batch says it is
not what Redis answered, and the trainer side sees that.

The grouping tier's transform is driven cycle by cycle (``begin``, ``transform``, ``finish``,
as the transactional loop calls it) against a real redis-server of the test's own, which the
test stops, restarts empty or leaves answering, so every interleaving of a version publish, the
tokens of that version, and the grouping tier's read happens in the order the test chooses.
The case measured in the field: the tier read 22, the trainer published 23, the rollout workers
generated with 23, and the tier's next read failed: 8 batches were tagged 22 (staleness -1).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.structs import ConsumerRecord

from harness.configs import make_config
from harness.episodes import scored
from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig
from rollstream.consumers.grouping.transform import GroupingTransform
from rollstream.consumers.grouping.trainer_version import TrainerVersion
from rollstream.dev.redis_server import LocalRedisServer
from rollstream.kafka.consume_transform_produce import PartitionOutput
from rollstream.kafka.topics import TopicNames
from rollstream.retry import RetryPolicy
from rollstream.state.client import RedisKeys, connect
from rollstream.state.version_store import VersionStore
from rollstream.trainer.training_step import assemble, emitted_group_rows
from rollstream.wire import EmittedGroup, decode_group, encode


pytestmark = pytest.mark.timeout(120)

NO_BROKER = "127.0.0.1:9"  # the transform is driven by hand: nothing here talks to Kafka


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[LocalRedisServer]:
    with LocalRedisServer(tmp_path / "redis") as server:  # no persistence: a restart empties it
        yield server


ASK_EVERY_CYCLE = RetryPolicy(initial=0.0, maximum=0.0, jitter=0.0)  # no pause after a failed read


class Grouping:
    """One grouping instance's transform, fed one complete group per cycle on partition 0.

    Its version reader asks Redis again at every cycle after a failed read (``retry``), so
    each cycle's read is the test's to arrange."""

    def __init__(self, config: RollstreamConfig, retry: RetryPolicy = ASK_EVERY_CYCLE) -> None:
        self.config = config
        self.names = TopicNames.of(config)
        self.redis = connect(config.redis)
        self.transform = GroupingTransform(config, self.names, self.redis)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        self.transform.version = TrainerVersion(VersionStore(self.redis, keys), retry=retry)
        self.offset = 0

    async def emit(self, task_id: str, token_version: int) -> EmittedGroup:
        """One cycle: a group of 2 samples whose tokens are all of ``token_version``; its batch."""
        records = []
        for idx in range(2):
            value = encode(scored(task_id, idx, group_size=2, version=token_version))
            records.append(ConsumerRecord(self.names.scored, 0, self.offset, 0, 0, task_id.encode(), value,
                                          None, len(task_id), len(value), ()))
            self.offset += 1
        out = PartitionOutput(0, self.config.kafka.max_message_bytes)
        await self.transform.begin({0: records})
        for record in records:
            await self.transform.transform(record, out)
        await self.transform.finish(0, out, final=True)
        batches = [decode_group(r.value) for r in out.records if r.topic == self.names.batches]
        assert len(batches) == 1, out.records
        return batches[0]  # type: ignore[return-value]

    async def aclose(self) -> None:
        await self.redis.aclose()


async def publish(config: RollstreamConfig, version: int) -> None:
    """The trainer publishes ``version`` (its own client, as the trainer process would)."""
    client = connect(config.redis)
    try:
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        await VersionStore(client, keys).publish(WeightUpdate(version, f"/ckpt/v{version}"))
    finally:
        await client.aclose()


def check_invariant(batch: EmittedGroup) -> None:
    """Never older than the newest token; staleness never negative; the trainer side agrees."""
    assert batch.trainer_version >= batch.tail_version and batch.staleness >= 0, batch
    groups = [emitted_group_rows(batch)]
    assert [g.trainer_version_known for g in groups] == [batch.trainer_version_known]
    training = assemble(groups)
    assert training.trainer_versions == [batch.trainer_version]
    assert training.trainer_versions_known == [batch.trainer_version_known]
    assert training.max_staleness >= 0


async def read_22_then_23_is_published_and_used(
    config: RollstreamConfig, retry: RetryPolicy = ASK_EVERY_CYCLE,
) -> Grouping:
    grouping = Grouping(config, retry)
    await publish(config, 22)
    first = await grouping.emit("before", 22)
    assert (first.trainer_version, first.trainer_version_known) == (22, True)
    check_invariant(first)
    await publish(config, 23)  # the rollout workers load it and generate the next group with it
    return grouping


async def test_a_read_that_fails_after_a_publish_tags_the_tokens_version_and_says_so(
    redis_server: LocalRedisServer, unique_name: str,
) -> None:
    config = make_config(NO_BROKER, redis_server.url, unique_name)
    grouping = await read_22_then_23_is_published_and_used(config)
    try:
        redis_server.stop()  # the grouping tier's next read fails
        batch = await grouping.emit("after", 23)
        assert (batch.trainer_version, batch.trainer_version_known, batch.staleness) == (23, False, 0)
        check_invariant(batch)
        # tokens no newer than what it last read: the last version, still marked as not read now
        batch = await grouping.emit("older-tokens", 22)
        assert (batch.trainer_version, batch.trainer_version_known) == (22, False)
        check_invariant(batch)
    finally:
        await grouping.aclose()


async def test_a_redis_restarted_empty_never_lowers_a_batch_below_its_tokens(
    redis_server: LocalRedisServer, unique_name: str,
) -> None:
    config = make_config(NO_BROKER, redis_server.url, unique_name)
    grouping = await read_22_then_23_is_published_and_used(config)
    try:
        redis_server.restart()  # no persistence: the version key is gone, Redis says 0
        batch = await grouping.emit("after", 23)  # the read fails (a connection to the old server)
        assert (batch.trainer_version, batch.trainer_version_known) == (23, False)
        check_invariant(batch)
        batch = await grouping.emit("reads-0", 23)  # Redis answers 0: gone back, ignored
        assert (batch.trainer_version, batch.trainer_version_known) == (23, False)
        check_invariant(batch)
        await publish(config, 24)  # the trainer publishes again: Redis answers, known again
        batch = await grouping.emit("later", 23)
        assert (batch.trainer_version, batch.trainer_version_known, batch.staleness) == (24, True, 1)
        check_invariant(batch)
    finally:
        await grouping.aclose()


async def test_a_new_instance_whose_redis_lost_the_version_tags_the_tokens_version(
    redis_server: LocalRedisServer, unique_name: str,
) -> None:
    """No earlier read to fall back on: Redis answers 0 (it lost the version, or the trainer's
    publish has not reached it), the tokens say 23."""
    config = make_config(NO_BROKER, redis_server.url, unique_name)
    grouping = Grouping(config)
    try:
        batch = await grouping.emit("first", 23)
        assert (batch.trainer_version, batch.trainer_version_known) == (23, False)
        check_invariant(batch)
    finally:
        await grouping.aclose()


async def test_while_redis_is_not_asked_again_the_last_version_is_not_known(
    redis_server: LocalRedisServer, unique_name: str,
) -> None:
    """After a failed read the tier waits the retry policy's pause before it asks again; Redis
    is back (with 23) meanwhile, but batches in that window carry the last version, unknown,
    raised to their tokens'."""
    config = make_config(NO_BROKER, redis_server.url, unique_name)
    grouping = await read_22_then_23_is_published_and_used(config, retry=RetryPolicy(initial=600.0))
    try:
        redis_server.stop()
        batch = await grouping.emit("failed-read", 22)
        assert (batch.trainer_version, batch.trainer_version_known) == (22, False)
        redis_server.start()
        await publish(config, 23)
        batch = await grouping.emit("in-the-pause", 22)
        assert (batch.trainer_version, batch.trainer_version_known) == (22, False)
        check_invariant(batch)
        batch = await grouping.emit("in-the-pause-newer-tokens", 23)
        assert (batch.trainer_version, batch.trainer_version_known) == (23, False)
        check_invariant(batch)
    finally:
        await grouping.aclose()


async def test_a_version_published_after_the_tokens_is_read_and_known(
    redis_server: LocalRedisServer, unique_name: str,
) -> None:
    config = make_config(NO_BROKER, redis_server.url, unique_name)
    grouping = await read_22_then_23_is_published_and_used(config)
    try:
        await publish(config, 24)  # after the tokens of 23 were generated, before the read
        batch = await grouping.emit("after", 23)
        assert (batch.trainer_version, batch.trainer_version_known, batch.staleness) == (24, True, 1)
        check_invariant(batch)
    finally:
        await grouping.aclose()
