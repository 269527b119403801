"""Multi-turn retry: answer, and while the reward is not positive, ask again on the history."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from torch import Tensor

from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest
from rollstream.runtime.stats import stats_tracker
from rollstream.trajectory.rows import TrajectoryBuilder
from rollstream.workflows.rlvr import RewardFn, RLVRWorkflow

logger = logging.getLogger(__name__)

DEFAULT_RETRY_PROMPT = (
    "Your answer is either wrong or not parsed to the reward function. Please try to answer it again."
)


class MultiTurnWorkflow(RLVRWorkflow):
    """Up to ``max_turns`` generations on one growing sequence; returns a ``[1, L]`` dict.

    Each turn generates on the whole history and scores the completion. A reward > 0 ends the
    episode. Otherwise the retry prompt is appended (after an eos when the answer did not end
    with one, as AReaL does) with prompt-position values (loss_mask 0, logprob 0.0,
    version -1), and the final reward is multiplied by ``turn_discount`` once per retry.
    Unlike AReaL, retries stop early when the history leaves no generation budget.

    Keys as in :class:`RLVRWorkflow`, always with ``rewards``; ``is_truncated`` is the last
    turn's. ``reward_fn`` is required (the retry decision needs it).
    """

    def __init__(
        self,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        reward_fn: RewardFn,
        max_turns: int,
        turn_discount: float,
        retry_prompt: str = DEFAULT_RETRY_PROMPT,
        **rlvr_kwargs: Any,
    ) -> None:
        if reward_fn is None:
            raise ValueError("MultiTurnWorkflow needs reward_fn: each turn's reward decides whether to retry")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        super().__init__(gconfig, tokenizer, reward_fn=reward_fn, **rlvr_kwargs)
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.retry_prompt_ids = self._encode_retry_prompt(retry_prompt)

    def _encode_retry_prompt(self, text: str) -> list[int]:
        """As AReaL: a user turn through the chat template, else the plain text."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.prompt_ids({self.data_key: [{"role": "user", "content": text}]})
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _between_turns(self, output_ids: list[int]) -> list[int]:
        eos = self.tokenizer.eos_token_id
        needs_eos = eos is not None and (not output_ids or output_ids[-1] != eos)
        return ([eos] if needs_eos else []) + self.retry_prompt_ids

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Tensor]:
        history = self.prompt_ids(data)
        builder = TrajectoryBuilder()
        builder.add_prompt(history)
        rid, discount, turns = uuid.uuid4().hex, 1.0, 0
        while True:
            req = ModelRequest(rid=rid, input_ids=list(history), gconfig=self.gconfig.new(), tokenizer=self.tokenizer)
            resp = await engine.agenerate(req)
            builder.add_output(resp.output_tokens, resp.output_logprobs, resp.output_versions)
            reward = await self.compute_reward(history, resp, data)
            history = history + list(resp.output_tokens)
            turns += 1
            if reward > 0 or turns >= self.max_turns:
                break
            extra = self._between_turns(list(resp.output_tokens))
            if self.gconfig.max_tokens - len(history) - len(extra) <= 0:
                logger.info("multi-turn episode stops after %d turns: no generation budget left", turns)
                break
            builder.add_prompt(extra)
            history += extra
            discount *= self.turn_discount
        final = reward * discount
        stats_tracker.record(reward=final, turns=turns, seqlen=len(history))
        return builder.to_tensors(reward=final, is_truncated=resp.stop_reason == "length")
