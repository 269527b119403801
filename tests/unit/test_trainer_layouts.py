"""The layouts trainers consume: packed/varlen, AReaL's padded and packed dicts, verl's DataProto parts."""

from __future__ import annotations

import torch

from harness.group_rows import group, row
from rollstream.trainer import TrainingStep, assemble, pack, to_areal, to_verl, unpack


def batch() -> TrainingStep:
    return assemble([
        group("a", [row([5, 6, 7], [([11, 12], True)], 2, 1.0), row([5, 6, 7], [([13], True)], 2, 0.0)]),
        group("b", [row([8], [([21], True), ([30, 31], False), ([22, 23, 24], True)], 3, 0.5)]),
    ])


def test_pack_keeps_attended_positions_with_boundaries_and_positions() -> None:
    b = batch()
    packed = pack(b.tensors)
    assert packed["cu_seqlens"].tolist() == [0, 5, 9, 16] and packed["cu_seqlens"].dtype == torch.int32
    assert packed["max_seqlen"] == 7
    assert packed["input_ids"].tolist() == [5, 6, 7, 11, 12, 5, 6, 7, 13, 8, 21, 30, 31, 22, 23, 24]
    assert packed["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]
    assert packed["rewards"].tolist() == [1.0, 0.0, 0.5]  # per-row tensors stay [N]
    assert "attention_mask" not in packed
    again = unpack(packed)
    for key, value in b.tensors.items():
        assert torch.equal(again[key], value), key


def test_pack_refuses_left_padding() -> None:
    t = batch().tensors
    t["attention_mask"] = t["attention_mask"].flip(1)
    try:
        pack(t)
    except ValueError as exc:
        assert "right-padded" in str(exc)
    else:
        raise AssertionError("left padding was packed")


def test_areal_padded_and_packed() -> None:
    b = batch()
    padded = to_areal(b)
    assert sorted(padded) == ["attention_mask", "input_ids", "logprobs", "loss_mask", "rewards", "versions"]
    assert padded["attention_mask"].dtype == torch.bool and padded["input_ids"].dtype == torch.int32
    assert torch.equal(padded["loss_mask"], b.tensors["loss_mask"])
    padded["input_ids"][0, 0] = -7  # fresh tensors
    assert b.tensors["input_ids"][0, 0] == 5
    packed = to_areal(b, packed=True)
    # AReaL's packed form: attention_mask replaced by cu_seqlens (int32 [B+1]) and max_seqlen
    assert "attention_mask" not in packed and packed["cu_seqlens"].tolist() == [0, 5, 9, 16]
    assert packed["max_seqlen"] == 7 and packed["versions"].shape == (16,)


def test_verl_left_pads_prompts_and_aligns_responses() -> None:
    b = batch()
    v = to_verl(b, pad_token_id=0)
    t = v.tensors
    # prompts are left-padded to the longest prompt (3), responses right-padded to the longest (6)
    assert t["prompts"].tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8]]
    assert t["responses"].tolist() == [[11, 12, 0, 0, 0, 0], [13, 0, 0, 0, 0, 0], [21, 30, 31, 22, 23, 24]]
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    assert t["attention_mask"].tolist()[2] == [0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert t["position_ids"].tolist()[2] == [0, 0, 0, 1, 2, 3, 4, 5, 6]  # verl: cumsum(mask) - 1, clipped
    # the retry prompt inside the response stays out of the loss
    assert t["response_mask"].tolist() == [[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 0, 0, 1, 1, 1]]
    # old_log_probs[:, j] is the behaviour logprob of responses[:, j]
    assert torch.allclose(t["old_log_probs"][0, :2], torch.tensor([-0.11, -0.12])) and t["old_log_probs"][2, 1] == 0.0
    assert torch.allclose(t["old_log_probs"][2, 3:], torch.tensor([-0.22, -0.23, -0.24]))
    assert torch.equal(t["rollout_log_probs"], t["old_log_probs"])
    assert t["token_level_rewards"].tolist() == [[0, 1.0, 0, 0, 0, 0], [0] * 6, [0, 0, 0, 0, 0, 0.5]]
    assert t["response_versions"].tolist()[2] == [3, -1, -1, 3, 3, 3]
    assert all(x.dtype == torch.int64 for k, x in t.items() if k in ("input_ids", "attention_mask", "position_ids", "responses"))
    assert list(v.non_tensors["uid"]) == ["a", "a", "b"]  # GRPO groups rows by uid
    assert v.meta_info["global_token_num"] == [5, 4, 7]
