"""The trainer's weight versions in Redis: the current one, where each version's weights are,
how the current one is sent over the wire, and the announcement channel. Versions only go up
(:meth:`VersionStore.publish_newer`).

Keys: ``version`` (the current version), ``weights`` (hash: version -> checkpoint directory, for
the versions that have one), ``transfer`` (JSON: the current version's weight sender, when the
trainer sends it over a torch.distributed process group)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from rollstream.api.engine import WeightUpdate
from rollstream.runtime.tasks import raise_if_cancelled
from rollstream.state.client import MALFORMED, RedisKeys, parse_int, script_answer

log = logging.getLogger(__name__)

# KEYS: version, weights, channel, transfer. ARGV: version, path ("": none), announcement,
# transfer ("": none). Publishes only a version above the current one: {1} published,
# {0, current} refused, {MALFORMED, key, value}.
_PUBLISH_NEWER = """
local raw = redis.call('GET', KEYS[1])
if raw then
  local current = tonumber(raw)
  if current == nil then return {-3, KEYS[1], raw} end
  if tonumber(ARGV[1]) <= current then return {0, current} end
end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
if ARGV[4] ~= '' then redis.call('SET', KEYS[4], ARGV[4]) else redis.call('DEL', KEYS[4]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[3], ARGV[3])
return {1}
"""


def _transfer(update: WeightUpdate) -> str:
    if not update.source:
        return ""
    return json.dumps({"version": update.version, "source": update.source, "open_until": update.open_until,
                       "backend": update.backend})



class VersionStore:
    """The trainer's current weight version and where each version's weights are."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self._keys = keys

    async def get_version(self) -> int:
        """The current version (0 when none was published); RedisStateError when malformed."""
        return await self.published_version() or 0

    async def published_version(self) -> int | None:
        """The current version; None when Redis holds none (none was published, or Redis lost
        it); RedisStateError when malformed."""
        key = self._keys.key("version")
        raw = await self._redis.get(key)
        return None if raw is None else parse_int(key, raw)

    async def get_update(self, version: int | None = None) -> WeightUpdate | None:
        """The weights of ``version`` (default: the current one): its checkpoint, and its weight
        sender while it is the current version; None when it has neither."""
        if version is None:
            version = await self.get_version()
        path = await self._redis.hget(self._keys.key("weights"), str(version))
        raw = await self._redis.get(self._keys.key("transfer"))
        sent = json.loads(raw) if raw else {}
        if sent.get("version") != version:
            sent = {}
        if path is None and not sent:
            return None
        return WeightUpdate(version, path.decode() if path is not None else "", sent.get("source", ""),
                            float(sent.get("open_until", 0.0)), sent.get("backend", "gloo"))

    async def latest_checkpoint(self, at_most: int) -> WeightUpdate | None:
        """The newest version at or below ``at_most`` that has a checkpoint; None when none has."""
        entries = await self._redis.hgetall(self._keys.key("weights"))
        versions = [(int(v), p.decode()) for v, p in entries.items() if int(v) <= at_most and p]
        if not versions:
            return None
        version, path = max(versions)
        return WeightUpdate(version, path)

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

    async def publish_newer(self, update: WeightUpdate) -> int | None:
        """Like :meth:`publish`, atomically and only when ``update.version`` is above the current
        version (any version when none was published). None when published, else the current
        version that refused it; RedisStateError when the version key is malformed."""
        message = json.dumps({"event": "version", "version": update.version, "path": update.path})
        script = self._redis.register_script(_PUBLISH_NEWER)
        keys = [self._keys.key("version"), self._keys.key("weights"), self._keys.channel, self._keys.key("transfer")]
        result = await script(keys=keys, args=[update.version, update.path, message, _transfer(update)])
        if result[0] == MALFORMED:
            script_answer(result)
        if result[0] == 0:
            return int(result[1])
        log.info("published weight version %d at %s", update.version, update.path)
        return None

    async def forget(self, versions: list[int]) -> None:
        """Delete the weights entries of ``versions`` (their checkpoints are being deleted)."""
        if versions:
            await self._redis.hdel(self._keys.key("weights"), *(str(v) for v in versions))

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
                raise_if_cancelled()  # redis-py may have lost a cancellation (see raise_if_cancelled)
                if current != last:
                    last = current
                    yield current
        finally:
            await pubsub.aclose()
