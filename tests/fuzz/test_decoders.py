"""Every ``rollstream.wire`` decoder against hostile bytes: only ``WireDecodeError``, with a reason.

An input either decodes into a message that satisfies the checks its decoder promises (so a
tier can trust it), or raises ``WireDecodeError``. No other exception type, no crash, whatever
the bytes. Structured cases check the oracle both ways: an invalid field is refused, a valid
one is accepted.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.strategies import (
    BUDGET,
    FLOATS,
    INTS,
    as_dict,
    broken_bytes,
    episode,
    float32,
    float_tensor,
    raw,
    valid_messages,
)
from rollstream.wire import (
    EmittedGroup,
    Episode,
    ScoredEpisode,
    WireDecodeError,
    decode_cursor,
    decode_dead_letter,
    decode_episode,
    decode_group,
    decode_outcome,
    decode_prompt,
    decode_scored,
    encode,
)
from rollstream.wire.codec import MAX_MESSAGE_BYTES
from rollstream.wire.messages import MAX_GROUP_SIZE
from rollstream.wire.messages import OLDEST_READABLE, SCHEMA_VERSION
from rollstream.wire.torch_tensors import group_tensors, decode_tensor_dict, encode_tensor


DECODERS = {
    "prompt": decode_prompt, "episode": decode_episode, "rejected": decode_episode,
    "task_failed": decode_episode, "scored": decode_scored, "batch": decode_group, "dropped": decode_group,
    "dead_letter": decode_dead_letter, "outcome": decode_outcome, "cursor": decode_cursor,
}
VALID = valid_messages()


def decode_or_reason(decoder: Any, data: bytes | None) -> Any:
    """The decoded message, or the ``WireDecodeError`` (any other exception fails the test)."""
    try:
        message = decoder(data)
    except WireDecodeError as exc:
        assert exc.reason, "a WireDecodeError without a reason"
        return exc
    check_promises(message)
    return message


def check_promises(message: Any) -> None:
    """What a tier relies on after a successful decode."""
    episode_ = message.episode if isinstance(message, ScoredEpisode) else message
    if isinstance(message, ScoredEpisode):
        assert math.isfinite(message.reward)
    if isinstance(episode_, Episode):
        assert 1 <= episode_.group_size <= MAX_GROUP_SIZE and 0 <= episode_.sample_idx < episode_.group_size
        tensors = decode_tensor_dict(episode_.trajectory)  # must not raise
        shape = tensors["input_ids"].shape
        assert all(t.shape == shape for k, t in tensors.items() if k != "rewards")
        if "logprobs" in tensors:
            assert bool(tensors["logprobs"].isfinite().all())
    if isinstance(message, EmittedGroup):
        group_tensors(message)  # must not raise
    if hasattr(message, "schema_version"):
        assert 1 <= message.schema_version <= SCHEMA_VERSION


@pytest.mark.parametrize("kind", sorted(VALID))
def test_valid_messages_decode(kind: str) -> None:
    assert not isinstance(decode_or_reason(DECODERS[kind], VALID[kind]), WireDecodeError)


@pytest.mark.parametrize("kind", sorted(VALID))
@settings(**BUDGET)
@given(data=st.data())
def test_broken_bytes_raise_only_wire_errors(kind: str, data: st.DataObject) -> None:
    blob = data.draw(broken_bytes(VALID[kind]))
    for decoder in set(DECODERS.values()):  # every decoder, not only the one of this kind
        decode_or_reason(decoder, blob)


@pytest.mark.parametrize("decoder", sorted(set(DECODERS.values()), key=lambda d: d.__name__))
def test_empty_tombstone_and_oversize_are_refused(decoder: Any) -> None:
    for data in (None, b""):
        assert isinstance(decode_or_reason(decoder, data), WireDecodeError)
    oversize = decode_or_reason(decoder, bytes(MAX_MESSAGE_BYTES + 1))
    assert isinstance(oversize, WireDecodeError) and "exceeds" in oversize.reason


@settings(**BUDGET)
@given(version=INTS, kind=st.sampled_from(sorted(VALID)))
def test_schema_version_outside_what_the_reader_knows_is_refused(version: int, kind: str) -> None:
    fields = as_dict(VALID[kind]) | {"schema_version": version}
    result = decode_or_reason(DECODERS[kind], raw(fields))
    oldest = OLDEST_READABLE.get(type(DECODERS[kind](VALID[kind])), 1)  # batches: 3
    assert isinstance(result, WireDecodeError) == (not oldest <= version <= SCHEMA_VERSION)


@settings(**BUDGET)
@given(kind=st.text(max_size=12), decoder_kind=st.sampled_from(sorted(VALID)))
def test_unknown_message_kind_is_refused(kind: str, decoder_kind: str) -> None:
    fields = as_dict(VALID[decoder_kind]) | {"kind": kind}
    result = decode_or_reason(DECODERS[decoder_kind], raw(fields))
    if kind != decoder_kind:
        known_here = {k for k, d in DECODERS.items() if d is DECODERS[decoder_kind]}
        assert isinstance(result, WireDecodeError) or kind in known_here


@settings(**BUDGET)
@given(group_size=INTS, sample_idx=INTS)
def test_group_size_and_sample_index_ranges(group_size: int, sample_idx: int) -> None:
    fields = as_dict(VALID["episode"]) | {"group_size": group_size, "sample_idx": sample_idx}
    ok = 1 <= group_size <= MAX_GROUP_SIZE and 0 <= sample_idx < group_size
    assert isinstance(decode_or_reason(decode_episode, raw(fields)), WireDecodeError) != ok
    scored = {"kind": "scored", "episode": {k: v for k, v in fields.items() if k != "kind"}, "reward": 1.0}
    assert isinstance(decode_or_reason(decode_scored, raw(scored)), WireDecodeError) != ok
    prompt = as_dict(VALID["prompt"]) | {"group_size": group_size}
    assert isinstance(decode_or_reason(decode_prompt, raw(prompt)), WireDecodeError) != (1 <= group_size <= MAX_GROUP_SIZE)


@settings(**BUDGET)
@given(values=st.lists(FLOATS, min_size=1, max_size=8), tokens=st.integers(1, 8))
def test_logprobs_length_and_finiteness(values: list[float], tokens: int) -> None:
    ep = episode()
    trajectory = dict(ep.trajectory)
    for key in ("input_ids", "attention_mask", "loss_mask", "versions"):
        trajectory.pop(key)
    trajectory["input_ids"] = encode_tensor(torch.arange(tokens, dtype=torch.int32).unsqueeze(0))
    trajectory["attention_mask"] = encode_tensor(torch.ones(1, tokens, dtype=torch.bool))
    trajectory["logprobs"] = float_tensor(values)
    data = encode(msgspec.structs.replace(ep, trajectory=trajectory))
    ok = len(values) == tokens and all(math.isfinite(v) for v in float32(values))
    result = decode_or_reason(decode_episode, data)
    assert isinstance(result, WireDecodeError) != ok, (values, tokens, result)
    if not ok:
        assert ("shape" in result.reason) or ("NaN" in result.reason), result.reason


@settings(**BUDGET)
@given(reward=FLOATS)
def test_scored_reward_must_be_finite(reward: float) -> None:
    data = raw(as_dict(encode(ScoredEpisode(episode=episode(), reward=0.0))) | {"reward": reward})
    assert isinstance(decode_or_reason(decode_scored, data), WireDecodeError) != math.isfinite(reward)


@settings(**BUDGET)
@given(dtype=st.sampled_from(["int32", "int64", "float32", "bool", "complex64", "", "uint8"]),
       shape=st.lists(st.integers(-2, 6), max_size=3), nbytes=st.integers(0, 64))
def test_inconsistent_tensors_are_refused(dtype: str, shape: list[int], nbytes: int) -> None:
    fields = as_dict(VALID["episode"])
    fields["trajectory"]["versions"] = [dtype, shape, bytes(nbytes)]
    decode_or_reason(decode_episode, raw(fields))  # a wire error or a consistent message


@settings(**BUDGET)
@given(keys=st.lists(st.sampled_from(["a", "b", "c", ""]), max_size=4),
       dtypes=st.lists(st.sampled_from(["int32", "bool", "bfloat16", "float64", "complex64", ""]), max_size=4),
       shapes=st.lists(st.lists(st.integers(-2, 5), max_size=3), max_size=4), nbytes=st.integers(0, 256))
def test_inconsistent_packed_tensors_are_refused(
    keys: list[str], dtypes: list[str], shapes: list[list[int]], nbytes: int,
) -> None:
    batch = as_dict(VALID["batch"])
    batch["packed"] = [keys, dtypes, shapes, bytes(nbytes)]
    decode_or_reason(decode_group, raw(batch))  # a wire error or a consistent message
