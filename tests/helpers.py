"""Shared test helpers: configs that point at the session's real broker and Redis, and bounded
waits that name the step that did not finish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rollstream.config import RollstreamConfig, config_from_dict

T = TypeVar("T")

# The ``show_report`` fixture (tests/conftest.py): a test's report text, printed in the
# session's summary whether the test passed or not, with or without xdist workers.
ShowReport = Callable[[str], None]


def make_config(
    kafka_bootstrap: str, redis_url: str, name: str, sections: dict[str, Any] | None = None
) -> RollstreamConfig:
    """A config for one test: its own experiment name (so its own topics and Redis keys).

    ``sections`` is merged per section over the defaults, e.g. ``{"rollout": {...}}``.
    """
    tree: dict[str, Any] = {
        "kafka": {"bootstrap_servers": kafka_bootstrap, "partitions": 2, "transaction_timeout_ms": 15000},
        "redis": {"url": redis_url},
        "experiment": {"experiment_name": name, "trial_name": "t0"},
    }
    for section, values in (sections or {}).items():
        if isinstance(values, dict):
            tree.setdefault(section, {}).update(values)
        else:
            tree[section] = values
    return config_from_dict(tree)


async def within(awaitable: Awaitable[T], seconds: float, step: str) -> T:
    """``await awaitable``, or fail naming ``step`` once ``seconds`` passed (it is then cancelled).
    A ``TimeoutError`` the awaitable raises itself propagates unchanged."""
    bound = asyncio.timeout(seconds)
    try:
        async with bound:
            return await awaitable
    except TimeoutError:
        if bound.expired():
            raise AssertionError(f"{step}: not done within {seconds:g}s") from None
        raise


async def until(predicate: Callable[[], Any], what: str, timeout: float = 20.0,
                logs: Callable[[], str] = lambda: "") -> None:
    """Poll ``predicate`` every 10 ms; fail naming ``what`` (and showing ``logs()``) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs()}"
        await asyncio.sleep(0.01)


async def stop_in_process_tiers(tiers: list, stop, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Set ``stop`` and wait for tier tasks run in this process; each must end by itself,
    without an error, within ``timeout``."""
    import asyncio

    stop.set()
    done, pending = await asyncio.wait(tiers, timeout=timeout)
    for tier in pending:
        tier.cancel()
    assert not pending, "a tier did not stop when asked"
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    assert not errors, errors


async def read_topic(config: RollstreamConfig, topic: str, decode):  # type: ignore[no-untyped-def]
    """Every committed record of ``topic``, decoded (the product's one bounded read)."""
    from rollstream.kafka.scan import scan_topic

    return [decode(r.value) async for r in scan_topic(config.kafka, topic, "test-reader")]
