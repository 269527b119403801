"""A reward function that hangs, crashes, or kills its pool process, inside a running reward worker.

The worker (in-process, real broker) must score every episode per policy — a timeout after the
last try scores 0.0 (``on_timeout: zero``) or rejects with ``reward_timeout`` (``reject``); a
crash or a killed pool process rejects the sample as failed with the error — rebuild its pool,
and keep scoring the other episodes meanwhile: the good ones must all be scored 1.0, and before
the hanging one gives up.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from harness.configs import make_config
from harness.ledger import read_topic
from rollstream.config import RollstreamConfig
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import TopicNames
from rollstream.reward_workers.service import run
from rollstream.wire import Episode, SampleRejected, ScoredEpisode, decode_scored, encode
from rollstream.wire.torch_tensors import encode_tensor_dict


pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]

TIMEOUT = 2.0
RETRIES = 1


def episode(task_id: str, mode: str, log: Path) -> Episode:
    prompt, completion = [5, 6, 7], [8, 9]
    trajectory = {
        "input_ids": torch.tensor([prompt + completion], dtype=torch.int32),
        "attention_mask": torch.ones(1, 5, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 0, 0, 1, 1]], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0, 0.0, 0.0, -0.5, -0.7]], dtype=torch.float32),
        "versions": torch.tensor([[-1, -1, -1, 0, 0]], dtype=torch.int32),
    }
    return Episode(task_id=task_id, sample_idx=0, group_size=1, trajectory=encode_tensor_dict(trajectory),
                   data={"mode": mode, "log": str(log)})


def config_for(kafka_bootstrap: str, redis_url: str, name: str, on_timeout: str) -> RollstreamConfig:
    return make_config(kafka_bootstrap, redis_url, name, {"reward": {
        "reward_fn": "tests.faults.reward_fns:chaos_reward", "timeout_seconds": TIMEOUT,
        "max_retries": RETRIES, "max_workers": 2, "on_timeout": on_timeout, "worker_id": "w-chaos",
        "session_timeout_ms": 6000,
    }})


async def score(config: RollstreamConfig, episodes: list[Episode], timeout: float = 120) -> dict[str, object]:
    """Run a reward worker until every episode is scored; the scored message per task id."""
    names = TopicNames.of(config)
    await ensure_topics(config.kafka, names)
    producer = make_producer(config.kafka, "test-episodes")
    await producer.start()
    try:
        for ep in episodes:
            await producer.send(names.episodes, encode(ep), key=ep.task_id.encode())
        await producer.flush()
    finally:
        await producer.stop()
    stop = asyncio.Event()
    worker = asyncio.create_task(run(config, stop))
    deadline = time.monotonic() + timeout
    try:
        while True:
            scored = await read_topic(config.kafka, names.scored, decode_scored)
            if len(scored) >= len(episodes) or worker.done() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert not worker.done(), "the reward worker died"
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)
    by_task = {(m.episode.task_id if isinstance(m, ScoredEpisode) else m.task_id): m for m in scored}
    assert len(scored) == len(episodes) == len(by_task), f"{len(scored)} scored of {len(episodes)}"
    return by_task


def calls(log: Path) -> dict[str, list[tuple[str, float]]]:
    events: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for line in log.read_text().splitlines():
        mode, event, at = line.split()
        events[mode].append((event, float(at)))
    return events


async def test_hanging_crashing_and_killing_rewards_keep_the_others_flowing(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    log = tmp_path / "calls.log"
    modes = {f"good-{i}": "good" for i in range(20)} | {"hang": "hang", "crash": "crash", "kill": "kill",
                                                         "exit": "exit"}
    episodes = [episode(task, mode, log) for task, mode in modes.items()]
    scored = await score(config_for(kafka_bootstrap, redis_url, unique_name, "zero"), episodes)

    for i in range(20):
        good = scored[f"good-{i}"]
        assert isinstance(good, ScoredEpisode) and good.reward == 1.0, good
    hang = scored["hang"]
    assert isinstance(hang, ScoredEpisode) and hang.reward == 0.0, hang  # on_timeout: zero
    for task, error in (("crash", "RuntimeError"), ("kill", "BrokenProcessPool"), ("exit", "BrokenProcessPool")):
        message = scored[task]
        assert isinstance(message, SampleRejected) and message.failed, message
        assert message.reason.startswith("reward_error: ") and error in message.reason, message.reason

    events = calls(log)
    hang_starts = [at for event, at in events["hang"] if event == "start"]
    # every attempt that started timed out (an attempt still queued when a neighbour broke the
    # shared pool never starts: it is retried isolated, its attempt used)
    assert 1 <= len(hang_starts) <= RETRIES + 1
    gave_up = hang_starts[-1] + TIMEOUT
    good_ends = [at for event, at in events["good"] if event == "end"]
    assert len(good_ends) >= 20
    first = min(at for evs in events.values() for _, at in evs)
    timeline = (f"all 20 good rewards done {max(good_ends) - first:.2f}s after the first call; "
                f"the hanging one gave up after {gave_up - first:.2f}s")
    print(timeline)
    # throughput: the good episodes were scored while the bad ones were being retried
    assert max(good_ends) < gave_up, timeline
    for mode in ("kill", "exit", "crash"):  # bounded: at most one extra, isolated, attempt
        assert 1 <= len([1 for event, _ in events[mode] if event == "start"]) <= RETRIES + 2, mode


async def test_timeout_policy_reject(kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    episodes = [episode("hang", "hang", log)] + [episode(f"good-{i}", "good", log) for i in range(3)]
    scored = await score(config_for(kafka_bootstrap, redis_url, unique_name, "reject"), episodes)
    hang = scored["hang"]
    assert isinstance(hang, SampleRejected) and hang.reason == "reward_timeout" and not hang.failed, hang
    assert all(isinstance(scored[f"good-{i}"], ScoredEpisode) for i in range(3))
