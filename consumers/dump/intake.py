"""The dump tier's part of its at-least-once loop: :class:`DumpIntake`.

The records taken in a cycle are written at the cycle's end (their lines merged into their
files, dead letters delivered) before their offsets are done, so a crash never loses a line;
records read again change nothing (:mod:`rollstream.dump.files`: one line per
``(sample_idx, row)``). Undecodable records go to the dead-letter topic.
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from rollstream.dump.lines import DumpWriter
from rollstream.kafka.dead_letter import dead_letter_for, send_dead_letter
from rollstream.kafka.partition_loop import Intake, Records
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.metrics import DEAD_LETTERS, EPISODES, MESSAGES_IN, MESSAGES_OUT
from rollstream.wire import ScoredEpisode, WireDecodeError, decode_scored

log = logging.getLogger(__name__)

TIER = "dump"


class DumpIntake(Intake):
    """The dump tier's side of its partition loop: the records taken in a cycle are written
    (files flushed, dead letters delivered) at the cycle's end; then their offsets are done.
    ``room``, ``wait_for_room`` and ``committed`` are the Intake no-ops: a cycle writes all it took."""

    def __init__(self, writer: DumpWriter, producer: AIOKafkaProducer, names: TopicNames) -> None:
        self._writer = writer
        self._producer = producer
        self._names = names
        self._owned: set[int] = set()
        self._taken: Records = {}
        self._done: dict[int, int] = {}  # per partition: every record below it is written

    async def acquire(self, partitions: set[int]) -> None:
        self._owned |= partitions

    def release(self, partitions: set[int]) -> None:
        self._owned -= partitions
        for p in partitions:
            self._taken.pop(p, None)
            self._done.pop(p, None)

    def take(self, records: Records) -> None:
        for p, batch in records.items():
            self._taken.setdefault(p, []).extend(batch)

    def committable(self, positions: dict[int, int]) -> dict[int, int]:
        return dict(self._done)

    async def tick(self) -> None:
        """Write what was taken; its offsets are done once the lines and letters are out."""
        taken, self._taken = self._taken, {}
        if not taken:
            return
        task_ids = [task_id for batch in taken.values() for record in batch
                    if (task_id := await self._write(record)) is not None]
        await self._writer.flush()
        await self._producer.flush()  # dead letters are delivered before their offsets are committed
        for p, batch in taken.items():
            if p in self._owned:  # a partition lost meanwhile is re-read by its new partition owner
                self._done[p] = batch[-1].offset + 1
        if task_ids:
            shown = sorted(set(task_ids))
            log.info("dumped %d episode(s) of task(s) %s%s", len(task_ids), ", ".join(shown[:8]),
                     "..." if len(shown) > 8 else "")

    async def _write(self, record: ConsumerRecord) -> str | None:
        """Dump one record (or dead-letter it); returns the dumped episode's task id."""
        MESSAGES_IN.labels(TIER, "scored").inc()
        try:
            message = decode_scored(record.value)
        except WireDecodeError as exc:
            DEAD_LETTERS.labels(TIER, "undecodable").inc()
            await send_dead_letter(self._producer, self._names.dead_letter, dead_letter_for(record, TIER, exc.reason, exc))
            MESSAGES_OUT.labels(TIER, "dead-letter").inc()
            return None
        if not isinstance(message, ScoredEpisode):
            return None  # rejections and failures have no trajectory to dump
        await self._writer.write(message)
        EPISODES.labels(TIER, "dumped").inc()
        return message.episode.task_id
