"""The reference template with scripted rejections and failures, and other return forms.

``ScriptedTemplate`` runs the unchanged ``MyWorkflow`` and then:

* returns ``None`` for the samples listed in ``data["reject"]`` and raises for those listed in
  ``data["fail"]`` (by ``workflow_context.sample_idx``), before generating;
* reshapes the template's return as ``form`` says, the forms a reference workflow may return:
  ``"reward"`` (the template's own), ``"rewards"`` (the key renamed), ``"int64"`` (the full
  ``[1, L]`` form with torch's default dtypes: int64 ids/masks/versions, float64 logprobs) and
  ``"no_attention_mask"`` (the full form as ``[L]`` tensors without ``attention_mask``).
"""

from __future__ import annotations

from typing import Any

import torch

from rollstream.api.context import workflow_context
from rollstream.api.io_struct import ModelRequest, ModelResponse
from tests.workflow_pkg.reference_template import MyWorkflow

FORMS = ("reward", "rewards", "int64", "no_attention_mask")


class _Remember:
    """Passes ``agenerate`` through and keeps the last response (for the full forms)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.response: ModelResponse | None = None

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.response = await self.engine.agenerate(req)
        return self.response


class ScriptedTemplate(MyWorkflow):
    def __init__(self, gconfig: Any, tokenizer: Any, reward_fn: Any, form: str = "reward") -> None:
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        super().__init__(gconfig, tokenizer, reward_fn)
        self.form = form

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        sample = workflow_context.sample_idx
        if sample in data.get("reject", []):
            return None
        if sample in data.get("fail", []):
            raise RuntimeError(f"scripted failure of sample {sample}")
        remember = _Remember(engine)
        result = await super().arun_episode(remember, data)  # type: ignore[arg-type]
        assert remember.response is not None
        return self._reshaped(result, remember.response)

    def _reshaped(self, result: dict[str, torch.Tensor], resp: ModelResponse) -> dict[str, torch.Tensor]:
        if self.form == "reward":
            return result
        if self.form == "rewards":
            result["rewards"] = result.pop("reward")
            return result
        prompt, output = len(resp.input_tokens), len(resp.output_tokens)
        full = {
            "input_ids": torch.tensor(resp.input_tokens + resp.output_tokens),
            "loss_mask": torch.tensor([0] * prompt + [1] * output),
            "logprobs": torch.tensor([0.0] * prompt + resp.output_logprobs, dtype=torch.float64),
            "versions": torch.tensor([-1] * prompt + resp.output_versions),
            "rewards": result["reward"].double(),
        }
        if self.form == "no_attention_mask":
            return full
        full["attention_mask"] = torch.ones(prompt + output, dtype=torch.int64)
        return {key: value.unsqueeze(0) for key, value in full.items()}
