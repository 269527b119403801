"""The layouts trainers consume, from a :class:`~rollstream.trainer.training_step.TrainingStep`.

- **padded** ``[N, L]``: ``step.tensors`` as is (right-padded; see ``TrainingStep``).
- **packed / varlen** (:func:`pack`): every row's attended positions one after the other,
  ``[T]``, with ``cu_seqlens`` (int32 ``[N + 1]``, row ``i`` is ``cu_seqlens[i]:cu_seqlens[i+1]``),
  ``max_seqlen`` and ``position_ids`` (int64 ``[T]``, restarting at 0 in each row): what
  flash-attention's varlen kernels take. Per-row tensors (``rewards``) stay ``[N]``.
- **AReaL** (:func:`to_areal`): the dict AReaL's PPO actor reads (``input_ids``,
  ``attention_mask``, ``loss_mask``, ``logprobs``, ``versions``, ``rewards``; right-padded),
  or its packed form, where ``attention_mask`` gives way to ``cu_seqlens`` and ``max_seqlen``
  (AReaL's ``pack_tensor_dict``).
- **verl** (:func:`to_verl`): a ``DataProto``'s parts, prompts LEFT-padded and responses
  right-padded as verl's rollout produces them: ``prompts``, ``responses``, ``input_ids``,
  ``attention_mask``, ``position_ids``, ``response_mask`` (int64), ``old_log_probs`` and
  ``rollout_log_probs`` (float32, the behaviour policy's logprobs of the response tokens),
  ``token_level_scores`` / ``token_level_rewards`` (the row's reward on its last response
  token), and ``uid`` (the group's task id, what verl's GRPO groups by) in the non-tensor part.

Field names follow those projects' sources; nothing here imports them.
``tests/unit/test_trainer_layouts_reference.py`` runs both against the real packages (verl
0.9.1, areal 1.0.4): verl's GRPO advantage and policy loss, AReaL's normalisation, packing and
actor loss on these layouts agree with the example trainer (``rollstream.trainer.grpo``); where
they cannot (verl's Bessel-corrected std, AReaL's fixed-size groups) docs/TRAINER.md says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
from torch import Tensor

from rollstream.trajectory.rows import ROW_KEYS
from rollstream.trainer.training_step import TrainingStep

AREAL_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards")


def pack(tensors: dict[str, Tensor]) -> dict[str, Any]:
    """The packed (varlen) form of a padded dict (see the module docstring).

    ``attention_mask`` must mark each row's attended positions as one run from position 0
    (right padding, as every rollstream step has); other layouts raise ``ValueError``."""
    mask = tensors["attention_mask"].bool()
    lengths = mask.sum(dim=1)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    if not torch.equal(mask, positions < lengths.unsqueeze(1)):
        raise ValueError("pack() needs right-padded rows (attended positions first, then padding)")
    cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    packed: dict[str, Any] = {}
    sequence = {k for k, v in tensors.items() if v.dim() >= 2 and v.shape[:2] == mask.shape}
    for key, value in tensors.items():
        if key == "attention_mask":
            continue
        packed[key] = value[mask] if key in sequence else value.clone()
    packed["cu_seqlens"] = cu_seqlens
    packed["max_seqlen"] = int(lengths.max().item()) if lengths.numel() else 0
    packed["position_ids"] = positions[mask].to(torch.int64)
    return packed


def unpack(packed: dict[str, Any], pad_value: float = 0.0, row_keys: tuple[str, ...] = ROW_KEYS) -> dict[str, Tensor]:
    """The padded form again (``versions`` padded with -1, ``attention_mask`` rebuilt);
    ``row_keys`` are the per-row tensors, left as they are."""
    cu = packed["cu_seqlens"].tolist()
    rows = len(cu) - 1
    lengths = [cu[i + 1] - cu[i] for i in range(rows)]
    width = max(lengths, default=0)
    mask = torch.arange(width).expand(rows, width) < torch.tensor(lengths).unsqueeze(1)
    total = cu[-1]
    out: dict[str, Tensor] = {"attention_mask": mask}
    for key, value in packed.items():
        if key in ("cu_seqlens", "max_seqlen", "position_ids"):
            continue
        if key not in row_keys and torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == total:
            fill = -1 if key == "versions" else pad_value
            padded = torch.full((rows, width, *value.shape[1:]), fill, dtype=value.dtype)
            padded[mask] = value
            out[key] = padded
        else:
            out[key] = value
    return out


def to_areal(step: TrainingStep, packed: bool = False) -> dict[str, Any]:
    """The dict AReaL's PPO actor consumes (``compute_advantages`` / ``ppo_update`` read these
    keys), padded, or packed as AReaL packs it (``cu_seqlens`` and ``max_seqlen`` instead of
    ``attention_mask``). Fresh tensors; dtypes those of AReaL's rollout workflows."""
    missing = [k for k in AREAL_KEYS if k not in step.tensors]
    if missing:
        raise KeyError(f"the step lacks {missing}, which AReaL's actor reads")
    dtypes = {"input_ids": torch.int32, "attention_mask": torch.bool, "loss_mask": torch.int32,
              "logprobs": torch.float32, "versions": torch.int32, "rewards": torch.float32}
    data = {k: step.tensors[k].to(dtypes[k]).clone() for k in AREAL_KEYS}
    if not packed:
        return data
    out = pack(data)
    del out["position_ids"]  # AReaL's pack derives positions itself
    return out


@dataclass
class VerlBatch:
    """The three parts of a verl ``DataProto``: ``DataProto.from_dict(tensors=batch.tensors,
    non_tensors=batch.non_tensors, meta_info=batch.meta_info)`` (or :meth:`to_dataproto`)."""

    tensors: dict[str, Tensor]
    non_tensors: dict[str, numpy.ndarray]
    meta_info: dict[str, Any] = field(default_factory=dict)

    def to_dataproto(self) -> Any:
        """A ``verl.DataProto`` (needs verl installed)."""
        from verl import DataProto  # only where verl is

        return DataProto.from_dict(tensors=self.tensors, non_tensors=self.non_tensors, meta_info=self.meta_info)


def _response_start(loss_mask: Tensor, lengths: Tensor) -> Tensor:
    """Per row: the first generated position, or the row's length when it generated nothing."""
    generated = loss_mask.bool()
    first = torch.argmax(generated.to(torch.int8), dim=1)
    return torch.where(generated.any(dim=1), first, lengths)


def to_verl(step: TrainingStep, pad_token_id: int = 0) -> VerlBatch:
    """The layout verl's PPO/GRPO trainer consumes (see the module docstring).

    A row's prompt is everything before its first generated token, its response everything
    from there to its end; ``response_mask`` is the step's ``loss_mask`` over the response,
    so tokens inside a response that were not generated (a multi-turn retry prompt) stay out
    of the loss. Position ``j`` of ``old_log_probs`` is the logprob of ``responses[:, j]``."""
    t = step.tensors
    mask = t["attention_mask"].bool()
    lengths = mask.sum(dim=1)
    starts = _response_start(t["loss_mask"], lengths)
    prompt_len, response_len = int(starts.max().item()), int((lengths - starts).max().item())
    # prompt column j of a row shows its token start - prompt_len + j (left padding before the
    # prompt), response column j its token start + j (right padding after the row's end)
    prompt_at = starts.unsqueeze(1) - prompt_len + torch.arange(prompt_len)
    response_at = starts.unsqueeze(1) + torch.arange(response_len)
    prompt_mask = (prompt_at >= 0).to(torch.int64)
    response_attn = (response_at < lengths.unsqueeze(1)).to(torch.int64)

    def take(key: str, at: Tensor, shown: Tensor, fill: float, dtype: torch.dtype) -> Tensor:
        return torch.where(shown.bool(), t[key].gather(1, at.clamp(0, mask.shape[1] - 1)), fill).to(dtype)

    prompts = take("input_ids", prompt_at, prompt_mask, pad_token_id, torch.int64)
    responses = take("input_ids", response_at, response_attn, pad_token_id, torch.int64)
    response_mask = take("loss_mask", response_at, response_attn, 0, torch.int64)
    logprobs = take("logprobs", response_at, response_attn, 0.0, torch.float32)
    versions = (take("versions", response_at, response_attn, -1, torch.int32) if "versions" in t
                else torch.full(response_at.shape, -1, dtype=torch.int32))
    last = response_at == (lengths - 1).unsqueeze(1)  # the reward sits on a row's last response token
    scores = torch.where(last, t["rewards"].unsqueeze(1).to(torch.float32), 0.0)
    attention = torch.cat([prompt_mask, response_attn], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0),
        "response_mask": response_mask,
        "old_log_probs": logprobs,
        "rollout_log_probs": logprobs.clone(),
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
        "response_versions": versions,
    }
    uid = numpy.array([step.task_ids[i] for i in step.row_task], dtype=object)
    meta = {"global_token_num": attention.sum(dim=1).tolist()}
    return VerlBatch(tensors, {"uid": uid}, meta)
