"""Test doubles of our own interfaces: a deterministic engine (``rollstream.testing``'s) and a
tiny offline tokenizer."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from redis.exceptions import ConnectionError as RedisConnectionError
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.api.io_struct import ModelRequest
from rollstream.api.workflow import RolloutWorkflow
from rollstream.testing import ScriptedEngine
from rollstream.trajectory.rows import trajectory_row


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


# The scripted engine workflow authors use (rollstream.testing), under the name these tests know.
FakeEngine = ScriptedEngine


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


class FakeSource:
    """Versions published with ``publish``; ``down`` makes every call raise like a lost Redis."""

    def __init__(self) -> None:
        self.version = 0
        self.paths: dict[int, str] = {}
        self.down = False
        self._changed = asyncio.Event()
        self.watch_calls = 0

    def publish(self, version: int, path: str | None = "/w") -> None:
        if path is not None:
            self.paths[version] = path
        self.version = version
        self._changed.set()

    def _check(self) -> None:
        if self.down:
            raise RedisConnectionError("connection refused")

    async def get_update(self, version: int | None = None) -> WeightUpdate | None:
        self._check()
        v = self.version if version is None else version
        return WeightUpdate(v, self.paths[v]) if v in self.paths else None

    async def latest_checkpoint(self, at_most: int) -> WeightUpdate | None:
        self._check()
        versions = [v for v in self.paths if v <= at_most]
        return WeightUpdate(max(versions), self.paths[max(versions)]) if versions else None

    async def watch(self, poll_seconds: float = 2.0) -> AsyncIterator[int]:
        self.watch_calls += 1
        self._check()
        last = self.version
        yield last
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), poll_seconds)
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            self._check()
            if self.version != last:
                last = self.version
                yield last


class RecordingEngine(FakeEngine):
    def __init__(self, fail_loads: int = 0) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail_loads = fail_loads
        self.paused = False

    async def pause(self) -> None:
        self.paused = True
        self.calls.append("pause")

    async def resume(self) -> None:
        self.paused = False
        self.calls.append("resume")

    async def update_weights(self, update: WeightUpdate) -> None:
        self.calls.append(f"update:{update.version}")
        if self.fail_loads:
            self.fail_loads -= 1
            raise OSError(f"cannot read {update.path}")


async def until_true(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)
