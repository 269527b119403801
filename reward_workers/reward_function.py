"""The reward worker's ``RewardScorer``: the configured reward function, run in a process pool.

The reward function is named only by configuration (``reward.reward_fn``, an import string
``"module:function"`` or ``"module.function"``) and must be on the allow-list
``{reward.reward_fn} | reward.allowed_reward_fns``; nothing in a message can choose it.
It runs through ``rollstream.rewards.wrapper.AsyncRewardWrapper.call`` (process pool, timeout,
retries; a timeout on the last attempt raises ``RewardTimeout``, which ``scoring`` turns into
what ``reward.on_timeout`` says); the records of a poll batch reach the pool in one chunk per
process, their token ids as raw bytes (``PackedIds``; the function still gets lists).
``reward.reward_fn: ""`` configures none: for pipelines whose workflows all set ``rewards``
themselves; an episode without rewards then fails with a reason saying so.

Texts: the tokenizer is read from ``tokenizer.json`` with the ``tokenizers`` library
(``rollstream.tokenizer_file``, as the dump tier does), so the reward tier never imports torch.
The samples of a group share their prompt, so prompt texts are remembered (``decode_prompt``,
the last ``PROMPT_TEXTS_KEPT``); byte-level BPE tokenizers are decoded with a table checked
against the tokenizer at start (``rollstream.reward_workers.byte_decode``), others with the
tokenizer's own decode.

Episodes whose workflow set ``rewards`` are passed through with them (``scoring``) unless
``reward.rescore`` is true. The first such episode a worker with a reward function passes
through is reported with a WARNING naming ``reward.rescore``: re-scoring a replay of such
episodes without it changes nothing, and says so.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy

from rollstream import tokenizer_file
from rollstream.config import ConfigError, RewardConfig
from rollstream.tokenizer_file import Tokenizer
from rollstream.imports import import_callable
from rollstream.reward_workers.byte_decode import ByteLevelDecoder
from rollstream.rewards.pool_worker import PackedIds
from rollstream.rewards.wrapper import AsyncRewardWrapper

log = logging.getLogger(__name__)

# Prompts whose text a scorer remembers: a reward worker sees the samples of a group close
# together, and at most ``reward.max_batch`` records of distinct groups in between.
PROMPT_TEXTS_KEPT = 256


def resolve_reward_fn(spec: str, allowed: Iterable[str]) -> Callable[..., Any]:
    """The callable named by ``spec`` (``"pkg.mod:fn"`` or ``"pkg.mod.fn"``) if allow-listed.

    Raises ``ConfigError`` naming the setting when ``spec`` is not allowed, cannot be
    imported, or is not callable.
    """
    if spec not in set(allowed):
        raise ConfigError(
            f"reward function {spec!r} is not allow-listed (reward.reward_fn, reward.allowed_reward_fns)"
        )
    return import_callable(spec, "reward.reward_fn")


class NoRewardFunctionError(RuntimeError):
    """An episode needs scoring but ``reward.reward_fn`` names no function."""


class Scorer:
    """Decodes token ids with the configured tokenizer and calls the reward function
    (``wrapper``; None when none is configured)."""

    def __init__(
        self,
        wrapper: AsyncRewardWrapper | None,
        tokenizer: Tokenizer | None,
        on_timeout: Literal["zero", "reject"] = "zero",
        worker_id: str = "",
        *,
        rescore: bool = False,
        reward_fn_name: str = "",
    ) -> None:
        if rescore and wrapper is None:
            raise ConfigError("reward.rescore is true but reward.reward_fn names no reward function to re-score with")
        self._wrapper = wrapper
        self._tokenizer = tokenizer
        # texts are only needed for a reward function; building the table takes a moment
        self._byte_decoder = None if tokenizer is None or wrapper is None else ByteLevelDecoder.for_tokenizer(tokenizer)
        self.on_timeout = on_timeout
        self.worker_id = worker_id
        self.rescore = rescore
        self.reward_fn_name = reward_fn_name
        self.passed_through_count = 0  # episodes whose workflow's rewards were kept
        self._prompt_text = functools.lru_cache(maxsize=PROMPT_TEXTS_KEPT)(
            lambda dtype, data: self.decode(numpy.frombuffer(data, dtype=dtype)))
        if wrapper is None:
            log.info("no reward function (reward.reward_fn is empty): episodes must carry rewards set by their workflow")
        elif tokenizer is None:
            log.warning(
                "reward.tokenizer_path is not set: reward functions get empty prompt and completion "
                "text (token ids only)"
            )

    @classmethod
    def from_config(cls, config: RewardConfig, worker_id: str) -> Scorer:
        """The scorer ``config`` describes; raises ``ConfigError`` naming a bad setting."""
        wrapper = None
        if config.reward_fn:
            allowed = {config.reward_fn, *config.allowed_reward_fns}
            fn = resolve_reward_fn(config.reward_fn, allowed)
            try:
                wrapper = AsyncRewardWrapper(
                    fn, timeout_seconds=config.timeout_seconds, max_retries=config.max_retries,
                    max_workers=config.max_workers,
                )
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"reward settings cannot be used: {exc}") from None
        return cls(
            wrapper, load_tokenizer(config.tokenizer_path), config.on_timeout, worker_id,
            rescore=config.rescore, reward_fn_name=config.reward_fn,
        )

    def decode(self, ids: Sequence[int] | numpy.ndarray) -> str:
        if self._tokenizer is None or len(ids) == 0:
            return ""
        if self._byte_decoder is not None:  # the same text, several times faster
            return self._byte_decoder.decode(numpy.asarray(ids))
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def decode_prompt(self, ids: numpy.ndarray) -> str:
        """``decode(ids)``, remembered for the last ``PROMPT_TEXTS_KEPT`` distinct prompts (the
        samples of a group share their prompt: one decode per group instead of one per sample)."""
        if self._tokenizer is None or len(ids) == 0:
            return ""
        return self._prompt_text(ids.dtype.str, ids.tobytes())

    async def reward(
        self, prompt: str, completion: str, prompt_ids: numpy.ndarray, completion_ids: numpy.ndarray,
        data: dict[str, Any],
    ) -> float:
        if self._wrapper is None:
            raise NoRewardFunctionError(
                "the episode carries no rewards and reward.reward_fn is empty: set reward.reward_fn, "
                "or return 'rewards' from the workflow"
            )
        # the ids cross to the pool process as raw bytes and arrive there as lists
        return await self._wrapper.call(prompt, completion, PackedIds(prompt_ids), PackedIds(completion_ids), **data)

    def passed_through(self, episode: Any) -> None:
        self.passed_through_count += 1
        if self.passed_through_count == 1 and self._wrapper is not None:
            log.warning(
                "episode %s/%d carries rewards set by its workflow: passed through unchanged, %s NOT "
                "called (for this and every such episode; set reward.rescore=true to re-score them, "
                "e.g. when re-scoring a replay)",
                episode.task_id, episode.sample_idx, self.reward_fn_name,
                extra={"task_id": episode.task_id, "sample_idx": episode.sample_idx},
            )

    async def aclose(self) -> None:
        if self._wrapper is not None:
            await self._wrapper.aclose()


def load_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer at ``path`` (``rollstream.tokenizer_file.load_tokenizer``: a local model
    directory or a hub id, without torch), or None for an empty path."""
    if not path:
        return None
    try:
        return tokenizer_file.load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"reward.tokenizer_path {path!r} cannot be loaded: {exc}") from None
