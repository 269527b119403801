"""Where replayed records go: a JSONL file, a trajectory dump, or another experiment's topic.

Every sink is written in record order and guarantees, once ``flush()`` returns, that all
records given to it so far are durable in its destination (so a resume file written after a
flush never points past lost output).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from rollstream.dump.lines import DumpWriter
from rollstream.tools.render import TensorMode, message_json


class Sink(Protocol):
    needs_message: bool  # True: wants the decoded message; False: the raw record is enough

    async def write(self, record: ConsumerRecord, message: Any, error: str | None) -> bool:
        """Take one record (``message`` None and ``error`` set when undecodable); True when
        something was written."""
        ...

    async def flush(self) -> None: ...

    async def close(self) -> None: ...


class JsonlSink:
    """One line per record: ``{"partition", "offset", "key", "message"}`` or, for an
    undecodable record, ``{"partition", "offset", "key", "error"}``; deterministic bytes."""

    needs_message = True

    def __init__(self, path: Path, tensors: TensorMode = "full", *, append: bool = False) -> None:
        self.path = path
        self._tensors = tensors
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = path.open("ab" if append else "wb")
        self._pending: list[bytes] = []

    async def write(self, record: ConsumerRecord, message: Any, error: str | None) -> bool:
        head = b'{"partition":%d,"offset":%d,"key":' % (record.partition, record.offset)
        key = message_json(None if record.key is None else record.key.decode("utf-8", "backslashreplace"))
        body = b',"error":' + message_json(error) if message is None else b',"message":' + message_json(message, self._tensors)
        self._pending.append(head + key + body + b"}\n")
        return True

    async def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            await asyncio.to_thread(self._write, pending)

    def _write(self, lines: list[bytes]) -> None:
        self._handle.write(b"".join(lines))
        self._handle.flush()

    async def close(self) -> None:
        await self.flush()
        self._handle.close()


class DumpSink:
    """Trajectory dump lines (episodes, scored episodes, emitted groups; other kinds are skipped)."""

    needs_message = True

    def __init__(self, writer: DumpWriter) -> None:
        self.writer = writer

    async def write(self, record: ConsumerRecord, message: Any, error: str | None) -> bool:
        if message is None:
            return False
        return await self.writer.write(message) > 0

    async def flush(self) -> None:
        await self.writer.flush()

    async def close(self) -> None:
        await self.writer.close()


class TopicSink:
    """Re-publishes each record as is (same key, same value bytes, same headers).

    With ``keep_partition`` (the target has as many partitions as the source) a record goes
    to its source partition number, so partition contents match one to one; otherwise the
    key decides, like every other producer of the pipeline.
    """

    needs_message = False

    def __init__(self, producer: AIOKafkaProducer, topic: str, *, keep_partition: bool) -> None:
        self._producer = producer
        self.topic = topic
        self._keep_partition = keep_partition
        self._inflight: list[asyncio.Future[Any]] = []

    async def write(self, record: ConsumerRecord, message: Any, error: str | None) -> bool:
        future = await self._producer.send(
            self.topic, record.value, key=record.key,
            partition=record.partition if self._keep_partition else None,
            headers=list(record.headers) or None,
        )
        self._inflight.append(future)
        return True

    async def flush(self) -> None:
        inflight, self._inflight = self._inflight, []
        await self._producer.flush()
        await asyncio.gather(*inflight)  # surfaces any delivery error

    async def close(self) -> None:
        await self.flush()
