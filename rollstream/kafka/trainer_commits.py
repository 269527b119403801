"""The trainer's cumulative stale-drop count, read back from the metadata
(:class:`~rollstream.wire.messages.TrainerCommit`) its consumer group committed on ``batches``:
by the trainer at start and by a rebuild of the staleness budget (``producers/budget_restore.py``)."""

from __future__ import annotations

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_admin, start_client, stop_client, wait_out_outage
from rollstream.wire import decode_trainer_commit

READING = "reading the trainer's committed offsets"


async def committed_stale_drops(config: KafkaConfig, consumer_group: str, topic: str, client_id: str) -> int:
    """The cumulative count of groups dropped as stale that ``consumer_group`` committed last
    on ``topic`` (0: none, or no trainer yet)."""
    admin = make_admin(config, client_id)
    await start_client(admin, config, READING)
    try:
        offsets = await wait_out_outage(  # a new cluster creates its offsets topic on first use
            config, lambda: admin.list_consumer_group_offsets(consumer_group), READING)
    finally:
        await stop_client(admin, "the admin client reading the trainer's offsets")
    counts = [commit.stale_dropped for tp, meta in offsets.items()
              if tp.topic == topic and (commit := decode_trainer_commit(meta.metadata)) is not None]
    return max(counts, default=0)
