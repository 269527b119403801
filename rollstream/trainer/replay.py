"""Replay into a step: recorded ``batches`` records fed to a trainer, in a fixed order, with
nothing committed, so a bad step can be re-run and inspected offline.

Three sources, each a :class:`~rollstream.trainer.step_source.StepSource` for
:class:`~rollstream.trainer.stream.StepStream` or
:class:`~rollstream.trainer.trainer_steps.TrainerSteps` (``source=``), so the replayed steps reach
the same trainer code, on one rank or many:

- :class:`LedgerReplay`: steps of the trainer's ledger, exactly as trained: the same groups in
  the same order, read from the records the ledger names, so the tensors are bit for bit the
  ones the step trained on (and, with the same number of ranks, every rank gets the same share);
- :class:`RangeReplay`: a range of offsets per partition, partition 0 first, each in offset
  order, cut into ``staleness.groups_per_step`` groups (the rest, if any, is a last smaller step);
- :class:`DumpReplay`: the same over a JSONL file written by
  ``rollstream replay batches --to-jsonl F`` (full tensors), without a broker.

Replays never join the trainer's consumer group and never commit; ``commit`` does nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import msgspec
import torch

from rollstream.config import RollstreamConfig
from rollstream.kafka.topics import TopicNames
from rollstream.kafka.scan import last_stable_offsets, scan_topic
from rollstream.trainer.accumulator import StepAccumulator
from rollstream.trainer.kafka_source import ledger_path
from rollstream.trainer.ledger import LedgerEntry, StepLedger
from rollstream.trainer.step_source import Step
from rollstream.trainer.training_step import GroupRows, emitted_group_rows
from rollstream.wire import EmittedGroup, GroupDropped, decode_group, encode
from rollstream.wire.torch_tensors import DTYPES, pack_tensor_dict

log = logging.getLogger(__name__)


class ReplayError(ValueError):
    """The replay cannot be done as asked (a step not in the ledger, a record gone)."""


class _Replay:
    """What every replay shares: an accumulator for its counters, no commits, and steps of
    ``groups_per_step`` groups over the records of :meth:`_source` in their order (the last
    step may be smaller)."""

    def __init__(self, config: RollstreamConfig, include_eval: bool, first_step: int) -> None:
        self._config = config
        self.topic = TopicNames.of(config).batches
        # Counts drops, undecodable records and repeated groups as the live source does.
        self.accumulator = StepAccumulator(config.staleness.groups_per_step, config.grouping.pad_value, include_eval,
                                            config.trainer.remember_steps, topic=self.topic)
        self._number = first_step - 1
        self.exhausted = False  # no step will come again
        self._records: AsyncIterator[tuple[int, int, bytes | None]] | None = None

    async def start(self) -> int:
        return self._number

    async def commit(self, entries: list[LedgerEntry]) -> None:
        log.debug("replay: steps %s are not committed (a replay commits nothing)", [e.step for e in entries])

    async def close(self) -> None:
        if self._records is not None:
            await self._records.aclose()  # type: ignore[attr-defined]

    def _read(self, partition: int, start: int, end: int) -> AsyncIterator[Any]:
        """The committed records of ``partition`` with ``start <= offset < end``, in offset order."""
        return scan_topic(self._config.kafka, self.topic, "trainer-replay", {partition: end}, partitions=[partition],
                          start={partition: start})

    def _step(self, groups: list[GroupRows]) -> Step:
        self._number += 1
        return Step(self._number, groups, {})

    def _source(self) -> AsyncIterator[tuple[int, int, bytes | None]]:
        """The records to replay, in order: (partition, offset, value)."""
        raise NotImplementedError

    async def next_step(self, timeout: float | None) -> Step | None:
        if self.exhausted:
            return None
        if self._records is None:
            self._records = self._source()
        while not self.accumulator.ready():
            try:
                partition, offset, value = await anext(self._records)
            except StopAsyncIteration:
                self.exhausted = True
                left = self.accumulator.waiting
                if left:
                    self.accumulator.groups_per_step = left  # the rest, as one last smaller step
                    return self._step(self.accumulator.next_step().groups)
                return None
            self.accumulator.take_value(value, partition, offset)
        return self._step(self.accumulator.next_step().groups)


class RangeReplay(_Replay):
    """Offsets ``start[p] <= offset < end[p]`` of each partition ``p`` of ``batches``.

    ``end`` defaults to each partition's end when the replay starts; ``start`` to 0."""

    def __init__(self, config: RollstreamConfig, start: dict[int, int] | None = None, end: dict[int, int] | None = None,
                 *, include_eval: bool = False, first_step: int = 1) -> None:
        super().__init__(config, include_eval, first_step)
        self.start_offsets = dict(start or {})
        self.end_offsets = dict(end) if end is not None else None

    async def start(self) -> int:
        if self.end_offsets is None:
            # waits out an unreachable broker (kafka.outage_patience_seconds), as every client start
            # does; a topic that does not exist has no partition, so no end
            self.end_offsets = await last_stable_offsets(self._config.kafka, self.topic, "trainer-replay")
            if not self.end_offsets:
                raise ReplayError(f"topic {self.topic} does not exist")
        return await super().start()

    async def _source(self) -> AsyncIterator[tuple[int, int, bytes | None]]:
        assert self.end_offsets is not None
        for partition, end in sorted(self.end_offsets.items()):
            if (start := self.start_offsets.get(partition, 0)) < end:
                async for record in self._read(partition, start, end):
                    yield record.partition, record.offset, record.value


def batch_from_json(message: dict[str, Any]) -> EmittedGroup | GroupDropped:
    """A ``batches`` message from its JSON rendering with full tensors (``rollstream replay
    --to-jsonl``; the tensors' ``values`` are nested lists)."""
    if message.get("kind") == "dropped":
        return msgspec.convert(message, GroupDropped)
    if message.get("kind") != "batch":
        raise ReplayError(f"not a batches message: kind {message.get('kind')!r}")
    tensors = {}
    for key, spec in message.get("tensors", {}).items():
        if "values" not in spec:
            raise ReplayError("the dump holds tensor summaries, not values: write it with --tensors full")
        values = torch.tensor(_no_nulls(spec["values"]), dtype=DTYPES[spec["dtype"]])
        tensors[key] = values.reshape(spec["shape"])
    fields = {k: v for k, v in message.items() if k not in ("tensors", "packed")}
    return msgspec.convert({**fields, "packed": pack_tensor_dict(tensors)}, EmittedGroup)


def _no_nulls(values: Any) -> Any:
    """JSON has no NaN: the renderer wrote ``null`` for it."""
    if isinstance(values, list):
        return [_no_nulls(v) for v in values]
    return float("nan") if values is None else values


class DumpReplay(_Replay):
    """The records of a ``rollstream replay batches --to-jsonl`` file, in file order."""

    def __init__(self, config: RollstreamConfig, path: str | Path, *, include_eval: bool = False,
                 first_step: int = 1) -> None:
        super().__init__(config, include_eval, first_step)
        self.path = Path(path)

    async def _source(self) -> AsyncIterator[tuple[int, int, bytes | None]]:
        with self.path.open() as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                value = None  # no "message": a record the replay could not decode, counted as such
                if "message" in row:
                    try:
                        value = encode(batch_from_json(row["message"]))
                    except (ReplayError, msgspec.ValidationError, KeyError, TypeError, ValueError) as exc:
                        raise ReplayError(f"{self.path} line {number}: {exc}") from None
                yield int(row.get("partition", -1)), int(row.get("offset", -1)), value


class LedgerReplay(_Replay):
    """Steps ``steps`` of the ledger (default: ``trainer.ledger_path``), exactly as trained."""

    def __init__(self, config: RollstreamConfig, steps: Iterable[int], *, ledger: StepLedger | None = None,
                 include_eval: bool = True) -> None:
        super().__init__(config, include_eval, first_step=1)
        entries = {e.step: e for e in (ledger or StepLedger(ledger_path(config))).read()}
        wanted = list(steps)
        missing = [n for n in wanted if n not in entries]
        if missing:
            raise ReplayError(f"steps {missing} are not in the ledger (it holds steps {sorted(entries)[:3]}...{sorted(entries)[-3:]})")
        self._entries = [entries[n] for n in wanted]

    async def next_step(self, timeout: float | None) -> Step | None:
        if not self._entries:
            self.exhausted = True
            return None
        entry = self._entries.pop(0)
        by_task: dict[str, GroupRows] = {}
        for partition, offset in sorted({(p, o) for p, o in entry.records}):
            value = await self._record(partition, offset)
            message = decode_group(value)
            if isinstance(message, EmittedGroup):
                group = emitted_group_rows(message)
                group.partition, group.offset = partition, offset
                by_task[group.task_id] = group
        missing = [t for t in entry.task_ids if t not in by_task]
        if missing:
            raise ReplayError(f"step {entry.step}: groups {missing} are not in the records the ledger names")
        if not self._entries:
            self.exhausted = True
        return Step(entry.step, [by_task[t] for t in entry.task_ids], {})

    async def _record(self, partition: int, offset: int) -> bytes | None:
        async for record in self._read(partition, offset, offset + 1):
            return record.value
        raise ReplayError(f"record {partition}@{offset} of {self.topic} is gone (retention?)")
