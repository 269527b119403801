"""Waits that always end (rollstream/runtime/deadline.py, stop_client): a call that swallows its
cancellation, as aiokafka's fetcher close did, cannot hold its caller past the deadline."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from rollstream.kafka.clients import stop_client
from rollstream.runtime.deadline import CancelledInside, DeadlineExceeded, left_behind, within


class Stubborn:
    """A client whose ``stop()`` ignores cancellation until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancellations = 0

    async def stop(self) -> None:
        while True:
            try:
                await self.release.wait()
                return
            except asyncio.CancelledError:
                self.cancellations += 1  # swallowed


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_call_that_swallows_its_cancellation_is_left_behind_at_the_deadline() -> None:
    client = Stubborn()
    began = time.monotonic()
    try:
        with pytest.raises(DeadlineExceeded, match="the stubborn stop did not end within 0s"):
            await within(client.stop(), 0.2, "the stubborn stop")
        assert time.monotonic() - began < 2.0 and left_behind() == 1
        await settle()
        assert client.cancellations == 1  # asked to stop, ignored it: still running
    finally:
        client.release.set()  # a task that ignores cancellation would hold the loop's own close
        await settle()
    assert left_behind() == 0  # it ended later, and is forgotten


async def test_within_returns_what_the_call_returns_and_raises_what_it_raises() -> None:
    async def value() -> int:
        return 7

    async def failing() -> None:
        raise ValueError("no")

    assert await within(value(), 1, "a value") == 7
    with pytest.raises(ValueError, match="no"):
        await within(failing(), 1, "a failure")


async def test_a_client_stop_past_its_deadline_is_logged_naming_the_client(caplog: pytest.LogCaptureFixture) -> None:
    client = Stubborn()
    try:
        with caplog.at_level(logging.ERROR, logger="rollstream.kafka.clients"):
            assert not await stop_client(client, "the follower of rs.x.t0.batches", timeout=0.2)
        assert "stopping the follower of rs.x.t0.batches did not end within 0s; going on without it" in caplog.text
    finally:
        client.release.set()
        await settle()


class CancelsItsOwnFetch:
    """A client whose ``stop()`` cancels a task of its own and awaits it, letting the
    cancellation out, as aiokafka's fetcher close does with a fetch backing off."""

    async def stop(self) -> None:
        fetch = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        fetch.cancel()
        await fetch


async def test_a_cancellation_the_call_raises_on_its_own_is_an_error_not_the_callers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The grouping tier died so in a fault test: a changelog reader's stop raised
    CancelledError in a rebalance callback that nobody had cancelled."""
    with pytest.raises(CancelledInside, match="stopping the reader ended cancelled"):
        await within(CancelsItsOwnFetch().stop(), 5, "stopping the reader")
    with caplog.at_level(logging.WARNING, logger="rollstream.kafka.clients"):
        assert not await stop_client(CancelsItsOwnFetch(), "a reader of rs.x.t0.grouping-changelog", timeout=5)
    assert "stopping a reader of rs.x.t0.grouping-changelog: CancelledInside" in caplog.text
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # the caller goes on, not cancelled
