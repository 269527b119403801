# The reference system's guide to adding a workflow ("Create `<name>.py`" under its workflow
# package) shows this template. It is reproduced here with its import lines changed and ONE
# argument added, `return_dict=False` (marked below): the guide was written for transformers 4,
# and in transformers 5 `apply_chat_template(..., tokenize=True)` returns a BatchEncoding, whose
# `list()` is its keys, so the guide's line sends ['input_ids', 'attention_mask'] as a prompt,
# in the reference system as here (tests/unit/test_request_check.py shows the refusal).
# It proves that such a workflow runs on rollstream otherwise unchanged
# (tests/integration/test_reference_workflow.py, docs/WORKFLOWS.md). Do not edit below the imports.
import uuid
from typing import Any, Callable

import torch

from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import ModelRequest, ModelResponse
from rollstream.rewards.wrapper import AsyncRewardWrapper
from rollstream.api.workflow import RolloutWorkflow
import logging

logger = logging.getLogger("MyWorkflow")


class MyWorkflow(RolloutWorkflow):
    """Description of your workflow."""

    def __init__(
        self,
        gconfig: GenerationHyperparameters,
        tokenizer,
        reward_fn: Callable,
    ):
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.tokenizer = tokenizer
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)

    async def arun_episode(
        self,
        engine: InferenceEngine,
        data: dict[str, Any],
    ) -> dict[str, torch.Tensor]:
        """Run a single episode. MUST be async and non-blocking."""

        # 1. Prepare input_ids from data
        input_ids = self.tokenizer.apply_chat_template(
            data["messages"],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,  # not in the guide: transformers 5 (see the top of this file)
        )

        # 2. Build ModelRequest
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=list(input_ids),
            gconfig=self.gconfig.new(n_samples=1),
            tokenizer=self.tokenizer,
        )

        # 3. Generate completion (async)
        resp: ModelResponse = await engine.agenerate(req)

        # 4. Compute reward (async)
        prompt_str = self.tokenizer.decode(input_ids)
        completion_str = self.tokenizer.decode(resp.output_tokens)
        reward = await self.async_reward_fn(
            prompt_str,
            completion_str,
            resp.input_tokens,
            resp.output_tokens,
            **data,
        )

        # 5. Return results in expected format
        return {
            "input_ids": torch.tensor(resp.input_tokens),
            "output_ids": torch.tensor(resp.output_tokens),
            "reward": torch.tensor(reward),
        }
