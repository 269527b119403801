"""What a tier's build function gets from the runtime: its config, topic names, the consumer, and
resources that the runtime closes in reverse order when the tier ends (each close named, so a
shutdown that hangs says on what).

A build function asks for what it needs (``await ctx.redis()``, ``await ctx.producer()``,
``ctx.background(...)``) and registers its own clean-up (``ctx.on_close``); hooks say what
happens after the tier left its consumer group on a graceful stop (``ctx.after_leaving``) and
when its loop failed (``ctx.on_failure``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from rollstream.config import RollstreamConfig
from rollstream.kafka.clients import make_producer, start_client, stop_client
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.tasks import cancel_and_wait
from rollstream.state.client import RedisKeys, connect, wait_for_redis
from rollstream.tier.declaration import Tier

log = logging.getLogger(__name__)

T = TypeVar("T")
Drain = Callable[[float], Awaitable[None]]  # gets the seconds left of the shutdown bound


class StopBeforeReady(Exception):
    """Stop was asked while the tier was still starting (e.g. waiting for Redis or the
    broker): the runtime ends the tier cleanly, closing what was made."""


async def before_stop(starting: Coroutine[Any, Any, T], stop: asyncio.Event, what: Callable[[], str]) -> T:
    """``await starting``, a step of a tier's start (waiting for the broker, Redis or a server may
    take minutes); a stop asked meanwhile cancels it: :class:`StopBeforeReady` naming ``what()``
    it was doing."""
    task = asyncio.ensure_future(starting)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller was cancelled (e.g. at its shutdown bound): so is the start
        await cancel_and_wait(task)
        raise
    finally:
        stopping.cancel()
    if not task.done():
        doing = what()
        await cancel_and_wait(task)
        raise StopBeforeReady(f"stop asked while {doing}")
    return task.result()


class TierContext:
    """Resources of one running tier; see the module docstring."""

    def __init__(self, tier: Tier, config: RollstreamConfig, names: TopicNames, stop: asyncio.Event,
                 stack: contextlib.AsyncExitStack, consumer: AIOKafkaConsumer | None) -> None:
        self.tier = tier
        self.config = config
        self.names = names
        self.stop = stop
        self.consumer = consumer  # created, not started: the runtime subscribes and starts it
        self.keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        self.phase = "starting"  # what the tier is doing now: a hung shutdown names it
        self.watched: dict[str, asyncio.Task[Any]] = {}  # background tasks whose failure ends the tier
        self.drains: list[Drain] = []
        self.failure_hooks: list[Callable[[], Awaitable[None]]] = []
        self._stack = stack
        self._redis: Any = None

    def on_close(self, what: str, close: Callable[[], Awaitable[Any]]) -> None:
        """Run ``close`` when the tier ends (last registered, first run), as phase ``what``."""

        async def closing() -> None:
            self.phase = what
            await close()

        self._stack.push_async_callback(closing)

    async def redis(self, wait: bool = False) -> Any:
        """The trial's Redis client (one per tier), closed at the end; ``wait``: until Redis
        answers (:class:`StopBeforeReady` when stop comes first)."""
        if self._redis is None:
            self._redis = connect(self.config.redis)
            self.on_close("closing the Redis client", self._redis.aclose)
        if wait:
            self.phase = "waiting for Redis"
            if not await wait_for_redis(self._redis, self.stop):
                raise StopBeforeReady("stop asked while waiting for Redis")
        return self._redis

    async def producer(self) -> AIOKafkaProducer:
        """A started idempotent producer, stopped when the tier ends (after what it sent)."""
        what = f"the producer of {self.tier.label}"
        producer = make_producer(self.config.kafka, self.tier.client_id)
        self.on_close(f"stopping {what}", lambda: stop_client(producer, what))  # also a start cut short
        self.phase = f"starting {what}"
        await start_client(producer, self.config.kafka, what)
        return producer

    def background(self, name: str, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``work`` beside the loop; cancelled when the tier ends. Its failure is watched by
        whoever reads :attr:`watched` (the tier's intake)."""
        task = asyncio.create_task(work, name=name)
        self.watched[name] = task
        self.on_close(f"cancelling {name}", lambda: cancel_and_wait(task))
        return task

    def after_leaving(self, drain: Drain) -> None:
        """On a graceful stop, after the consumer left its group: ``drain(seconds_left)``."""
        self.drains.append(drain)

    def on_failure(self, hook: Callable[[], Awaitable[None]]) -> None:
        """When the loop fails: ``hook()`` before anything is closed (e.g. stop work in flight)."""
        self.failure_hooks.append(hook)
