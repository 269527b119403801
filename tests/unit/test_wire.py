"""Wire schemas: round trips over dtypes and shapes, zero-copy decoding, one error type."""

from __future__ import annotations

from typing import Any

import ast
import math
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rollstream.wire
from rollstream.wire import (
    DeadLetter,
    EmittedGroup,
    Episode,
    GroupDropped,
    PromptTask,
    SampleRejected,
    ScoredEpisode,
    TaskFailed,
    WireDecodeError,
    decode_episode,
    decode_group,
    decode_prompt,
    decode_scored,
    encode,
    group_arrays,
)
from rollstream.wire.messages import SCHEMA_VERSION
from rollstream.wire.tensor_codec import WireTensor
from rollstream.wire.torch_tensors import (
    DTYPES,
    decode_tensor,
    decode_tensor_dict,
    encode_tensor,
    encode_tensor_dict,
    group_tensors,
    pack_tensor_dict,
)

DECODERS = [decode_prompt, decode_episode, decode_scored, decode_group]


def trajectory(length: int = 6, prompt: int = 2, version: int = 0) -> dict[str, torch.Tensor]:
    loss_mask = torch.tensor([[0] * prompt + [1] * (length - prompt)], dtype=torch.int32)
    return {
        "input_ids": torch.arange(length, dtype=torch.int32).unsqueeze(0),
        "attention_mask": torch.ones(1, length, dtype=torch.bool),
        "loss_mask": loss_mask,
        "logprobs": torch.where(loss_mask.bool(), -0.5, 0.0).float(),
        "versions": torch.where(loss_mask.bool(), version, -1).int(),
    }


def episode(**kw) -> Episode:
    fields = dict(task_id="t1", sample_idx=0, group_size=2, trajectory=encode_tensor_dict(trajectory()))
    fields.update(kw)
    return Episode(**fields)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    name = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    numel = math.prod(shape)
    raw = draw(st.binary(min_size=numel * 8, max_size=numel * 8))
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    dtype = DTYPES[name]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    flat = base[: numel * itemsize].clone()
    if dtype == torch.bool:
        flat = flat % 2
    return flat.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)


@settings(max_examples=200, deadline=None)
@given(tensors())
def test_tensor_round_trip_is_bit_exact(tensor: torch.Tensor) -> None:
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(encode_tensor(tensor)), type=WireTensor)
    decoded = decode_tensor(wire)
    assert decoded.dtype == tensor.dtype
    assert decoded.shape == tensor.shape
    assert decoded.reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).view(torch.uint8).tolist()


def test_decoding_shares_the_message_buffer() -> None:
    data = encode(episode())
    message = decode_episode(data)
    ids = decode_tensor_dict(message.trajectory)["input_ids"]
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert base <= ids.data_ptr() < base + len(data)


def test_non_contiguous_tensor_is_encoded_in_c_order() -> None:
    tensor = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    assert torch.equal(decode_tensor(encode_tensor(tensor)), tensor)


@pytest.mark.parametrize(
    "message, decoder",
    [
        (PromptTask(task_id="a", group_size=4, data={"prompt": "1+1", "answer": "2"}, is_eval=True), decode_prompt),
        (episode(), decode_episode),
        (SampleRejected(task_id="a", sample_idx=1, group_size=2, reason="rejected"), decode_episode),
        (TaskFailed(task_id="a", group_size=2, reason="bad"), decode_scored),
        (ScoredEpisode(episode=episode(), reward=1.0), decode_scored),
        (GroupDropped(task_id="a", reason="all_rejected"), decode_group),
    ],
)
def test_messages_round_trip(message: msgspec.Struct, decoder) -> None:
    decoded = decoder(encode(message))
    assert type(decoded) is type(message)
    assert msgspec.to_builtins(decoded) == msgspec.to_builtins(message)


def one_group(**fields: Any) -> EmittedGroup:
    return EmittedGroup(task_id="a", group_size=1, sample_idx=[0], **fields)


def test_emitted_group_round_trip_keeps_tensors() -> None:
    tensors_in = trajectory()
    batch = one_group(packed=pack_tensor_dict(tensors_in))
    decoded = decode_group(encode(batch))
    assert isinstance(decoded, EmittedGroup)
    out = group_tensors(decoded)
    assert all(torch.equal(out[k], tensors_in[k]) for k in tensors_in)


def test_every_message_carries_the_schema_version_of_its_kind() -> None:
    raw = msgspec.msgpack.decode(encode(episode()))
    assert raw["schema_version"] == 1 <= SCHEMA_VERSION  # episodes have not changed since 1
    assert raw["kind"] == "episode"
    batch = one_group(packed=pack_tensor_dict({}))
    assert msgspec.msgpack.decode(encode(batch))["schema_version"] == SCHEMA_VERSION == 3


@pytest.mark.parametrize("version", [1, 2])
def test_groups_written_before_version_3_are_refused_naming_their_version(version: int) -> None:
    raw = msgspec.msgpack.decode(encode(one_group(packed=pack_tensor_dict(trajectory()))))
    with pytest.raises(WireDecodeError, match=f"unsupported schema_version {version} of a EmittedGroup .*knows 3..3"):
        decode_group(msgspec.msgpack.encode({**raw, "schema_version": version}))


def test_a_group_cannot_count_more_rejected_and_failed_samples_than_its_group_has() -> None:
    with pytest.raises(ValueError, match="group of 2 samples has 2 rejected and 1 failed"):
        EmittedGroup(task_id="a", group_size=2, sample_idx=[0], rejected=2, failed=1, packed=pack_tensor_dict({}))


# Records of ``batches`` as every version-3 writer encodes them (an emitted group of 2 of its
# 3 samples, one rejected, and a stale drop): the bytes a replay of an existing topic reads.
OLD_EMITTED_GROUP = bytes.fromhex(
    "de0011a46b696e64a56261746368ae736368656d615f76657273696f6e03a77461736b5f6964a670303a303a37"
    "aa67726f75705f73697a6503aa73616d706c655f696478920002a769735f6576616cc2af747261696e65725f76"
    "657273696f6e05b5747261696e65725f76657273696f6e5f6b6e6f776ec3ac686561645f76657273696f6e03ac"
    "7461696c5f76657273696f6e04a97374616c656e65737302aa656d69747465645f6174cb41d954fc40200000a6"
    "7061636b65649492a9696e7075745f696473a77265776172647392a5696e743332a7666c6f61743332929202039102"
    "c4200b0000000c0000000d0000001500000016000000000000000000803f00000000a872656a656374656401a666"
    "61696c656400a6696d6167657390aa726f775f696d6167657390"
)
OLD_GROUP_DROPPED = bytes.fromhex(
    "88a46b696e64a764726f70706564a77461736b5f6964a670303a303a38a6726561736f6ea57374616c65a769735f"
    "6576616cc2a664657461696ca0af747261696e65725f76657273696f6e05aa64726f707065645f6174cb00000000"
    "00000000ae736368656d615f76657273696f6e01"
)


def test_records_already_on_batches_decode_and_encode_to_the_same_bytes() -> None:
    group = decode_group(OLD_EMITTED_GROUP)
    assert isinstance(group, EmittedGroup)
    assert (group.task_id, group.group_size, group.sample_idx, group.rejected, group.failed) == ("p0:0:7", 3, [0, 2], 1, 0)
    assert (group.trainer_version, group.head_version, group.tail_version, group.staleness) == (5, 3, 4, 2)
    arrays = group_arrays(group)
    assert arrays["input_ids"].tolist() == [[11, 12, 13], [21, 22, 0]]
    assert arrays["rewards"].tolist() == [1.0, 0.0]
    assert encode(group) == OLD_EMITTED_GROUP  # the tag stays "batch", the version 3
    dropped = decode_group(OLD_GROUP_DROPPED)
    assert isinstance(dropped, GroupDropped) and (dropped.task_id, dropped.reason) == ("p0:0:8", "stale")
    assert encode(dropped) == OLD_GROUP_DROPPED


def bad_messages() -> list[tuple[str, bytes]]:
    good = encode(episode())
    raw = msgspec.msgpack.decode(good)
    cases = {
        "truncated": good[: len(good) // 2],
        "random": b"\x93\x01\xff\x00garbage",
        "empty": b"",
        "newer schema": msgspec.msgpack.encode({**raw, "schema_version": SCHEMA_VERSION + 1}),
        "unknown kind": msgspec.msgpack.encode({**raw, "kind": "mystery"}),
        "wrong kind for topic": encode(PromptTask(task_id="a", group_size=1, data={})),
        # the types refuse to build these, so a tier cannot write them: hostile bytes only
        "negative group size": msgspec.msgpack.encode({**raw, "group_size": -3}),
        "huge group size": msgspec.msgpack.encode({**raw, "group_size": 10**9}),
        "sample index out of range": msgspec.msgpack.encode({**raw, "sample_idx": 5}),
        "empty task id": msgspec.msgpack.encode({**raw, "task_id": ""}),
    }
    t = trajectory()
    t["logprobs"][0, 3] = float("nan")
    cases["nan logprobs"] = encode(episode(trajectory=encode_tensor_dict(t)))
    t = trajectory()
    t["logprobs"][0, 4] = float("inf")
    cases["inf logprobs"] = encode(episode(trajectory=encode_tensor_dict(t)))
    t = trajectory()
    t["logprobs"] = t["logprobs"][:, :3].contiguous()
    cases["length mismatch"] = encode(episode(trajectory=encode_tensor_dict(t)))
    wire = encode_tensor_dict(trajectory())
    wire["input_ids"] = WireTensor("int32", [1, 6], memoryview(b"\x00" * 7))
    cases["byte count"] = encode(episode(trajectory=wire))
    wire = encode_tensor_dict(trajectory())
    wire["input_ids"] = WireTensor("complex128", [1, 6], memoryview(b"\x00" * 96))
    cases["unknown dtype"] = encode(episode(trajectory=wire))
    return list(cases.items())


@pytest.mark.parametrize("name, data", bad_messages())
def test_bad_input_raises_one_error_type_with_a_reason(name: str, data: bytes) -> None:
    with pytest.raises(WireDecodeError) as info:
        decode_episode(data)
    assert info.value.reason


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_any_decoder(data: bytes) -> None:
    for decoder in DECODERS:
        try:
            decoder(data)
        except WireDecodeError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_truncated_and_corrupted_messages_raise_wire_errors(position: int, flip: int) -> None:
    good = bytearray(encode(ScoredEpisode(episode=episode(), reward=0.5)))
    corrupted = bytes(good[: position % len(good)])
    mutated = bytearray(good)
    mutated[position % len(good)] ^= flip
    for data in (corrupted, bytes(mutated)):
        try:
            decode_scored(data)
        except WireDecodeError:
            pass


def test_tombstone_is_an_error_not_a_crash() -> None:
    with pytest.raises(WireDecodeError, match="tombstone"):
        decode_scored(None)


def test_dead_letter_holds_raw_bytes() -> None:
    letter = DeadLetter(tier="reward", source_topic="x", partition=0, offset=3, key=b"k", value=b"\x00\x01", reason="bad")
    assert msgspec.msgpack.decode(encode(letter), type=DeadLetter) == letter


@pytest.mark.parametrize("fields, why", [
    ({"group_size": 0}, "sample_idx 0 outside"), ({"sample_idx": 4, "group_size": 4}, "sample_idx 4 outside 0..3"),
])
def test_a_message_its_readers_would_refuse_cannot_be_built(fields: dict[str, int], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        episode(**fields)


def test_the_wire_modules_import_each_other_in_one_direction() -> None:
    """``dtypes`` <- ``tensor_codec`` <- ``packed`` <- ``messages`` <- ``codec`` <-
    ``torch_tensors``: no import, at module level or inside a function, closes a circle, and
    only the torch face imports torch."""
    order = ["dtypes", "tensor_codec", "packed", "messages", "codec", "torch_tensors"]
    wire = Path(rollstream.wire.__file__).parent
    assert sorted(p.stem for p in wire.glob("*.py")) == sorted([*order, "__init__"])
    for module in order:
        for node in ast.walk(ast.parse((wire / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollstream.wire"):
                imported = node.module.removeprefix("rollstream.wire").lstrip(".")
                for name in [imported] if imported else [a.name if a.name in order else "__init__" for a in node.names]:
                    assert name in order[: order.index(module)], f"{module} imports rollstream.wire's {name}"
            if isinstance(node, (ast.Import, ast.ImportFrom)) and module != "torch_tensors":
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] == "torch" for n in names), f"{module} imports torch"
