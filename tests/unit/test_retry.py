"""The one retry policy: pauses, giving up, resetting, and stopping."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.retry import RetriesExhausted, RetryPolicy


def test_backoff_doubles_up_to_the_cap_then_gives_up() -> None:
    backoff = RetryPolicy(initial=0.25, maximum=1.0, jitter=0.0, max_attempts=6).backoff()
    assert [backoff.failed() for _ in range(5)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    with pytest.raises(RetriesExhausted, match="6 tries in a row failed, last: OSError"):
        backoff.failed(OSError("down"))


def test_a_success_resets_the_count_and_jitter_stays_within_bounds() -> None:
    backoff = RetryPolicy(initial=0.1, maximum=0.4, jitter=0.05, max_attempts=3).backoff()
    backoff.failed()
    backoff.failed()
    backoff.succeeded()
    pauses = [backoff.failed() for _ in range(2)]
    assert 0.1 <= pauses[0] <= 0.15 and 0.2 <= pauses[1] <= 0.25


async def test_call_retries_what_it_is_told_and_nothing_else() -> None:
    tries = 0

    async def flaky() -> str:
        nonlocal tries
        tries += 1
        if tries < 3:
            raise ConnectionError("not yet")
        return "ok"

    policy = RetryPolicy(initial=0.01, maximum=0.01, jitter=0.0)
    assert await policy.call(flaky, retry_on=(ConnectionError,), what="flaky") == "ok" and tries == 3

    async def broken() -> None:
        raise ValueError("a bug, not a fault")

    with pytest.raises(ValueError):
        await policy.call(broken, retry_on=(ConnectionError,), what="broken")
    limited = RetryPolicy(initial=0.01, maximum=0.01, jitter=0.0, max_attempts=2)
    tries = -10
    with pytest.raises(ConnectionError):
        await limited.call(flaky, retry_on=lambda e: isinstance(e, ConnectionError), what="flaky")
    assert tries == -8


async def test_call_ends_when_stop_is_set() -> None:
    stop = asyncio.Event()

    async def down() -> None:
        stop.set()
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        await RetryPolicy(initial=5.0).call(down, retry_on=(ConnectionError,), what="down", stop=stop)
