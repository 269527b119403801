"""Hypothesis strategies shared by the fuzz tests: valid messages and ways to break them."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy
import torch
from hypothesis import strategies as st

from rollstream.wire import (
    DeadLetter,
    EmittedGroup,
    Episode,
    GroupDropped,
    GroupOutcome,
    ProducerCursor,
    PromptTask,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    encode,
)
from rollstream.wire.tensor_codec import WireTensor
from rollstream.wire.torch_tensors import encode_tensor_dict, pack_tensor_dict


# Fixed budget: derandomized (same examples every run), no example database, no deadline
# (2 shared cores in CI make timings meaningless).
BUDGET = {"max_examples": 60, "derandomize": True, "database": None, "deadline": None}

INTS = st.one_of(st.integers(-3, 5), st.integers(-(2**63), 2**63 - 1),
                 st.sampled_from([0, 1, 1023, 1024, 1025, 10**6, -(10**6)]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -1.5]))


def trajectory(length: int = 5, prompt: int = 2) -> dict[str, torch.Tensor]:
    mask = torch.tensor([[0] * prompt + [1] * (length - prompt)], dtype=torch.int32)
    return {
        "input_ids": torch.arange(3, 3 + length, dtype=torch.int32).unsqueeze(0),
        "attention_mask": torch.ones(1, length, dtype=torch.bool),
        "loss_mask": mask,
        "logprobs": torch.where(mask.bool(), -0.5, 0.0).float(),
        "versions": torch.where(mask.bool(), 0, -1).int(),
    }


def episode(task_id: str = "t-1", sample_idx: int = 0, group_size: int = 2, **kw: Any) -> Episode:
    """An episode of :func:`trajectory` (generated tokens of version 0, as its head and tail say)."""
    kw = {"head_version": 0, "tail_version": 0, **kw}
    return Episode(task_id=task_id, sample_idx=sample_idx, group_size=group_size,
                   trajectory=encode_tensor_dict(trajectory()), data={"prompt": "p", "answer": "1"}, **kw)


def valid_messages() -> dict[str, bytes]:
    """One valid encoding per message kind, keyed by the decoder that reads it."""
    ep = episode()
    batch = EmittedGroup(task_id="t-1", group_size=1, sample_idx=[0],
                  packed=pack_tensor_dict(trajectory()))
    return {
        "prompt": encode(PromptTask(task_id="t-1", group_size=2, data={"prompt": "p"})),
        "episode": encode(ep),
        "rejected": encode(SampleRejected(task_id="t-1", sample_idx=1, group_size=2)),
        "task_failed": encode(TaskFailed(task_id="t-1", group_size=2, reason="x")),
        "scored": encode(ScoredEpisode(episode=ep, reward=1.0)),
        "batch": encode(batch),
        "dropped": encode(GroupDropped(task_id="t-1", reason="timeout")),
        "dead_letter": encode(DeadLetter(tier="t", source_topic="s", partition=0, offset=1, key=b"k",
                                         value=b"v", reason="r")),
        "outcome": encode(GroupOutcome(task_id="t-1", outcome="emitted", source_partition=0, max_offset=3)),
        "cursor": encode(ProducerCursor(producer_id="p", epoch=0, index=1)),
    }


def as_dict(data: bytes) -> dict[str, Any]:
    return msgspec.msgpack.decode(data)


def raw(fields: dict[str, Any]) -> bytes:
    """MessagePack of a plain dict (lets a test write what the Structs would refuse to)."""
    return msgspec.msgpack.encode(fields)


def float32(values: list[float]) -> list[float]:
    """``values`` as float32 would hold them (too large ones become infinite)."""
    with numpy.errstate(over="ignore"):
        return numpy.array(values, dtype=numpy.float64).astype(numpy.float32).tolist()


def float_tensor(values: list[float], rows: int = 1) -> WireTensor:
    with numpy.errstate(over="ignore"):
        data = numpy.array(values, dtype=numpy.float64).astype("<f4").tobytes()
    return WireTensor("float32", [rows, len(values) // max(rows, 1)], memoryview(data))


@st.composite
def broken_bytes(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` truncated, bit-flipped, extended, or replaced by random bytes."""
    how = draw(st.sampled_from(["truncate", "flip", "extend", "random"]))
    if how == "truncate":
        return valid[: draw(st.integers(0, max(0, len(valid) - 1)))]
    if how == "flip":
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if how == "extend":
        return valid + draw(st.binary(min_size=1, max_size=16))
    return draw(st.binary(max_size=256))
