"""Test doubles of our own interfaces: a deterministic engine and a tiny offline tokenizer."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.api.io_struct import ModelRequest, ModelResponse, StopReason
from rollstream.api.workflow import RolloutWorkflow
from rollstream.tensors import trajectory_row

SPECIAL = ["[PAD]", "[UNK]", "<eos>", "<|user|>", "<|assistant|>"]
WORDS = "hello world what is two plus three four five the answer again try please wrong".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.cache
def make_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a few words: pad 0, unk 1, eos 2; built offline."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="<eos>", unk_token="[UNK]")
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def ids(words: str) -> list[int]:
    """Token ids of space-separated vocabulary words."""
    return make_tokenizer().convert_tokens_to_ids(words.split())


class FakeEngine(InferenceEngine):
    """Returns scripted outputs (cycled per call), logprob -0.5 - 0.1*i, the current version.

    The output is cut to the request's generation budget; the stop reason is "length" when it
    was cut (or set explicitly), else "stop". Every request is kept in ``requests``.
    """

    def __init__(
        self,
        outputs: Sequence[Sequence[int]] = ((10, 11, 2),),
        version: int = 0,
        stop_reason: StopReason | None = None,
        delay: float = 0.0,
    ) -> None:
        self.outputs = [list(o) for o in outputs]
        self.version = version
        self.stop_reason = stop_reason
        self.delay = delay
        self.requests: list[ModelRequest] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req.copy())
        script = self.outputs[(len(self.requests) - 1) % len(self.outputs)]
        if self.delay:
            await asyncio.sleep(self.delay)
        budget = req.gconfig.budget(len(req.input_ids))
        out = script[:budget]
        reason = self.stop_reason or ("length" if len(out) < len(script) else "stop")
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out,
            output_logprobs=[-0.5 - 0.1 * i for i in range(len(out))],
            output_versions=[self.version] * len(out),
            stop_reason=reason,
            latency=0.0,
            ttft=0.0,
        )

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, update: WeightUpdate) -> None:
        self.version = update.version


class EchoWorkflow(RolloutWorkflow):
    """One generation; a ``[1, L]`` row with reward ``self.reward``; ``None`` when data says reject."""

    def __init__(self, reward: float = 1.0) -> None:
        self.reward = reward

    async def arun_episode(self, engine: InferenceEngine, data: dict) -> dict | None:  # type: ignore[type-arg]
        if data.get("reject"):
            return None
        resp = await engine.agenerate(ModelRequest(input_ids=list(data["input_ids"])))
        return trajectory_row(data["input_ids"], resp.output_tokens, resp.output_logprobs,
                              resp.output_versions, reward=self.reward)


class TwoTurnAgent:
    """Agent style: two engine calls; returns ``reward`` (float, dict or None as configured)."""

    def __init__(self, reward: object = 1.0) -> None:
        self.reward = reward

    async def run(self, data: dict, **extra: object) -> object:  # type: ignore[type-arg]
        engine = extra["engine"]
        first = ModelRequest(rid="first", input_ids=list(data["input_ids"]))
        resp = await engine.agenerate(first)  # type: ignore[attr-defined]
        first.input_ids += resp.output_tokens  # mutating after the call must not change the record
        await engine.agenerate(ModelRequest(rid="second", input_ids=first.input_ids))  # type: ignore[attr-defined]
        return self.reward


class SilentAgent:
    async def run(self, data: dict, **extra: object) -> float:  # type: ignore[type-arg]
        return 1.0


not_a_workflow = 42
