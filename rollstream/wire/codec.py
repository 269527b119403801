"""Encode and decode topic messages: MessagePack, one reusable decoder per topic.

Every decoding failure, whatever its cause (truncated bytes, wrong kind, newer schema,
inconsistent tensors, out-of-range fields), raises ``WireDecodeError`` with a reason that
a dead letter can carry. No other exception type escapes ``decode_*``.

Numpy only (no torch): :func:`group_arrays` gives an emitted group's tensors as arrays;
``rollstream.wire.torch_tensors.group_tensors`` as torch tensors.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy

from rollstream.wire.messages import (
    FIRST_SCHEMA_VERSION,
    OLDEST_READABLE,
    SCHEMA_VERSION,
    DeadLetter,
    EmittedGroup,
    Episode,
    EpisodesMessage,
    GroupMessage,
    GroupOutcome,
    ProducerCursor,
    PromptTask,
    ScoredEpisode,
    ScoredMessage,
    TrainerCommit,
)
from rollstream.vision.images import image_digest
from rollstream.wire.packed import check_packed, unpack_arrays
from rollstream.wire.tensor_codec import TensorDecodeError, WireTensor, check_tensor, decode_array

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

T = TypeVar("T")


class WireDecodeError(ValueError):
    """A message that cannot be decoded or fails validation; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(kind)
    for kind in (
        PromptTask,
        EpisodesMessage,
        ScoredMessage,
        GroupMessage,
        DeadLetter,
        GroupOutcome,
        ProducerCursor,
    )
}


def encode(message: msgspec.Struct) -> bytes:
    """MessagePack bytes of ``message``."""
    return _encoder.encode(message)


def _decode(kind: Any, data: bytes | memoryview | None) -> Any:
    if data is None:
        raise WireDecodeError("empty record value (tombstone) where a message was expected")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireDecodeError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = _decoders[kind].decode(data)
    except msgspec.ValidationError as exc:
        raise WireDecodeError(f"schema validation failed: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireDecodeError(f"undecodable MessagePack: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise WireDecodeError(f"undecodable message: {type(exc).__name__}: {exc}") from None
    _check_schema_version(message)
    return message


def _check_schema_version(message: Any) -> None:
    version = message.schema_version
    oldest = OLDEST_READABLE.get(type(message), FIRST_SCHEMA_VERSION)
    if not oldest <= version <= SCHEMA_VERSION:
        raise WireDecodeError(
            f"unsupported schema_version {version} of a {type(message).__name__} "
            f"(this reader knows {oldest}..{SCHEMA_VERSION})"
        )


def check_trajectory(trajectory: dict[str, WireTensor]) -> None:
    """Validate a wire trajectory: required keys, dtypes, ``[b, L]`` shapes, finite logprobs."""
    required = {"input_ids": "int32", "attention_mask": "bool"}
    expected = {**required, "loss_mask": "int32", "logprobs": "float32", "versions": "int32"}
    for key in required:
        if key not in trajectory:
            raise WireDecodeError(f"trajectory lacks {key!r}")
    shape = trajectory["input_ids"].shape
    if len(shape) != 2 or shape[0] < 1:
        raise WireDecodeError(f"input_ids must be [batch, seq_len], got {shape}")
    for key, dtype in expected.items():
        wire = trajectory.get(key)
        if wire is None:
            continue
        if wire.dtype != dtype:
            raise WireDecodeError(f"{key} must be {dtype}, got {wire.dtype}")
        if wire.shape != shape:
            raise WireDecodeError(f"{key} shape {wire.shape} differs from input_ids {shape}")
    try:
        for value in trajectory.values():
            check_tensor(value)
        # only the one array whose values are checked is built (building costs µs each)
        logprobs = decode_array(trajectory["logprobs"]) if "logprobs" in trajectory else None
    except TensorDecodeError as exc:
        raise WireDecodeError(str(exc)) from None
    if logprobs is not None and not numpy.isfinite(logprobs).all():
        raise WireDecodeError("logprobs contain NaN or infinity")
    rewards = trajectory.get("rewards")
    if rewards is not None and (len(rewards.shape) != 1 or rewards.shape[0] != shape[0]):
        raise WireDecodeError(f"rewards must be [{shape[0]}], got {list(rewards.shape)}")


def decode_prompt(data: bytes | memoryview | None) -> PromptTask:
    return _decode(PromptTask, data)  # ids and group size: the types' rules


def _check_episode_images(episode: Episode) -> None:
    """The vision fields: one ``row_images`` entry per row, and only images some row shows,
    whose bytes match their digest."""
    if not (episode.row_images or episode.images):
        return
    rows = episode.trajectory["input_ids"].shape[0]
    if len(episode.row_images) != rows:
        raise WireDecodeError(f"row_images has {len(episode.row_images)} entries for {rows} trajectory rows")
    shown = {d for images in episode.row_images for d in images}
    for digest, data in episode.images.items():
        if digest not in shown:
            raise WireDecodeError(f"image {digest[:12]} is carried but no row shows it")
        if image_digest(data) != digest:
            raise WireDecodeError(f"image {digest[:12]}: its {len(data)} bytes do not match its digest")


def _check_episodes_message(message: Any) -> None:
    """What the types cannot say: the trajectory's tensors (ids, ranges and the finite reward
    are the message types' own rules, checked while decoding)."""
    match message:
        case Episode():
            check_trajectory(message.trajectory)
            _check_episode_images(message)
        case ScoredEpisode():
            check_trajectory(message.episode.trajectory)
            _check_episode_images(message.episode)


def decode_episode(data: bytes | memoryview | None) -> EpisodesMessage:
    message = _decode(EpisodesMessage, data)
    _check_episodes_message(message)
    return message


def decode_scored(data: bytes | memoryview | None) -> ScoredMessage:
    message = _decode(ScoredMessage, data)
    _check_episodes_message(message)
    return message


def _check_group_tensors(group: EmittedGroup) -> None:
    """Validation only (``group_arrays`` builds the arrays): consistent packed tensors, images."""
    try:
        check_packed(group.packed)
    except TensorDecodeError as exc:
        raise WireDecodeError(str(exc)) from None
    if group.images or group.row_images:
        _check_group_images(group)


def _check_group_images(group: EmittedGroup) -> None:
    if len(group.row_images) != len(group.sample_idx):
        raise WireDecodeError(f"group has images for {len(group.row_images)} rows; expected {len(group.sample_idx)}")
    count = len(group.images)
    for row, images in enumerate(group.row_images):
        if any(not 0 <= i < count for i in images):
            raise WireDecodeError(f"row {row} shows image {images} but its group has {count} images")


def decode_group(data: bytes | memoryview | None) -> GroupMessage:
    """A record of ``batches``: an emitted group (its tensors checked) or a dropped one."""
    message = _decode(GroupMessage, data)
    if isinstance(message, EmittedGroup):
        _check_group_tensors(message)
    return message


def group_arrays(group: EmittedGroup) -> dict[str, numpy.ndarray]:
    """An emitted group's tensors as numpy arrays (bfloat16: ``uint16`` words): views of the
    message buffer, read-only. Raises ``WireDecodeError`` when they are inconsistent
    (``decode_group`` has already checked that for decoded groups)."""
    try:
        return unpack_arrays(group.packed)
    except TensorDecodeError as exc:
        raise WireDecodeError(str(exc)) from None


def decode_dead_letter(data: bytes | memoryview | None) -> DeadLetter:
    return _decode(DeadLetter, data)


def decode_outcome(data: bytes | memoryview | None) -> GroupOutcome:
    return _decode(GroupOutcome, data)


def decode_cursor(data: bytes | memoryview | None) -> ProducerCursor:
    return _decode(ProducerCursor, data)


_commit_decoder = msgspec.json.Decoder(TrainerCommit)


def encode_trainer_commit(commit: TrainerCommit) -> str:
    """The trainer's offset-commit metadata (a string: Kafka keeps text there)."""
    return msgspec.json.encode(commit).decode()


def decode_trainer_commit(metadata: str | None) -> TrainerCommit | None:
    """The :class:`TrainerCommit` in an offset's metadata; None for an empty one or anything
    else (a commit made by another tool, a newer schema)."""
    if not metadata:
        return None
    try:
        commit = _commit_decoder.decode(metadata)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    return commit if commit.schema_version <= FIRST_SCHEMA_VERSION else None
