"""Shared state in Redis: the trainer's weight version and the staleness budget.

Keys carry a hash tag (``rs:{experiment.trial}:...``) so every script touches one slot and
works on Redis Cluster too. Admission and release are idempotent per task id: a producer
that retries after a crash, or a grouping consumer that re-decides a group after a restart,
never counts a prompt twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis

from rollstream.api.engine import WeightUpdate
from rollstream.config import RedisConfig

log = logging.getLogger(__name__)

MARKER_TTL_SECONDS = 7 * 24 * 3600

_ADMIT = """
if redis.call('EXISTS', KEYS[4]) == 1 then return 1 end
local v = tonumber(redis.call('GET', KEYS[3]) or '0')
local a = tonumber(redis.call('GET', KEYS[1]) or '0')
local d = tonumber(redis.call('GET', KEYS[2]) or '0')
if a - d < (tonumber(ARGV[1]) + v + 1) * tonumber(ARGV[2]) then
  redis.call('INCR', KEYS[1])
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[3])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('SET', KEYS[3], ARGV[1], 'NX', 'EX', ARGV[2]) then
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('INCR', KEYS[1]) end
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
  return 1
end
return 0
"""


def connect(config: RedisConfig) -> aioredis.Redis:
    """A client for ``config.url`` (``rediss://`` for TLS) with optional AUTH user/password."""
    kwargs: dict[str, object] = {"health_check_interval": 10, "socket_connect_timeout": 5}
    if config.username:
        kwargs["username"] = config.username
    if config.password:
        kwargs["password"] = config.password
    return aioredis.from_url(config.url, **kwargs)


@dataclass(frozen=True)
class RedisKeys:
    experiment: str
    trial: str

    def key(self, name: str) -> str:
        return f"rs:{{{self.experiment}.{self.trial}}}:{name}"

    @property
    def channel(self) -> str:
        return self.key("events")


class VersionStore:
    """The trainer's current weight version and where each version's weights are."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self._keys = keys

    async def get_version(self) -> int:
        value = await self._redis.get(self._keys.key("version"))
        return int(value) if value is not None else 0

    async def get_update(self, version: int | None = None) -> WeightUpdate | None:
        """The weights of ``version`` (default: the current one); None when none were published."""
        if version is None:
            version = await self.get_version()
        path = await self._redis.hget(self._keys.key("weights"), str(version))
        return WeightUpdate(version, path.decode()) if path is not None else None

    async def publish(self, update: WeightUpdate) -> None:
        """Record ``update`` as the current version, then announce it on the channel."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.key("weights"), str(update.version), update.path)
            pipe.set(self._keys.key("version"), update.version)
            pipe.publish(
                self._keys.channel,
                json.dumps({"event": "version", "version": update.version, "path": update.path}),
            )
            await pipe.execute()
        log.info("published weight version %d at %s", update.version, update.path)

    async def watch(self, poll_seconds: float = 2.0) -> AsyncIterator[int]:
        """Yield the version each time it changes (channel messages, with polling as a backstop)."""
        last = await self.get_version()
        yield last
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(self._keys.channel)
        try:
            while True:
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_seconds)
                current = await self.get_version()
                if current != last:
                    last = current
                    yield current
        finally:
            await pubsub.aclose()


class StalenessBudget:
    """Admission control across any number of producers, counted in prompts (groups).

    A prompt is admitted only while ``admitted - dropped < (eta + version + 1) * batch_size``.
    Eval prompts never touch the budget. Dropped (or fully rejected) groups return their slot.
    """

    def __init__(
        self, client: aioredis.Redis, keys: RedisKeys, max_head_offpolicyness: int, batch_size: int
    ) -> None:
        self._redis = client
        self._keys = keys
        self._eta = max_head_offpolicyness
        self._batch_size = batch_size
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)

    def _admit_keys(self, task_id: str) -> list[str]:
        k = self._keys.key
        return [k("admitted"), k("dropped"), k("version"), k(f"admit:{task_id}")]

    async def try_admit(self, task_id: str) -> bool:
        """Admit ``task_id`` if the budget allows (idempotent: a re-admission returns True)."""
        args = [self._eta, self._batch_size, MARKER_TTL_SECONDS]
        return bool(await self._admit(keys=self._admit_keys(task_id), args=args))

    async def release(self, task_id: str, reason: str) -> bool:
        """Return a dropped group's slot and count the drop by reason; idempotent per task."""
        k = self._keys.key
        keys = [k("dropped"), k("drops_by_reason"), k(f"drop:{task_id}"), k(f"admit:{task_id}")]
        return bool(await self._release(keys=keys, args=[reason, MARKER_TTL_SECONDS]))

    async def wait_for_room(self, timeout: float) -> None:
        """Sleep until the budget may have grown (a version or a release), at most ``timeout``."""
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(self._keys.channel)
        try:
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        finally:
            await pubsub.aclose()

    async def notify(self) -> None:
        await self._redis.publish(self._keys.channel, json.dumps({"event": "release"}))

    async def usage(self) -> dict[str, int]:
        """Counters for status displays: admitted, dropped, capacity, version."""
        k = self._keys.key
        admitted, dropped, version = await self._redis.mget(k("admitted"), k("dropped"), k("version"))
        v = int(version or 0)
        return {
            "admitted": int(admitted or 0),
            "dropped": int(dropped or 0),
            "version": v,
            "capacity": (self._eta + v + 1) * self._batch_size,
        }

    async def drops_by_reason(self) -> dict[str, int]:
        raw = await self._redis.hgetall(self._keys.key("drops_by_reason"))
        return {key.decode(): int(value) for key, value in raw.items()}


async def wait_for_redis(client: aioredis.Redis, stop: asyncio.Event | None = None) -> None:
    """Block until Redis answers PING, backing off up to 5 s between tries."""
    delay = 0.2
    while True:
        try:
            await client.ping()
            return
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as exc:
            log.warning("redis not reachable (%s); retrying in %.1fs", exc, delay)
        if stop is not None and stop.is_set():
            raise asyncio.CancelledError
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
