"""The trainer's weight version as the grouping consumer sees it: Redis, or the last known value.

Emission never waits for Redis: when it is unreachable (or its version key is malformed) the
last version read is used (0 before the first successful read), a warning is logged, and Redis
is asked again after a back-off. Versions only go up: a lower value (a Redis that restarted
without persistence reads 0 until the trainer publishes again) is logged and ignored, so
batches are never tagged with a version older than one already seen.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from rollstream.metrics import WEIGHT_VERSION
from rollstream.redis_state import VersionStore

log = logging.getLogger(__name__)


class TrainerVersion:
    """``await get()`` -> the current version; never raises for an unreachable Redis."""

    def __init__(self, store: VersionStore, timeout_seconds: float = 2.0, retry_seconds: float = 5.0) -> None:
        self._store = store
        self._timeout = timeout_seconds
        self._retry = retry_seconds
        self._retry_at = 0.0
        self.last = 0

    async def get(self) -> int:
        now = time.monotonic()
        if now < self._retry_at:
            return self.last
        try:
            version = await asyncio.wait_for(self._store.get_version(), self._timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._retry_at = now + self._retry
            log.warning(
                "cannot read the trainer version from Redis (%s: %s); using the last known version %d",
                type(exc).__name__, exc, self.last,
            )
            return self.last
        if version < self.last:
            log.warning("trainer version in Redis went back to %d (last seen %d); keeping %d",
                        version, self.last, self.last)
            return self.last
        if version != self.last:
            log.info("trainer version is now %d", version)
        self.last = version
        WEIGHT_VERSION.labels("grouping").set(version)
        return version
