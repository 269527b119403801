"""Waiting out a broker that is away: which client-start failures count as the broker being away."""

from __future__ import annotations

import pytest

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import wait_out_outage

NOWHERE = KafkaConfig(bootstrap_servers="127.0.0.1:9", outage_patience_seconds=30)


async def test_a_producer_start_that_lost_its_bootstrap_is_tried_again() -> None:
    """aiokafka's transactional producer asserts it knows a broker when it looks up its
    coordinator; a broker restarting just then is waited out, not a crash of the tier."""
    tries = 0

    async def start() -> str:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise AssertionError("Did we not perform bootstrap?")
        return "started"

    assert await wait_out_outage(NOWHERE, start, "starting a producer") == "started"
    assert tries == 2


async def test_any_other_assertion_is_a_bug_and_propagates_at_once() -> None:
    tries = 0

    async def start() -> None:
        nonlocal tries
        tries += 1
        raise AssertionError("offsets must grow")

    with pytest.raises(AssertionError, match="offsets must grow"):
        await wait_out_outage(NOWHERE, start, "starting a producer")
    assert tries == 1
