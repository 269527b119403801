"""A tier's declaration: its topics, its names, and the command that runs a tier of one's own."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.cli import load_declaration, main
from rollstream.config import ConfigError, load_config
from rollstream.kafka.topics import TopicNames
from rollstream.tier.context import StopBeforeReady, before_stop
from rollstream.tier.declaration import AT_LEAST_ONCE, EXACTLY_ONCE, SOURCE, Reads, Tier
from rollstream.tier.runtime import topic_names


async def _build(ctx: object) -> None:
    return None


def test_a_role_of_ones_own_becomes_a_data_topic_of_the_trial_once() -> None:
    names = TopicNames("exp", "t0").with_roles(["scored", "scored-filtered", "grouping-changelog"])
    assert names.extra_roles == ("scored-filtered",)
    assert names.topic("scored-filtered") == "rs.exp.t0.scored-filtered" in names.data_topics()
    assert names.with_roles(["scored-filtered"]).data_topics() == names.data_topics()
    assert names.topic("dead-letter") == names.dead_letter and names.topic("scored") == names.scored


def test_the_runtime_names_the_topics_a_tier_reads_and_writes() -> None:
    config = load_config(overrides=["experiment.experiment_name=exp"], environ={})
    tier = Tier("filter", "0", Reads("scored"), ("scored-filtered",), EXACTLY_ONCE, _build)
    assert topic_names(tier, config).extra_roles == ("scored-filtered",)
    assert tier.describe() == "scored -> scored-filtered (exactly once)" and tier.client_id == "filter-0"


def test_a_source_reads_nothing_and_a_consuming_tier_is_no_source() -> None:
    Tier("producer", "p", None, ("prompts",), SOURCE, _build)
    with pytest.raises(ValueError, match="source"):
        Tier("producer", "p", None, ("prompts",), AT_LEAST_ONCE, _build)
    with pytest.raises(ValueError, match="source"):
        Tier("filter", "0", Reads("scored"), (), SOURCE, _build)


def test_a_role_that_is_no_topic_name_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="grouping.reads"):
        load_config(overrides=["grouping.reads=scored filtered"], environ={})


def test_a_declaration_that_cannot_be_loaded_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_declaration("examples.filter_tier:declare").__name__ == "declare"
    with pytest.raises(ConfigError, match="no_such_module"):
        load_declaration("no_such_module:declare")
    with pytest.raises(ConfigError, match="WRITES"):
        load_declaration("examples.filter_tier:WRITES")
    assert main(["tier", "examples.filter_tier:nope"]) == 2
    assert "cannot load the tier declaration 'examples.filter_tier:nope'" in capsys.readouterr().err


async def test_a_stop_cuts_a_start_short_and_says_what_it_was_doing() -> None:
    stop = asyncio.Event()
    cancelled = asyncio.Event()

    async def waits_for_a_broker() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    start = asyncio.create_task(before_stop(waits_for_a_broker(), stop, lambda: "starting the producer"))
    await asyncio.sleep(0.05)
    stop.set()
    with pytest.raises(StopBeforeReady, match="stop asked while starting the producer"):
        await asyncio.wait_for(start, 5)
    assert cancelled.is_set()  # what was waiting is cancelled, not left behind


async def test_a_start_that_ends_first_gives_its_result_or_its_error() -> None:
    stop = asyncio.Event()

    async def answer() -> int:
        return 7

    async def refuse() -> None:
        raise ConfigError("bad setting")

    assert await before_stop(answer(), stop, lambda: "x") == 7
    with pytest.raises(ConfigError, match="bad setting"):
        await before_stop(refuse(), stop, lambda: "x")


async def test_a_start_whose_caller_is_cancelled_is_cancelled_too() -> None:
    cancelled = asyncio.Event()

    async def waits_for_a_broker() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    caller = asyncio.create_task(before_stop(waits_for_a_broker(), asyncio.Event(), lambda: "x"))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert cancelled.is_set()  # never left running behind its caller
