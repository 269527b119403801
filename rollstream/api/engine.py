"""The inference engine contract that workflows call and rollout workers drive."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from rollstream.api.io_struct import ModelRequest, ModelResponse


@dataclass(frozen=True)
class WeightUpdate:
    """Where a new policy version's weights are.

    ``path``: a directory holding exactly this version's weights that the engine can load ("":
    the version has no checkpoint). ``source``: the ``host:port`` of the trainer's weight sender
    when the trainer sends the version over a torch.distributed process group (``backend``: gloo or
    nccl), which it serves until ``open_until`` (unix seconds); "" otherwise.
    """

    version: int
    path: str = ""
    source: str = ""
    open_until: float = 0.0
    backend: str = "gloo"


class InvalidRequestError(ValueError):
    """A request an engine refuses before generating (``rollstream.engines.request_check``):
    the message says what and how to fix it."""


class InferenceEngine(abc.ABC):
    """Generates tokens for workflows and follows the trainer's weight versions.

    ``agenerate`` must tag each output token with the version that produced it. While paused,
    new and in-flight generation waits; requests cut off by ``pause`` continue from the
    tokens they already have once ``resume`` is called.
    """

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request; see the class docstring for the version contract."""

    @abc.abstractmethod
    def get_version(self) -> int:
        """The weight version new tokens are generated with."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Declare the version of the weights now loaded."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop generating at the next token boundary; in-flight requests keep their tokens."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue generating after ``pause``."""

    @abc.abstractmethod
    async def update_weights(self, update: WeightUpdate) -> None:
        """Load the weights of ``update`` (call between ``pause`` and ``resume``)."""

    async def start(self) -> None:
        """Acquire resources (connections, model weights). Default: nothing to do."""

    async def close(self) -> None:
        """Release resources. Default: nothing to do."""


class DelegatingEngine(InferenceEngine):
    """An engine that forwards every call to ``inner``; subclasses override what they observe.

    Attributes this class does not define (e.g. a tokenizer the engine exposes) are looked up
    on ``inner``.
    """

    def __init__(self, inner: InferenceEngine) -> None:
        self.inner = inner

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        return await self.inner.agenerate(req)

    def get_version(self) -> int:
        return self.inner.get_version()

    def set_version(self, version: int) -> None:
        self.inner.set_version(version)

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    async def update_weights(self, update: WeightUpdate) -> None:
        await self.inner.update_weights(update)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found normally; ``inner`` itself may be missing
        # while the object is being copied or unpickled.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
