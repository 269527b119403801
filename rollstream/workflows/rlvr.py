"""Single-turn RL with a verifiable reward (RLVR): one prompt, one generation, one row."""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from torch import Tensor

from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from rollstream.api.workflow import RolloutWorkflow
from rollstream.rewards.wrapper import AsyncRewardWrapper
from rollstream.runtime.stats import stats_tracker
from rollstream.trajectory.rows import trajectory_row

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]


def build_prompt_ids(tokenizer: Any, data: Mapping[str, Any], data_key: str, enable_thinking: bool) -> list[int]:
    """The prompt token ids for ``data``, tried in this order:

    ``data["input_ids"]``; the tokenizer's chat template applied to ``data[data_key]`` (when the
    tokenizer has a template); ``tokenizer.encode(data["prompt"])``. ``ValueError`` otherwise.
    """
    if "input_ids" in data:
        return [int(t) for t in data["input_ids"]]
    if getattr(tokenizer, "chat_template", None) and data_key in data:
        ids = tokenizer.apply_chat_template(
            data[data_key], add_generation_prompt=True, tokenize=True,
            return_dict=False, enable_thinking=enable_thinking,
        )
        return [int(t) for t in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]
    if "prompt" in data:
        return [int(t) for t in tokenizer.encode(data["prompt"])]
    raise ValueError(
        f"cannot build a prompt: data has none of 'input_ids', {data_key!r} (with a chat template) "
        f"or 'prompt'; keys are {sorted(data)}"
    )


class RewardCaller:
    """Calls a reward function: async ones directly, sync ones in the process pool.

    A sync function must be picklable (``TypeError`` at construction otherwise). Keyword
    arguments named like one of the function's positional parameters are dropped, so a data item
    with a "prompt" key cannot collide with a ``reward_fn(prompt, completion, ...)`` signature.
    """

    def __init__(self, reward_fn: RewardFn, **wrapper_kwargs: Any) -> None:
        self._wrapper: AsyncRewardWrapper | None = None
        self._positional = _positional_names(reward_fn)
        if inspect.iscoroutinefunction(reward_fn):
            self._fn: Callable[..., Awaitable[Any]] = reward_fn
        else:
            self._wrapper = AsyncRewardWrapper(reward_fn, **wrapper_kwargs)
            self._fn = self._wrapper

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        taken = self._positional[: len(args)]
        kwargs = {k: v for k, v in kwargs.items() if k not in taken}
        return float(await self._fn(*args, **kwargs))

    async def aclose(self) -> None:
        if self._wrapper is not None:
            await self._wrapper.aclose()


def _positional_names(fn: RewardFn) -> tuple[str, ...]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


class RLVRWorkflow(RolloutWorkflow):
    """One generation per episode; returns a ``[1, L]`` tensor dict (never ``None``).

    Keys: ``input_ids`` int32 (prompt + output), ``loss_mask`` int32 (0 prompt, 1 output),
    ``logprobs`` float32 (0.0 on prompt), ``versions`` int32 (-1 on prompt), ``attention_mask``
    bool ones, ``is_truncated`` bool [1] (stop reason "length"), and ``rewards`` float32 [1]
    only when ``reward_fn`` is given; without one the reward tier fills ``rewards`` later.

    ``reward_fn(prompt_text, completion_text, prompt_ids, completion_ids, **data)`` may be async
    (awaited directly) or a picklable sync function (run in :class:`AsyncRewardWrapper`).
    """

    def __init__(
        self,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        reward_fn: RewardFn | None = None,
        enable_thinking: bool = False,
        data_key: str = "messages",
        reward_timeout_seconds: float = 15.0,
        reward_max_retries: int = 3,
        reward_max_workers: int | None = None,
    ) -> None:
        if gconfig.n_samples != 1:
            logger.warning("gconfig.n_samples=%d ignored: one sample per episode; use group_size", gconfig.n_samples)
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer).new(n_samples=1)
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.data_key = data_key
        self.reward: RewardCaller | None = None
        if reward_fn is not None:
            self.reward = RewardCaller(
                reward_fn, timeout_seconds=reward_timeout_seconds,
                max_retries=reward_max_retries, max_workers=reward_max_workers,
            )

    def prompt_ids(self, data: Mapping[str, Any]) -> list[int]:
        return build_prompt_ids(self.tokenizer, data, self.data_key, self.enable_thinking)

    def make_request(self, prompt_ids: list[int], data: Mapping[str, Any]) -> ModelRequest:
        """The engine request for one episode; subclasses add e.g. image data."""
        return ModelRequest(
            rid=uuid.uuid4().hex, input_ids=list(prompt_ids), gconfig=self.gconfig.new(), tokenizer=self.tokenizer
        )

    async def compute_reward(self, prompt_ids: list[int], resp: ModelResponse, data: Mapping[str, Any]) -> float:
        """The reward of one completion; requires ``reward_fn``."""
        assert self.reward is not None
        prompt_text = self.tokenizer.decode(prompt_ids)
        completion_text = self.tokenizer.decode(resp.output_tokens)
        return await self.reward(prompt_text, completion_text, prompt_ids, resp.output_tokens, **data)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Tensor]:
        prompt_ids = self.prompt_ids(data)
        resp = await engine.agenerate(self.make_request(prompt_ids, data))
        reward = None if self.reward is None else await self.compute_reward(prompt_ids, resp, data)
        stats_tracker.record(seqlen=len(prompt_ids) + resp.output_len)
        if reward is not None:
            stats_tracker.record(reward=reward)
        return trajectory_row(
            prompt_ids, resp.output_tokens, resp.output_logprobs, resp.output_versions,
            reward=reward, is_truncated=resp.stop_reason == "length",
        )

    async def aclose(self) -> None:
        """Release the reward process pool share, if any."""
        if self.reward is not None:
            await self.reward.aclose()
