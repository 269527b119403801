"""The trainer's weight version as the grouping consumer sees it: Redis, or the last known value.

Emission never waits for Redis: when it is unreachable (or its version key is malformed) the
last version read is used (0 before the first successful read), a warning is logged, and Redis
is asked again after the pause of the one retry policy (``REDIS_RETRY``). Versions only go up:
a lower value (a Redis that restarted without persistence reads 0, one that came back from an
earlier snapshot an earlier version, until the trainer publishes again) is logged and ignored.
An instance that takes partitions raises its floor to the newest version their changelog
outcomes were tagged with (:meth:`TrainerVersion.raise_floor`), so a new instance meeting such
a Redis never tags a partition's groups below what that partition was tagged before.

Each answer says whether it is *known*: Redis answered this time, with a version no older
than any answer before. Otherwise the version is only the newest one this instance knows to
have been published, which may be older than the trainer's. :func:`rollstream.consumers.grouping.records.build_emitted_group`
raises a group's version to its newest token's (a token's version was published before it was
generated) and marks it unknown then, so a group is never tagged older than its tokens
(docs/GUARANTEES.md, "A group's trainer version").
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from rollstream.runtime.metrics import WEIGHT_VERSION
from rollstream.state.version_store import VersionStore
from rollstream.retry import REDIS_RETRY, RetryPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionReading:
    """``version``: the newest trainer version known to be published. ``known``: Redis gave it
    just now and it is no older than any earlier answer (False: the last known value, because
    Redis failed, was not asked again yet, or went back)."""

    version: int
    known: bool
    published: bool = True  # Redis held a version (False: it answered that it holds none)


class TrainerVersion:
    """``await get()`` -> the current :class:`VersionReading`; never raises for an unreachable Redis."""

    def __init__(self, store: VersionStore, timeout_seconds: float = 2.0, retry: RetryPolicy = REDIS_RETRY) -> None:
        self._store = store
        self._timeout = timeout_seconds
        self._backoff = retry.backoff()
        self._retry_at = 0.0
        self.last = 0

    def raise_floor(self, version: int) -> None:
        """``version`` was reached by the trainer (a durable record says so): never answer less."""
        if version > self.last:
            log.info("trainer version is at least %d (the changelog of the partitions taken)", version)
            self.last = version

    async def get(self) -> VersionReading:
        now = time.monotonic()
        if now < self._retry_at:
            return VersionReading(self.last, known=False)
        try:
            held = await asyncio.wait_for(self._store.published_version(), self._timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            pause = self._backoff.failed(exc)
            self._retry_at = now + pause
            log.warning(
                "cannot read the trainer version from Redis (%s: %s); using the last known version %d, "
                "asking again in %.1fs", type(exc).__name__, exc, self.last, pause,
            )
            return VersionReading(self.last, known=False)
        self._backoff.succeeded()
        version = 0 if held is None else held
        if version < self.last:
            log.warning("trainer version in Redis went back to %d (last seen %d); keeping %d",
                        version, self.last, self.last)
            return VersionReading(self.last, known=False)
        if version != self.last:
            log.info("trainer version is now %d", version)
        self.last = version
        WEIGHT_VERSION.labels("grouping").set(version)
        return VersionReading(version, known=True, published=held is not None)
