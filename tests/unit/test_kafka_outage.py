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


async def test_a_connection_lost_while_finding_the_coordinator_is_tried_again() -> None:
    """aiokafka wraps a connection lost during the coordinator lookup in a plain KafkaError (the
    cause kept): the broker restarting, waited out like any connection error. A plain
    KafkaError of another cause still propagates at once."""
    from aiokafka.errors import KafkaConnectionError, KafkaError

    tries = 0

    async def start() -> str:
        nonlocal tries
        tries += 1
        if tries == 1:
            try:
                raise KafkaConnectionError("Connection at 127.0.0.1:12092 closed")
            except KafkaConnectionError as err:
                raise KafkaError(repr(err)) from err
        return "started"

    assert await wait_out_outage(NOWHERE, start, "starting a producer") == "started"
    assert tries == 2

    async def broken() -> None:
        raise KafkaError("something else")

    with pytest.raises(KafkaError, match="something else"):
        await wait_out_outage(NOWHERE, broken, "starting a producer")
