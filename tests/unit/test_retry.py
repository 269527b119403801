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


class FakeClock:
    """Monotonic seconds the test moves by hand (the backoff's clock)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_patience_keeps_trying_past_max_attempts_until_the_failures_went_on_that_long() -> None:
    clock = FakeClock()
    backoff = RetryPolicy(initial=1.0, maximum=5.0, jitter=0.0, max_attempts=3, patience=30.0).backoff(clock)
    for _ in range(10):  # many quick failures: an outage shorter than the patience
        backoff.failed(OSError("down"))
        clock.now += 2.9
    assert backoff.failures == 10 and backoff.failing_for < 30
    clock.now = 100.0 + 30.0
    with pytest.raises(RetriesExhausted, match=r"11 tries in a row failed, last: OSError\('down'\) \(failing for 30s\)"):
        backoff.failed(OSError("down"))


def test_patience_counts_from_the_first_failure_of_the_current_run() -> None:
    clock = FakeClock()
    backoff = RetryPolicy(initial=1.0, maximum=5.0, jitter=0.0, max_attempts=1, patience=10.0).backoff(clock)
    backoff.failed()
    clock.now += 9.0
    backoff.succeeded()  # the outage ended before the patience ran out
    clock.now += 20.0
    assert backoff.failed() == 1.0  # a new run starts its own clock
    clock.now += 10.0
    with pytest.raises(RetriesExhausted):
        backoff.failed()


def test_max_attempts_still_applies_when_the_failures_are_slow() -> None:
    clock = FakeClock()
    backoff = RetryPolicy(initial=1.0, maximum=5.0, jitter=0.0, max_attempts=3, patience=30.0).backoff(clock)
    backoff.failed()
    clock.now += 60.0  # each try took long (a request timing out)
    backoff.failed()
    with pytest.raises(RetriesExhausted):
        backoff.failed()


async def test_call_with_patience_retries_until_it_is_spent() -> None:
    tries = 0

    async def down() -> None:
        nonlocal tries
        tries += 1
        raise ConnectionError("down")

    policy = RetryPolicy(initial=0.05, maximum=0.05, jitter=0.0, max_attempts=2, patience=0.4)
    with pytest.raises(ConnectionError):
        await policy.call(down, retry_on=(ConnectionError,), what="down")
    assert tries >= 5  # far more than max_attempts: the patience decided
