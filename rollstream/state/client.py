"""Redis for rollstream's shared state: the client, the trial's keys, waiting for Redis, and
what a script's answer means.

Keys carry a hash tag (``rs:{experiment.trial}:...``) so every script touches one slot and
works on Redis Cluster too. Redis faults are never crashes: a key holding something that is
not a number raises :class:`RedisStateError` and a budget whose state is gone raises
:class:`StateMissingError`, both ``RedisError`` subclasses that every tier handles like an
unreachable Redis (log, keep the last known value or wait, retry).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rollstream.config import RedisConfig
from rollstream.retry import REDIS_RETRY
from rollstream.runtime.tasks import raise_if_cancelled

log = logging.getLogger(__name__)

MARKER_TTL_SECONDS = 7 * 24 * 3600
STATE_MISSING = -2
MALFORMED = -3
GENERATION_CHANGED = -4
STATE_STALE = -5


class RedisStateError(RedisError):
    """A key holds a value that is not what rollstream wrote (e.g. not an integer)."""


class StateMissingError(RedisError):
    """The staleness budget's state is gone (Redis restarted without persistence, or a new
    trial): it must be rebuilt from the topics before anything is admitted or released."""


class StateStaleError(StateMissingError):
    """The staleness budget's state was built on another redis-server process (an earlier
    moment's state after a restart from a snapshot or a failover; rollstream.state.epoch): it is
    rebuilt from the topics like a missing one before anything is admitted or released."""


class GenerationChanged(Exception):
    """The budget was rebuilt since the generation an admission named: admissions counted in
    the old generation may be unknown to the new counters (``current``: the new generation)."""

    def __init__(self, current: str) -> None:
        super().__init__(f"the staleness budget was rebuilt (generation {current})")
        self.current = current


def parse_int(key: str, raw: bytes | str | None, default: int = 0) -> int:
    """``raw`` as an int (``default`` when absent); :class:`RedisStateError` naming the key
    when it is something else."""
    if raw is None:
        return default
    try:
        return int(raw)
    except (TypeError, ValueError):
        shown = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        raise RedisStateError(f"redis key {key} holds {shown[:40]!r}, not an integer") from None


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


def script_answer(result: object) -> int:
    """A budget script's answer as an int; raises for the error answers."""
    if isinstance(result, list) and result and result[0] == GENERATION_CHANGED:
        current = result[1]
        raise GenerationChanged(current.decode() if isinstance(current, bytes) else str(current))
    if isinstance(result, list):  # [MALFORMED, key, value]
        key = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
        parse_int(key, result[2] if len(result) > 2 else b"?")
        raise RedisStateError(f"redis key {key} is malformed")
    if result == STATE_STALE:
        raise StateStaleError("the staleness budget's state in Redis was written by another redis-server process "
                              "(a restart from a snapshot, a failover): a producer rebuilds it from the topics")
    if result == STATE_MISSING:
        raise StateMissingError("the staleness budget's state is missing in Redis (restarted without persistence, or a new trial); a producer rebuilds it from the topics")
    return int(result)  # type: ignore[call-overload]


async def wait_for_redis(client: aioredis.Redis, stop: asyncio.Event | None = None) -> bool:
    """Block until Redis answers PING (the shared retry policy's pauses, up to 5 s); True then.

    False when ``stop`` is set first (a clean exit, not an error); a cancellation of the
    calling task is still raised."""
    try:
        await REDIS_RETRY.call(
            client.ping, retry_on=(aioredis.ConnectionError, aioredis.TimeoutError, OSError),
            what="redis ping", stop=stop,
        )
    except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
        if stop is not None and stop.is_set():
            raise_if_cancelled()
            return False
        raise
    return True
