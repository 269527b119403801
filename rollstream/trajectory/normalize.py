"""What a workflow returned, made into the standard trajectory dict, losslessly or not at all.

:func:`episode_tensors` is the one conversion every path uses (the rollout worker before it
publishes an episode, ``rollstream.testing`` when it checks a workflow). Callers may rely on:

* ``None`` is never passed in (a rejection is not a result); a dict of ``Interaction`` becomes
  one row per interaction (:func:`interactions_to_tensors`).
* ``reward`` is taken as ``rewards``.
* AReaL's guide form ``{"input_ids": prompt, "output_ids": completion, ...}`` (each
  ``[L]`` or ``[1, L]``) becomes one standard row: prompt then completion in ``input_ids``,
  ``loss_mask`` 1 on the completion, ``attention_mask`` ones, and ``logprobs``/``versions``
  from the engine response of this episode whose prompt and output are exactly these tokens
  (none matching: the row has no ``logprobs``/``versions``; nothing is invented).
* A missing batch dimension is added (``[L]`` sequence keys -> ``[1, L]``, a 0-dim ``rewards``
  or ``is_truncated`` -> ``[1]``); a missing ``attention_mask`` of a one-row dict is all ones.
* Known keys get the dtypes of ``rollstream.trajectory.rows.trajectory_dtypes`` when every value
  converts exactly (int64 ids -> int32, 0/1 ints -> bool, float64 that float32 holds exactly...).
* Vision inputs (``multi_modal_input``, ``pixel_values``, ``image_grid_thw``,
  ``rollstream.vision.inputs.VISION_RESULT_KEYS``) are left out: the rollout worker ships the
  encoded images the engine saw instead, and the trainer side rebuilds them (docs/ARCHITECTURE.md).
* Anything else that is not standard raises :class:`TrajectoryError` with one message naming
  the key, what was found and what is expected. Keys rollstream does not know pass unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rollstream.api.io_struct import ModelResponse
from rollstream.api.workflow import Interaction, is_interactions
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.trajectory.rows import (
    ROW_KEYS,
    SEQUENCE_KEYS,
    TrajectoryBuilder,
    trajectory_dtypes,
    trajectory_row,
    validate_trajectory,
)
from rollstream.vision.inputs import VISION_RESULT_KEYS


class TrajectoryError(ValueError):
    """A workflow result that cannot become a standard trajectory; the message says why."""


def episode_tensors(result: Any, responses: Sequence[ModelResponse] = ()) -> dict[str, Tensor]:
    """The standard, validated trajectory of a non-``None`` workflow ``result``.

    ``responses`` are the engine responses the episode received, oldest first (used only by
    the ``output_ids`` form). Raises :class:`TrajectoryError`.
    """
    if is_interactions(result):
        try:
            td = interactions_to_tensors(result)
        except (ValueError, TypeError) as exc:
            raise TrajectoryError(f"cannot turn interactions into tensors: {type(exc).__name__}: {exc}") from exc
    else:
        td = _tensor_dict(result)
    td = normalize_trajectory(td, responses)
    try:
        validate_trajectory(td)
    except (ValueError, TypeError) as exc:
        raise TrajectoryError(f"malformed trajectory: {exc}") from exc
    if td["input_ids"].shape[0] < 1:
        raise TrajectoryError("malformed trajectory: input_ids has no rows")
    return td


def interactions_to_tensors(interactions: dict[str, Interaction]) -> dict[str, Tensor]:
    """One row per interaction (in dict order), right-padded with :func:`concat_padded_tensors`.

    Row: ``input_ids`` = input + output tokens; ``loss_mask`` 1 on output; ``logprobs`` 0.0 and
    ``versions`` -1 on the input; ``attention_mask`` ones; ``rewards`` the interaction's reward
    (0.0 when ``None``); ``is_truncated`` when the stop reason was "length".
    """
    rows = []
    for inter in interactions.values():
        resp = inter.response
        prompt = resp.input_tokens or inter.request.input_ids
        rows.append(
            trajectory_row(
                prompt, resp.output_tokens, resp.output_logprobs, resp.output_versions,
                reward=0.0 if inter.reward is None else inter.reward,
                is_truncated=resp.stop_reason == "length",
            )
        )
    return concat_padded_tensors(rows)


def _tensor_dict(result: Any) -> dict[str, Tensor]:
    if not isinstance(result, dict) or not result:
        raise TrajectoryError(
            "workflow must return a tensor dict, a dict of Interaction, or None; "
            f"got {type(result).__name__}{' (empty)' if isinstance(result, dict) else ''}"
        )
    result = {k: v for k, v in result.items() if k not in VISION_RESULT_KEYS}
    for key, value in result.items():
        if not isinstance(value, Tensor):
            raise TrajectoryError(
                f"trajectory key {key!r} is a {type(value).__name__}; only tensors travel on episodes"
            )
    return {key: value.detach().cpu() for key, value in result.items()}


def normalize_trajectory(td: dict[str, Tensor], responses: Sequence[ModelResponse] = ()) -> dict[str, Tensor]:
    """A new dict: ``td`` in the standard form (see the module docstring), not yet validated."""
    td = dict(td)
    if "reward" in td:
        if "rewards" in td:
            raise TrajectoryError("trajectory has both 'reward' and 'rewards'; expected one of them")
        td["rewards"] = td.pop("reward")
    if "input_ids" not in td:
        raise TrajectoryError(f"trajectory lacks 'input_ids'; has {sorted(td)}")
    if "output_ids" in td:
        td = _joined_completion(td, responses)
    _add_batch_dim(td)
    for key, dtype in trajectory_dtypes.items():
        if key in td:
            td[key] = exact_dtype(key, td[key], dtype)
    if "attention_mask" not in td:
        td["attention_mask"] = _derived_attention_mask(td["input_ids"])
    return td


def exact_dtype(key: str, tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor`` as ``dtype`` when every value survives the conversion; else ``TrajectoryError``."""
    if tensor.dtype == dtype:
        return tensor
    if tensor.is_complex() or not (tensor.is_floating_point() or _is_integral(tensor.dtype)):
        raise TrajectoryError(f"trajectory key {key!r} has dtype {tensor.dtype}; expected {dtype}")
    converted = tensor.to(dtype)
    back = converted.to(tensor.dtype)
    same = back == tensor
    if tensor.is_floating_point():
        same |= torch.isnan(back) & torch.isnan(tensor)
    if not bool(same.all()):
        bad = (~same).nonzero()[0].tolist()
        where = tuple(bad)
        raise TrajectoryError(
            f"trajectory key {key!r} has dtype {tensor.dtype} and values that {dtype} cannot hold exactly "
            f"(e.g. {tensor[where].item()!r} at {list(where)} would become {converted[where].item()!r}); "
            f"expected {dtype}: convert it yourself if that change is acceptable"
        )
    return converted


def _is_integral(dtype: torch.dtype) -> bool:
    return dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)


def _as_row(key: str, tensor: Tensor) -> Tensor:
    """One episode's ``[L]`` tokens from ``[L]`` or ``[1, L]``."""
    if tensor.dim() == 2 and tensor.shape[0] == 1:
        return tensor[0]
    if tensor.dim() != 1:
        raise TrajectoryError(
            f"trajectory key {key!r} has shape {list(tensor.shape)}; with 'output_ids' one episode is "
            "expected: 'input_ids' (the prompt) and 'output_ids' (the completion) as [L] or [1, L]"
        )
    return tensor


def _joined_completion(td: dict[str, Tensor], responses: Sequence[ModelResponse]) -> dict[str, Tensor]:
    """The ``input_ids`` + ``output_ids`` form as one standard row (see the module docstring)."""
    built = [key for key in SEQUENCE_KEYS if key != "input_ids" and key in td]
    if built:
        raise TrajectoryError(
            f"trajectory has 'output_ids' and {built[0]!r}; with 'output_ids' rollstream builds "
            f"{', '.join(repr(k) for k in SEQUENCE_KEYS[1:])} itself: leave them out, or return "
            "the [B, L] form (prompt and completion in 'input_ids', with 'loss_mask') instead"
        )
    prompt = exact_dtype("input_ids", _as_row("input_ids", td.pop("input_ids")), torch.int32).tolist()
    output = exact_dtype("output_ids", _as_row("output_ids", td.pop("output_ids")), torch.int32).tolist()
    response = _matching_response(prompt, output, responses)
    builder = TrajectoryBuilder()
    builder.add_prompt(prompt)
    if response is None:
        builder.add_output(output, [0.0] * len(output), [0] * len(output))
        row = builder.to_tensors()
        del row["logprobs"], row["versions"]  # unknown without the engine's response: not invented
        return {**row, **td}
    try:
        builder.add_output(output, response.output_logprobs, response.output_versions)
    except ValueError as exc:  # an engine that broke its contract
        raise TrajectoryError(f"the engine response of this completion is inconsistent: {exc}") from exc
    return {**builder.to_tensors(), **td}


def _matching_response(prompt: list[int], output: list[int], responses: Sequence[ModelResponse]) -> ModelResponse | None:
    """The newest response that generated exactly ``output`` from exactly ``prompt``."""
    for response in reversed(responses):
        if list(response.output_tokens) == output and list(response.input_tokens) == prompt:
            return response
    return None


def _add_batch_dim(td: dict[str, Tensor]) -> None:
    ids = td["input_ids"]
    if ids.dim() == 1:
        for key in SEQUENCE_KEYS:
            if key in td:
                if td[key].dim() != 1:
                    raise TrajectoryError(
                        f"trajectory key {key!r} has shape {list(td[key].shape)} while 'input_ids' has "
                        f"{list(ids.shape)}; expected every per-token key as [L] (one episode) or every one as [B, L]"
                    )
                td[key] = td[key].unsqueeze(0)
    rows = td["input_ids"].shape[0] if td["input_ids"].dim() == 2 else None
    for key in ROW_KEYS:
        if key in td and td[key].dim() == 0 and rows == 1:
            td[key] = td[key].reshape(1)


def _derived_attention_mask(ids: Tensor) -> Tensor:
    if ids.dim() == 2 and ids.shape[0] == 1:
        return torch.ones(ids.shape, dtype=torch.bool)
    raise TrajectoryError(
        f"trajectory lacks 'attention_mask' and 'input_ids' has shape {list(ids.shape)}: which positions "
        "are padding cannot be known; expected a [B, L] bool 'attention_mask' (True on real tokens), "
        "or one episode ([L] or [1, L]) per result"
    )
