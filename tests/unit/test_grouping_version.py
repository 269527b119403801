"""TrainerVersion: Redis answers, or the last known version is used without blocking."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError

from rollstream.consumers.grouping.trainer_version import TrainerVersion, VersionReading
from rollstream.retry import RetryPolicy


class FlakyStore:
    """The one VersionStore method TrainerVersion needs; fails while ``down``."""

    def __init__(self) -> None:
        self.version: int | None = 0  # None: Redis holds no version
        self.down = False
        self.calls = 0

    async def published_version(self) -> int | None:
        self.calls += 1
        if self.down:
            raise RedisConnectionError("connection refused")
        return self.version


async def test_a_redis_that_holds_no_version_answers_0_not_published() -> None:
    """The intake check refuses tokens above the trainer only on a version Redis holds."""
    store = FlakyStore()
    store.version = None
    reader = TrainerVersion(store)  # type: ignore[arg-type]
    assert await reader.get() == VersionReading(0, known=True, published=False)
    store.version = 2
    assert await reader.get() == VersionReading(2, known=True, published=True)


async def test_last_known_version_while_redis_is_down(caplog) -> None:
    store = FlakyStore()
    reader = TrainerVersion(store, timeout_seconds=0.5, retry=RetryPolicy(initial=60.0))  # type: ignore[arg-type]
    store.version = 4
    assert await reader.get() == VersionReading(4, known=True)
    store.down, store.version = True, 9
    assert await reader.get() == VersionReading(4, known=False)
    assert "last known version 4" in caplog.text
    assert await reader.get() == VersionReading(4, known=False) and store.calls == 2  # backing off
    reader._retry_at = 0.0
    store.down = False
    assert await reader.get() == VersionReading(9, known=True)
    store.version = 0  # a Redis that lost the version: ignored, and not known
    assert await reader.get() == VersionReading(9, known=False)
