"""The tier runtime on the real broker: a tier of one's own in a pipeline (examples/filter_tier.py,
through ``rollstream tier MODULE:NAME``), and a shutdown that ends at its bound when a client
hangs, in the event loop (the task is cancelled) and of it (the process exits, code 124)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
import pytest

from harness.configs import pipeline_config, write_config
from harness.episodes import scored
from harness.scored_feed import read_all, write_scored
from harness.tiers import TierProcess, wait_until_consuming
from harness.waits import stop_task, until
from rollstream.config import config_from_dict
from rollstream.dev.processes import free_port
from rollstream.consumers.grouping.service import run as run_grouping
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.shutdown import SHUTDOWN_TIMEOUT_EXIT_CODE
from rollstream.tier.runtime import serve
from rollstream.tier.shutdown_bound import ShutdownTimeout
from rollstream.wire import EmittedGroup, GroupDropped, ScoredEpisode, decode_group
from tests.integration.tier_runtime_parts import HUNG_CLOSE, hung, waiting

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

BOUND_S = 3.0


def _truncated(message: ScoredEpisode) -> ScoredEpisode:
    return msgspec.structs.replace(message, episode=msgspec.structs.replace(message.episode, stop_reason="length"))


async def test_the_example_filter_tier_rejects_truncated_samples_before_the_grouping(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name, grouping={
        "reads": "scored-filtered", "instance_id": "g", "commit_interval_ms": 50, "session_timeout_ms": 6000})
    config = config_from_dict(tree)
    cut = {("part", 1), ("part", 3), ("cut", 0), ("cut", 1), ("cut", 2), ("cut", 3)}
    samples = [(_truncated(m) if (m.episode.task_id, m.episode.sample_idx) in cut else m, 0)
               for task in ("part", "whole", "cut") for m in (scored(task, i, reward=float(i)) for i in range(4))]
    filter_tier = TierProcess("tier", write_config(tmp_path / "config.yaml", tree), tmp_path / "filter.log",
                              args=["examples.filter_tier:declare"])
    stop = asyncio.Event()
    grouping = asyncio.create_task(run_grouping(config, stop))
    try:
        filter_tier.start()
        await wait_until_consuming([filter_tier], 90)
        await write_scored(config, samples)
        records = await read_all(config, TopicNames.of(config).batches, until=3)
    finally:
        code = filter_tier.stop()
        stop.set()
        await stop_task(grouping, "the grouping tier")
    ended = {m.task_id: m for m in (decode_group(r.value) for r in records)}
    assert code == 0, filter_tier.tail()
    assert isinstance(ended["whole"], EmittedGroup) and list(ended["whole"].sample_idx) == [0, 1, 2, 3]
    part = ended["part"]
    assert isinstance(part, EmittedGroup) and list(part.sample_idx) == [0, 2] and part.rejected == 2
    assert isinstance(ended["cut"], GroupDropped) and ended["cut"].reason == "all_rejected"


async def test_a_shutdown_that_hangs_on_a_client_is_cut_at_its_bound(
    kafka_bootstrap: str, redis_url: str, unique_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    config = config_from_dict(pipeline_config(kafka_bootstrap, redis_url, unique_name,
                                              shutdown_timeout_seconds=BOUND_S))
    stop = asyncio.Event()
    tier = asyncio.create_task(serve(hung(config), config, stop))
    await until(lambda: any(" consuming " in m for m in caplog.messages) or tier.done(), "the tier consuming", 60)
    stop.set()
    asked = time.monotonic()
    with pytest.raises(ShutdownTimeout, match=HUNG_CLOSE):
        await asyncio.wait_for(tier, 30)
    assert time.monotonic() - asked <= BOUND_S + 1.0
    assert any(f"is still {HUNG_CLOSE}" in m and "cancelled" in m for m in caplog.messages)


@pytest.mark.parametrize("down", ["broker", "redis"])
async def test_a_stop_while_the_tier_waits_to_start_ends_it_at_once_and_cleanly(
    down: str, kafka_bootstrap: str, redis_url: str, unique_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A tier stopped while it waits for an unreachable broker (its topics) or Redis (its build)
    ends within a second, with no error: not at its shutdown bound, and not as a failure."""
    caplog.set_level(logging.INFO)
    nobody = f"127.0.0.1:{free_port()}"
    tree = pipeline_config(nobody if down == "broker" else kafka_bootstrap,
                           f"redis://{nobody}/0" if down == "redis" else redis_url, unique_name,
                           shutdown_timeout_seconds=30.0, kafka={"outage_patience_seconds": 600.0})
    config = config_from_dict(tree)
    stop = asyncio.Event()
    tier = asyncio.create_task(serve(waiting(config), config, stop))
    waits = {"broker": "cannot be reached while creating the trial's topics", "redis": "redis ping failed"}[down]
    await until(lambda: any(waits in m for m in caplog.messages) or tier.done(), f"the tier waiting for {down}", 60)
    assert not tier.done(), tier
    stop.set()
    asked = time.monotonic()
    assert await asyncio.wait_for(tier, 10) is None
    assert time.monotonic() - asked < 1.5
    phase = {"broker": "checking the trial's topics", "redis": "waiting for Redis"}[down]
    assert any(f"stop asked while {phase}" in m for m in caplog.messages), caplog.messages[-5:]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("rollstream")]
    assert not errors, errors  # (aiokafka logs each refused connection as an error of its own)


def test_a_tier_process_whose_event_loop_is_stuck_exits_at_its_bound(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path,
) -> None:
    tree = pipeline_config(kafka_bootstrap, redis_url, unique_name, shutdown_timeout_seconds=BOUND_S)
    process = TierProcess("tier", write_config(tmp_path / "config.yaml", tree), tmp_path / "stuck.log",
                          args=["tests.integration.tier_runtime_parts:stuck"]).start()
    try:
        asyncio.run(wait_until_consuming([process], 90))
        process.signal_stop()
        asked = time.monotonic()
        code = process.wait(30)
        took = time.monotonic() - asked
    finally:
        process.kill()
    assert code == SHUTDOWN_TIMEOUT_EXIT_CODE, process.tail()
    assert took <= BOUND_S + 2.0, f"exited {took:.1f} s after SIGTERM"
    assert process.grep("exiting now"), process.tail()
