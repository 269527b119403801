"""A user's workflow written for AReaL, on AReaL's imports only, as its guide teaches.

It uses what AReaL gives a workflow at run time: ``workflow_context`` (``is_eval``,
``task_id``, ``stat_scope()``), ``stats_tracker``, ``AsyncRewardWrapper`` and session tracing
(``session_context`` / ``trace_session``). ``data["reject_all"]`` / ``data["fail_all"]`` make
every episode return ``None`` / raise, to show how each ends in AReaL's session trace. Its rows
carry ``areal_task_id`` and ``areal_is_eval`` (per row), what AReaL's context told the episode.
"""

import uuid
from typing import Any, Callable

import torch

from areal import workflow_context
from areal.api.cli_args import GenerationHyperparameters
from areal.api.engine_api import InferenceEngine
from areal.api.io_struct import ModelRequest, ModelResponse
from areal.api.reward_api import AsyncRewardWrapper
from areal.api.workflow_api import RolloutWorkflow
from areal.utils import logging, stats_tracker
from areal.utils.hf_utils import apply_chat_template
from areal.utils.perf_tracer import atrace_session_phase, session_context, trace_session

logger = logging.getLogger("UserWorkflow")


class UserWorkflow(RolloutWorkflow):
    """One answer per episode, scored in AReaL's reward pool; records what it saw of its context."""

    def __init__(self, gconfig: GenerationHyperparameters, tokenizer: Any, reward_fn: Callable[..., float]):
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.tokenizer = tokenizer
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)
        self.seen: list[tuple[bool, int | None, str]] = []  # (is_eval, task_id, stat_scope) per episode

    @trace_session("reward")
    async def _reward(self, resp: ModelResponse, data: dict[str, Any]) -> float:
        return await self.async_reward_fn(
            self.tokenizer.decode(resp.input_tokens),
            self.tokenizer.decode(resp.output_tokens),
            resp.input_tokens,
            resp.output_tokens,
            **data,
        )

    @session_context()
    async def _sample(self, engine: InferenceEngine, data: dict[str, Any]) -> tuple[ModelResponse, float]:
        input_ids = apply_chat_template(self.tokenizer, data["messages"], tokenize=True, add_generation_prompt=True)
        req = ModelRequest(
            rid=uuid.uuid4().hex, input_ids=input_ids, gconfig=self.gconfig.new(n_samples=1), tokenizer=self.tokenizer
        )
        async with atrace_session_phase("generate"):
            resp = await engine.agenerate(req)
        return resp, await self._reward(resp, data)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        ctx = workflow_context.get()
        self.seen.append((ctx.is_eval, ctx.task_id, workflow_context.stat_scope()))
        resp, reward = await self._sample(engine, data)
        if data.get("reject_all"):
            return None
        if data.get("fail_all"):
            raise RuntimeError("the user's workflow failed on purpose")
        stats_tracker.get(workflow_context.stat_scope()).scalar(reward=reward, end_with_stop=resp.end_with_stop)
        seq = resp.input_tokens + resp.output_tokens
        return {
            "input_ids": torch.tensor([seq], dtype=torch.int32),
            "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * resp.input_len + [1] * resp.output_len], dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * resp.input_len + resp.output_logprobs], dtype=torch.float32),
            "versions": torch.tensor([[-1] * resp.input_len + resp.output_versions], dtype=torch.int32),
            "rewards": torch.tensor([reward], dtype=torch.float32),
            # what AReaL's context told this episode, so a test can read it on the trainer side
            "areal_task_id": torch.tensor([ctx.task_id], dtype=torch.int64),
            "areal_is_eval": torch.tensor([ctx.is_eval]),
        }
