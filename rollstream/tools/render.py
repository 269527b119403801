"""Messages as JSON (tensors in full or summarized) and as one readable summary line.

JSON is deterministic: struct fields in schema order (with the ``kind`` tag first), dict keys
sorted, tensors either ``{"dtype", "shape", "values"}`` (``tensors="full"``, nested lists) or
``{"dtype", "shape", "sha1"}`` (``tensors="summary"``: a digest of the raw little-endian bytes,
enough to tell two tensors apart without printing them). Bytes (dead-letter keys and values)
are base64 strings. NaN and infinities become ``null``. An emitted group shows its tensors under
``tensors``, as an episode does; ``packed`` shows only its layout (keys, dtypes, shapes, byte
count).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from rollstream.dump.lines import Tokenizer, message_rows, row_record
from rollstream.wire import (
    DeadLetter,
    EmittedGroup,
    Episode,
    GroupDropped,
    PackedTensors,
    PromptTask,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    WireTensor,
)
from rollstream.wire.torch_tensors import group_tensors, decode_tensor, encode_tensor_dict

TensorMode = Literal["full", "summary"]
TEXT_PREVIEW_CHARS = 300


def to_jsonable(obj: Any, tensors: TensorMode = "full") -> Any:
    """``obj`` (a message or part of one) as JSON-ready builtins (see the module docstring)."""
    if isinstance(obj, WireTensor):
        if tensors == "summary":
            return {"dtype": obj.dtype, "shape": list(obj.shape), "sha1": hashlib.sha1(obj.data).hexdigest()[:16]}
        return {"dtype": obj.dtype, "shape": list(obj.shape), "values": decode_tensor(obj).tolist()}
    if isinstance(obj, PackedTensors):
        return {"keys": obj.keys, "dtypes": obj.dtypes, "shapes": obj.shapes, "nbytes": obj.data.nbytes}
    if isinstance(obj, msgspec.Struct):
        out: dict[str, Any] = {}
        tag = type(obj).__struct_config__.tag
        if tag is not None:
            out["kind"] = tag
        for field in obj.__struct_fields__:
            out[field] = to_jsonable(getattr(obj, field), tensors)
        if isinstance(obj, EmittedGroup):
            out["tensors"] = to_jsonable(encode_tensor_dict(group_tensors(obj)), tensors)
        return out
    if isinstance(obj, dict):
        return {str(key): to_jsonable(value, tensors) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(value, tensors) for value in obj]
    return msgspec.to_builtins(obj)  # bytes -> base64, scalars unchanged


def message_json(message: Any, tensors: TensorMode = "full") -> bytes:
    """Deterministic JSON bytes of ``message`` (no trailing newline)."""
    return msgspec.json.encode(to_jsonable(message, tensors), order="deterministic")


def _versions(head: int, tail: int) -> str:
    return f"v={head}..{tail}" if head != tail else f"v={tail}"


def _episode_summary(message: Episode | ScoredEpisode, tokenizer: Tokenizer | None) -> str:
    episode, reward = (message.episode, message.reward) if isinstance(message, ScoredEpisode) else (message, None)
    rows = message_rows(message)
    record = row_record(rows[0], tokenizer)
    reward_text = "-" if reward is None else f"{reward:.4g}"
    text = (
        f"task={episode.task_id} sample={episode.sample_idx}/{episode.group_size} "
        f"{_versions(episode.head_version, episode.tail_version)} reward={reward_text} "
        f"stop={episode.stop_reason} len={record['prompt_len']}+{record['seqlen'] - record['prompt_len']}"
        f"{f' rows={len(rows)}' if len(rows) > 1 else ''}{' eval' if episode.is_eval else ''}"
    )
    if tokenizer is not None:
        text += f"\n    prompt: {_preview(record['prompt'])}\n    completion: {_preview(record['completion'])}"
    return text


def _preview(text: str | None) -> str:
    shown = repr(text)
    return shown if len(shown) <= TEXT_PREVIEW_CHARS else shown[:TEXT_PREVIEW_CHARS] + "..."


def _group_summary(group: EmittedGroup) -> str:
    tensors = group_tensors(group)
    rewards = tensors.get("rewards")
    mean = f"{float(rewards.float().mean()):.4g}" if rewards is not None and rewards.numel() else "-"
    shape = list(tensors["input_ids"].shape) if "input_ids" in tensors else []
    return (
        f"task={group.task_id} group_size={group.group_size} shape={shape} "
        f"{_versions(group.head_version, group.tail_version)} trainer={group.trainer_version} "
        f"staleness={group.staleness} reward_mean={mean} rejected={group.rejected} "
        f"failed={group.failed}{' eval' if group.is_eval else ''}"
    )


def summary_line(message: Any, tokenizer: Tokenizer | None = None) -> str:
    """One readable line (kind, task, sample, versions, reward, stop reason, lengths);
    with a tokenizer, episodes get two more lines with the prompt and completion text."""
    match message:
        case ScoredEpisode() | Episode():
            body = _episode_summary(message, tokenizer)
        case SampleRejected():
            body = (
                f"task={message.task_id} sample={message.sample_idx}/{message.group_size} "
                f"reason={message.reason!r} failed={'yes' if message.failed else 'no'}"
            )
        case TaskFailed():
            body = f"task={message.task_id} reason={message.reason!r}"
        case PromptTask():
            body = (
                f"task={message.task_id} group={message.group_size} workflow={message.workflow or '-'} "
                f"epoch={message.epoch} index={message.index}{' eval' if message.is_eval else ''}"
            )
        case EmittedGroup():
            body = _group_summary(message)
        case GroupDropped():
            body = f"task={message.task_id} reason={message.reason} trainer={message.trainer_version} detail={message.detail!r}"
        case DeadLetter():
            body = (
                f"tier={message.tier} from={message.source_topic}[{message.partition}]@{message.offset} "
                f"reason={message.reason!r}"
            )
        case _:
            body = repr(message)
    kind = type(message).__struct_config__.tag if isinstance(message, msgspec.Struct) else "?"
    return f"{kind:<11} {body}"
