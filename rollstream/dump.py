"""Trajectory dumps: one JSON line per sample row, in a per-version directory layout.

Layout (the reference system's, kept so existing tooling reads it)::

    {fileroot}/{experiment_name}/{trial_name}/{rollout|eval-rollout}/{tail_version}/{task_id}.jsonl

``tail_version`` in the path is the row's tail version (newest version over generated tokens;
-1 when the row has no generated token). ``task_id`` is made filesystem-safe by
:func:`safe_task_id`. Each line holds, in this order: ``task_id``, ``sample_idx``, ``seqlen``
(attention mask sum), ``prompt_len``, ``head_version``, ``tail_version``, ``reward``,
``prompt``, ``completion`` (text decoded with special tokens kept; ``null`` without a
tokenizer).

Two faults of the reference dump are fixed here, on purpose:

* ``head_version`` / ``tail_version`` are the min / max of ``versions`` over GENERATED tokens
  only (``loss_mask == 1``). The reference took the min over all positions, so its head
  version was always -1 (the prompt's version).
* ``prompt_len`` is the number of tokens BEFORE THE FIRST GENERATED TOKEN. The reference used
  ``seqlen - sum(loss_mask)``, which is wrong for multi-turn rows where tool or user tokens
  between turns are neither prompt nor generated. ``prompt`` is the text of those first
  ``prompt_len`` tokens and ``completion`` the text from the first generated token to the end
  of the sequence (later user/tool turns included), so ``prompt + completion`` is the row.

Only accepted samples are dumped: rejections and failures carry no trajectory and produce no
line (the reference dumped rows that acceptance had filtered out).

:class:`DumpWriter` buffers lines and appends them to their files from a worker thread
(``asyncio.to_thread``), so file I/O and text decoding never block the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rollstream.config import ConfigError, RollstreamConfig
from rollstream.wire import Batch, Episode, ScoredEpisode, batch_tensors
from rollstream.wire.tensor_codec import decode_tensor

log = logging.getLogger(__name__)

DUMP_FIELDS = (
    "task_id", "sample_idx", "seqlen", "prompt_len", "head_version", "tail_version",
    "reward", "prompt", "completion",
)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_NAME_CHARS = 180


class Tokenizer(Protocol):
    """The one tokenizer method dumps need (a Hugging Face tokenizer has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def safe_task_id(task_id: str) -> str:
    """A file name for ``task_id``: unchanged when it is already safe, else rewritten.

    Safe means only ``A-Z a-z 0-9 . _ -``, not starting with ``.`` and at most 180 characters.
    Otherwise every other character (``/``, ``\\``, spaces, ``:``, non-ASCII...) becomes ``_``,
    a leading ``.`` becomes ``_``, the name is cut to 180 characters, and ``-`` plus the first 8
    hex digits of the id's SHA-1 is appended, so two different ids never share a file (the
    lines inside still carry the original ``task_id``).
    """
    if task_id and not _UNSAFE.search(task_id) and not task_id.startswith(".") and len(task_id) <= MAX_NAME_CHARS:
        return task_id
    cleaned = _UNSAFE.sub("_", task_id)[:MAX_NAME_CHARS]
    if cleaned.startswith("."):
        cleaned = "_" + cleaned[1:]
    digest = hashlib.sha1(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{cleaned}-{digest}"


def scope_dir(is_eval: bool) -> str:
    return "eval-rollout" if is_eval else "rollout"


def dump_path(
    fileroot: str | Path, experiment: str, trial: str, is_eval: bool, tail_version: int, task_id: str
) -> Path:
    """Where the lines of ``task_id`` at ``tail_version`` go (see the module docstring)."""
    return (
        Path(fileroot) / experiment / trial / scope_dir(is_eval) / str(tail_version)
        / f"{safe_task_id(task_id)}.jsonl"
    )


def row_record(
    tensors: dict[str, torch.Tensor],
    row: int,
    *,
    task_id: str,
    sample_idx: int,
    reward: float | None,
    tokenizer: Tokenizer | None,
) -> dict[str, Any]:
    """The dump line of row ``row`` of a ``[B, L]`` trajectory dict (right-padded)."""
    mask = tensors["attention_mask"][row].to(torch.bool)
    ids = tensors["input_ids"][row][mask].tolist()
    seqlen = len(ids)
    loss = _row_values(tensors, "loss_mask", row, mask, 0)
    versions = _row_values(tensors, "versions", row, mask, -1)
    generated = [i for i, flag in enumerate(loss) if flag == 1]
    prompt_len = generated[0] if generated else seqlen
    gen_versions = [versions[i] for i in generated]
    return {
        "task_id": task_id,
        "sample_idx": sample_idx,
        "seqlen": seqlen,
        "prompt_len": prompt_len,
        "head_version": min(gen_versions) if gen_versions else -1,
        "tail_version": max(gen_versions) if gen_versions else -1,
        "reward": reward,
        "prompt": _decode(tokenizer, ids[:prompt_len]),
        "completion": _decode(tokenizer, ids[prompt_len:]),
    }


def _row_values(
    tensors: dict[str, torch.Tensor], key: str, row: int, mask: torch.Tensor, default: int
) -> list[int]:
    tensor = tensors.get(key)
    if tensor is None:
        return [default] * int(mask.sum())
    return [int(v) for v in tensor[row][mask].tolist()]


def _decode(tokenizer: Tokenizer | None, ids: list[int]) -> str | None:
    if tokenizer is None:
        return None
    return tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class DumpLine:
    """One dump line and where it goes (relative to ``{fileroot}/{experiment}/{trial}``)."""

    is_eval: bool
    task_id: str
    record: dict[str, Any]

    @property
    def tail_version(self) -> int:
        return int(self.record["tail_version"])

    def text(self) -> str:
        return json.dumps(self.record, ensure_ascii=False) + "\n"


def dump_lines(message: Any, tokenizer: Tokenizer | None) -> list[DumpLine]:
    """The dump lines of a message: one per row of an ``Episode``, ``ScoredEpisode`` or
    ``Batch``; none for any other message (rejections, failures, drops, prompts)."""
    match message:
        case ScoredEpisode():
            return _episode_lines(message.episode, message.reward, tokenizer)
        case Episode():
            return _episode_lines(message, None, tokenizer)
        case Batch():
            return _batch_lines(message, tokenizer)
    return []


def dump_record(message: Episode | ScoredEpisode, tokenizer: Tokenizer | None, row: int = 0) -> dict[str, Any]:
    """The dump line (as a dict, fields in ``DUMP_FIELDS`` order) of one row of an episode."""
    return dump_lines(message, tokenizer)[row].record


def _episode_lines(episode: Episode, reward: float | None, tokenizer: Tokenizer | None) -> list[DumpLine]:
    tensors = {key: decode_tensor(wire) for key, wire in episode.trajectory.items()}
    rows = tensors["input_ids"].shape[0]
    row_rewards = tensors.get("rewards")
    lines = []
    for row in range(rows):
        # A one-row scored episode's reward is the message's; several rows carry their own.
        if row_rewards is not None and (reward is None or rows > 1):
            row_reward: float | None = float(row_rewards[row])
        else:
            row_reward = reward
        record = row_record(
            tensors, row, task_id=episode.task_id, sample_idx=episode.sample_idx,
            reward=row_reward, tokenizer=tokenizer,
        )
        lines.append(DumpLine(episode.is_eval, episode.task_id, record))
    return lines


def _batch_lines(batch: Batch, tokenizer: Tokenizer | None) -> list[DumpLine]:
    tensors = batch_tensors(batch)
    rewards = tensors.get("rewards")
    lines = []
    for row, task_index in enumerate(batch.row_task):
        task_id = batch.task_ids[task_index]
        record = row_record(
            tensors, row, task_id=task_id, sample_idx=batch.sample_idx[row],
            reward=float(rewards[row]) if rewards is not None else None, tokenizer=tokenizer,
        )
        lines.append(DumpLine(batch.is_eval, task_id, record))
    return lines


def tokenizer_path_for(config: RollstreamConfig) -> str | None:
    """The tokenizer dumps use: ``rollout.tokenizer_path``, else ``reward.tokenizer_path``,
    else ``rollout.model_path``; None when none is set."""
    return config.rollout.tokenizer_path or config.reward.tokenizer_path or config.rollout.model_path or None


def load_tokenizer(path: str) -> Tokenizer:
    """A Hugging Face tokenizer from a local directory (no hub downloads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class DumpWriter:
    """Appends dump lines under ``{fileroot}/{experiment}/{trial}``.

    ``await write(message)`` decodes (in a worker thread) and buffers the message's lines; the
    buffer is written when it reaches ``flush_every`` lines, on ``flush()`` and on ``close()``.
    After ``flush()`` returns, every line written before it is in its file (appended, never
    truncated). Flushes are serialized, so lines of one file keep their write order.
    """

    def __init__(
        self, fileroot: str | Path, experiment: str, trial: str,
        tokenizer: Tokenizer | None, *, flush_every: int = 64,
    ) -> None:
        self.root = Path(fileroot)
        self.experiment = experiment
        self.trial = trial
        self._tokenizer = tokenizer
        self._flush_every = flush_every
        self._pending: list[DumpLine] = []
        self._lock = asyncio.Lock()
        self.lines_written = 0

    @classmethod
    def from_config(cls, config: RollstreamConfig, tokenizer: Tokenizer | None = None) -> DumpWriter:
        """A writer at ``rollout.fileroot`` for the configured experiment and trial; loads the
        tokenizer from :func:`tokenizer_path_for` when none is given."""
        if tokenizer is None:
            path = tokenizer_path_for(config)
            if path is None:
                raise ConfigError(
                    "trajectory dumps need a tokenizer: set rollout.tokenizer_path "
                    "(or reward.tokenizer_path / rollout.model_path)"
                )
            tokenizer = load_tokenizer(path)
        exp = config.experiment
        return cls(config.rollout.fileroot, exp.experiment_name, exp.trial_name, tokenizer)

    def path_for(self, line: DumpLine) -> Path:
        return dump_path(self.root, self.experiment, self.trial, line.is_eval, line.tail_version, line.task_id)

    async def write(self, message: Any) -> int:
        """Buffer the lines of ``message`` (see :func:`dump_lines`); returns how many."""
        lines = await asyncio.to_thread(dump_lines, message, self._tokenizer)
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
                await _uncancellable(asyncio.to_thread(self._append, pending))
                self.lines_written += len(pending)

    async def close(self) -> None:
        await self.flush()

    async def __aenter__(self) -> DumpWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _append(self, lines: list[DumpLine]) -> None:
        by_path: dict[Path, list[str]] = defaultdict(list)
        for line in lines:
            by_path[self.path_for(line)].append(line.text())
        for path, texts in by_path.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as handle:
                handle.write("".join(texts))


async def _uncancellable(work: Any) -> None:
    """Await ``work`` to completion even when the caller is cancelled (then re-raise), so a
    cancellation never cuts a batch of appends in half nor lets the next flush overlap it."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise
