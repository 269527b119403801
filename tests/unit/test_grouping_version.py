"""TrainerVersion: Redis answers, or the last known version is used without blocking."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError

from rollstream.consumers.grouping.trainer_version import TrainerVersion, VersionReading
from rollstream.retry import RetryPolicy


class FlakyStore:
    """The one VersionStore method TrainerVersion needs; fails while ``down``."""

    def __init__(self) -> None:
        self.version = 0
        self.down = False
        self.calls = 0

    async def get_version(self) -> int:
        self.calls += 1
        if self.down:
            raise RedisConnectionError("connection refused")
        return self.version


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
