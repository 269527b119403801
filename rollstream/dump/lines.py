"""Trajectory dumps: one JSON line per trajectory row, one file per group (AReaL's layout).

The fields and their meanings (AReaL's nine first, then ``row`` and the ``dump.fields:
extended`` ones, :data:`EXTENDED_FIELDS`) are documented in docs/DEBUGGING.md, "Trajectory
dumps"; where lines go: :mod:`rollstream.dump.files`. ``seqlen``, ``prompt_len`` and the
versions come from :func:`rollstream.trajectory.staleness.row_spans`, the one computation the
episode message and the replay filters use too. Only rows with a trajectory are dumped:
rejections, failures and drops produce no line.

:class:`DumpWriter` buffers lines and merges them into their files from a worker thread
(``asyncio.to_thread``), so file I/O and text decoding never block the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy
from redis.exceptions import RedisError

from rollstream.api.engine import WeightUpdate
from rollstream.config import ConfigError, RollstreamConfig
from rollstream.dump.files import TaskFiles, dump_path, read_task, scope_dir
from rollstream.tokenizer_file import Tokenizer, load_tokenizer
from rollstream.trajectory.staleness import RowSpan, row_spans
from rollstream.wire import EmittedGroup, Episode, ScoredEpisode, group_arrays, decode_arrays
from rollstream.wire.dtypes import to_float32

__all__ = [
    "DUMP_FIELDS", "EXTENDED_FIELDS", "DumpLine", "DumpRow", "DumpWriter", "Tokenizer", "dump_lines", "dump_path",
    "dump_record", "load_tokenizer", "message_rows", "read_task", "scope_dir",
]

log = logging.getLogger(__name__)

DUMP_FIELDS = (
    "task_id", "sample_idx", "seqlen", "prompt_len", "head_version", "tail_version",
    "reward", "prompt", "completion",
)
EXTENDED_FIELDS = ("row", "stop_reason", "group_size", "trainer_version", "weight_path")
DumpFields = Literal["reference", "extended"]


class VersionLookup(Protocol):
    """What extended dumps read from Redis (``rollstream.state.version_store.VersionStore`` has it)."""

    async def get_version(self) -> int: ...

    async def get_update(self, version: int | None = None) -> WeightUpdate | None: ...


@dataclass(frozen=True)
class DumpRow:
    """One trajectory row of a message and what its dump line says about it."""

    task_id: str
    sample_idx: int
    row: int  # index within its episode
    rows: int  # rows of its episode
    is_eval: bool
    span: RowSpan
    ids: numpy.ndarray  # attended token ids
    reward: float | None
    stop_reason: str | None
    group_size: int | None
    trainer_version: int | None


def message_rows(message: Any) -> list[DumpRow]:
    """The trajectory rows of an ``Episode``, ``ScoredEpisode`` or ``EmittedGroup``; [] for any
    other message (rejections, failures, drops, prompts, dead letters)."""
    match message:
        case ScoredEpisode():
            return _episode_rows(message.episode, message.reward)
        case Episode():
            return _episode_rows(message, None)
        case EmittedGroup():
            return _group_rows(message)
    return []


def _rewards(arrays: dict[str, numpy.ndarray]) -> numpy.ndarray | None:
    rewards = arrays.get("rewards")
    return None if rewards is None else to_float32(rewards)  # bfloat16 words read as values


def _episode_rows(episode: Episode, reward: float | None) -> list[DumpRow]:
    tensors = decode_arrays(episode.trajectory)
    spans = row_spans(tensors, fallback_version=episode.tail_version)
    rows = len(spans)
    row_rewards = _rewards(tensors)
    out = []
    for row, span in enumerate(spans):
        # A one-row scored episode's reward is the message's; several rows carry their own.
        if row_rewards is not None and (reward is None or rows > 1):
            row_reward: float | None = float(row_rewards[row])
        else:
            row_reward = reward
        out.append(DumpRow(
            episode.task_id, episode.sample_idx, row, rows, episode.is_eval, span,
            _attended_ids(tensors, row), row_reward, episode.stop_reason, episode.group_size, None,
        ))
    return out


def _group_rows(group: EmittedGroup) -> list[DumpRow]:
    tensors = group_arrays(group)
    spans = row_spans(tensors, fallback_version=group.tail_version)
    rewards = _rewards(tensors)
    rows_of: dict[int, int] = defaultdict(int)
    for sample_idx in group.sample_idx:
        rows_of[sample_idx] += 1
    seen: dict[int, int] = defaultdict(int)
    out = []
    for row, (sample_idx, span) in enumerate(zip(group.sample_idx, spans)):
        out.append(DumpRow(
            group.task_id, sample_idx, seen[sample_idx], rows_of[sample_idx], group.is_eval, span,
            _attended_ids(tensors, row), float(rewards[row]) if rewards is not None else None,
            None, group.group_size, group.trainer_version,
        ))
        seen[sample_idx] += 1
    return out


def _attended_ids(tensors: dict[str, numpy.ndarray], row: int) -> numpy.ndarray:
    ids = tensors["input_ids"][row]
    mask = tensors.get("attention_mask")
    return ids if mask is None else ids[mask[row].astype(bool, copy=False)]


def row_record(row: DumpRow, tokenizer: Tokenizer | None, fields: DumpFields = "reference") -> dict[str, Any]:
    """The dump line of ``row`` (see the module docstring for the fields and their order)."""
    span = row.span
    ids = row.ids.tolist()
    record: dict[str, Any] = {
        "task_id": row.task_id,
        "sample_idx": row.sample_idx,
        "seqlen": span.seqlen,
        "prompt_len": span.prompt_len,
        "head_version": span.head_version,
        "tail_version": span.tail_version,
        "reward": row.reward,
        "prompt": _decode(tokenizer, ids[: span.prompt_len]),
        "completion": _decode(tokenizer, ids[span.prompt_len :]),
    }
    if fields == "extended" or row.rows > 1:
        record["row"] = row.row
    if fields == "extended":
        record.update(
            stop_reason=row.stop_reason, group_size=row.group_size,
            trainer_version=row.trainer_version, weight_path=None,  # filled by the writer
        )
    return record


def _decode(tokenizer: Tokenizer | None, ids: list[int]) -> str | None:
    if tokenizer is None:
        return None
    return tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class DumpLine:
    """One dump line and the group it belongs to (``is_eval``, ``task_id``)."""

    is_eval: bool
    task_id: str
    record: dict[str, Any]

    @property
    def tail_version(self) -> int:
        return int(self.record["tail_version"])

    def text(self) -> str:
        return json.dumps(self.record, ensure_ascii=False) + "\n"


def dump_lines(message: Any, tokenizer: Tokenizer | None, fields: DumpFields = "reference") -> list[DumpLine]:
    """The dump lines of a message, one per row of :func:`message_rows`."""
    return [
        DumpLine(row.is_eval, row.task_id, row_record(row, tokenizer, fields)) for row in message_rows(message)
    ]


def dump_record(message: Any, tokenizer: Tokenizer | None, row: int = 0, fields: DumpFields = "reference") -> dict[str, Any]:
    """The dump line (as a dict) of row ``row`` of a message."""
    return dump_lines(message, tokenizer, fields)[row].record


def tokenizer_path_for(config: RollstreamConfig) -> str | None:
    """The tokenizer dumps use: ``rollout.tokenizer_path``, else ``reward.tokenizer_path``,
    else ``rollout.model_path``; None when none is set."""
    return config.rollout.tokenizer_path or config.reward.tokenizer_path or config.rollout.model_path or None


class DumpWriter:
    """Writes dump lines under ``{fileroot}/{experiment}/{trial}`` (:mod:`rollstream.dump.files`).

    ``await write(message)`` decodes (in a worker thread) and buffers the message's lines; the
    buffer is merged into the files when it reaches ``flush_every`` lines, on ``flush()`` and on
    ``close()``. After ``flush()`` returns, every line written before it is in its task's file.
    Flushes are serialized. ``versions`` (Redis) fills ``trainer_version`` and ``weight_path``
    of extended lines; without it they stay ``null`` (emitted groups carry their trainer version).
    """

    def __init__(
        self, fileroot: str | Path, experiment: str, trial: str, tokenizer: Tokenizer | None, *,
        fields: DumpFields = "reference", versions: VersionLookup | None = None, flush_every: int = 64,
    ) -> None:
        self.root = Path(fileroot)
        self.experiment = experiment
        self.trial = trial
        self.fields = fields
        self._tokenizer = tokenizer
        self._versions = versions if fields == "extended" else None
        self._weight_paths: dict[int, str | None] = {}
        self._redis_failing = False
        self._flush_every = flush_every
        self._pending: list[DumpLine] = []
        self._files = TaskFiles(self.root / experiment / trial)
        self._lock = asyncio.Lock()
        self.lines_written = 0  # lines added to files
        self.lines_skipped = 0  # lines whose (sample_idx, row) their task's file already held

    @classmethod
    def from_config(
        cls, config: RollstreamConfig, tokenizer: Tokenizer | None = None, versions: VersionLookup | None = None,
    ) -> DumpWriter:
        """A writer at ``rollout.fileroot`` for the configured experiment, trial and
        ``dump.fields``; loads the tokenizer from :func:`tokenizer_path_for` when none is given."""
        if tokenizer is None:
            path = tokenizer_path_for(config)
            if path is None:
                raise ConfigError(
                    "trajectory dumps need a tokenizer: set rollout.tokenizer_path "
                    "(or reward.tokenizer_path / rollout.model_path)"
                )
            tokenizer = load_tokenizer(path)
        exp = config.experiment
        return cls(
            config.rollout.fileroot, exp.experiment_name, exp.trial_name, tokenizer,
            fields=config.dump.fields, versions=versions,
        )

    def path_of(self, task_id: str, is_eval: bool = False) -> Path | None:
        """The file this writer last put ``task_id``'s group in (None before its first flush)."""
        return self._files.known_path(is_eval, task_id)

    async def write(self, message: Any) -> int:
        """Buffer the lines of ``message`` (see :func:`dump_lines`); returns how many."""
        lines = await asyncio.to_thread(dump_lines, message, self._tokenizer, self.fields)
        if lines and self._versions is not None:
            await self._fill_versions(lines)
        await self.write_lines(lines)
        return len(lines)

    async def write_lines(self, lines: list[DumpLine]) -> None:
        self._pending.extend(lines)
        if len(self._pending) >= self._flush_every:
            await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            pending, self._pending = self._pending, []
            if pending:
                await _uncancellable(asyncio.to_thread(self._merge, pending))

    async def close(self) -> None:
        await self.flush()

    async def __aenter__(self) -> DumpWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _merge(self, lines: list[DumpLine]) -> None:
        by_task: dict[tuple[bool, str], list[DumpLine]] = defaultdict(list)
        for line in lines:
            by_task[(line.is_eval, line.task_id)].append(line)
        for (is_eval, task_id), group in by_task.items():
            result = self._files.merge(is_eval, task_id, [g.record for g in group], [g.text() for g in group])
            self.lines_written += result.added
            self.lines_skipped += result.skipped

    async def _fill_versions(self, lines: list[DumpLine]) -> None:
        """Set ``trainer_version`` (where the message had none) and ``weight_path`` from Redis."""
        assert self._versions is not None
        try:
            trainer = None
            if any(line.record["trainer_version"] is None for line in lines):
                trainer = await self._versions.get_version()
            for line in lines:
                if line.record["trainer_version"] is None:
                    line.record["trainer_version"] = trainer
                line.record["weight_path"] = await self._weight_path(line.tail_version)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            if not self._redis_failing:
                log.warning("dump lines get trainer_version/weight_path null while redis fails: %s", exc)
            self._redis_failing = True
            return
        if self._redis_failing:
            log.info("redis answers again: dump lines get trainer_version and weight_path")
        self._redis_failing = False

    async def _weight_path(self, version: int) -> str | None:
        if version < 0:
            return None
        if version not in self._weight_paths:  # a version's weights never move once published
            assert self._versions is not None
            update = await self._versions.get_update(version)
            self._weight_paths[version] = update.path if update is not None else None
        return self._weight_paths[version]


async def _uncancellable(work: Any) -> None:
    """Await ``work`` to completion even when the caller is cancelled (then re-raise), so a
    cancellation never cuts a batch of writes in half nor lets the next flush overlap it."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise
