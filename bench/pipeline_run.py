"""One end-to-end run of the real tiers, each in its own process, driven by a dataset.

producer -> rollout worker -> reward worker -> grouping -> ``StepStream`` (in this process,
acking every batch as a trainer would). The rollout worker uses the LOAD GENERATOR engine
(``bench/load_engine.py``) unless the settings name a real engine (``bench/server.py``). Shared by
``bench/pipeline.py``, ``bench/memory.py`` and ``bench/server.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.kafka_tools import end_offsets, topic_bytes, wait_for_groups
from bench.load_engine import ENV_MIN_SHARE, ENV_RATE, ENV_VOCAB
from harness.configs import pipeline_config, write_config
from harness.procstats import cpu_seconds, rss_bytes
from harness.services import tokenizer_path, unique_name
from harness.tiers import Sampler, TierProcess, stop_all, wait_until_consuming
from rollstream.trainer import StepStream
from rollstream.config import RollstreamConfig, config_from_dict
from rollstream.dev.launcher import Services
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.topics import TopicNames


TIERS = ("grouping", "reward-worker", "rollout-worker")  # started first, then the producer
# how many consumer groups read each topic in this pipeline (bytes consumed = size x readers)
READERS = {"prompts": 1, "episodes": 1, "scored": 1, "batches": 1}


@dataclass
class PipelineSettings:
    prompts: int = 96
    group_size: int = 8
    prompt_tokens: int = 512
    completion_tokens: int = 1536
    tokens_per_second: float = 0.0  # load generator rate, all requests together; 0 = unlimited
    min_length_share: float = 1.0  # < 1: completions of random length in [share, 1] x budget
    max_concurrent_rollouts: int = 64
    partitions: int = 2
    commit_interval_ms: int = 100
    log_level: str = "INFO"
    timeout_s: float = 150.0
    load_engine: bool = True
    rollout: dict[str, Any] = field(default_factory=dict)  # extra rollout.* settings
    vocab_size: int = 512  # prompt and load-generator token ids stay below this (tiny tokenizer: 512)
    tokenizer: str | None = None  # tokenizer directory for the tiers (default: the tiny offline model)
    confirm_ready: bool = True  # ask the broker that every tier holds partitions before the producer starts
    # more tiers started beside TIERS (e.g. "dump", a second reader of scored that the byte
    # accounting does not count: bench/memory.py uses it for the tier's memory only)
    extra_tiers: tuple[str, ...] = ()


@dataclass
class PipelineResult:
    groups: int
    episodes: int
    generated_tokens: int
    total_tokens: int
    steady_seconds: float  # from the first batch to the last
    wall_seconds: float  # from starting the producer to the last batch
    batch_times: list[float]
    topic_bytes: dict[str, int]
    peak_rss: dict[str, int]  # tier -> own peak RSS (VmHWM)
    peak_tree_rss: dict[str, int]  # tier -> peak RSS with its child processes
    peak_private: dict[str, int]  # tier -> peak private memory (not shared with other processes)
    drops: dict[str, int]
    names: TopicNames
    cpu_seconds: dict[str, float]  # tier -> CPU seconds (with children) from the producer's start
    ready_rss: dict[str, int]  # tier -> RSS once every tier was in its consumer group (idle)
    phase_seconds: dict[str, float]  # seconds from the start of the run to each phase's end
    records: dict[str, int]  # topic -> records written during the run (markers included), internal topics too

    @property
    def steady_groups(self) -> int:
        return max(0, self.groups - 1)

    def rate(self, amount: float) -> float:
        """``amount`` per second over the steady window (per group delivered after the first)."""
        return amount * self.steady_groups / self.groups / self.steady_seconds if self.steady_seconds > 0 else float("nan")

    @property
    def bytes_produced(self) -> int:
        return sum(self.topic_bytes.values())

    @property
    def bytes_through(self) -> int:
        """Produced plus consumed bytes, all topics (each topic's log times 1 + its readers)."""
        total = 0
        for topic, size in self.topic_bytes.items():
            role = topic.rsplit(".", 1)[-1]
            total += size * (1 + READERS.get(role, 0))
        return total


def config_tree(services: Services, name: str, workdir: Path, s: PipelineSettings) -> dict[str, Any]:
    tokenizer = s.tokenizer or str(tokenizer_path())
    dataset = workdir / f"{name}.jsonl"
    with dataset.open("w") as f:
        for i in range(s.prompts):
            ids = [(i * 7 + j) % s.vocab_size for j in range(s.prompt_tokens)]
            f.write(json.dumps({"input_ids": ids, "answer": str(i % 10)}) + "\n")
    engine = {"engine": "custom", "engine_factory": "bench.load_engine:make_engine"} if s.load_engine else {"engine": "hf"}
    rollout = {
        **engine, "model_path": tokenizer, "tokenizer_path": tokenizer, "device": "cpu",
        "max_concurrent_rollouts": s.max_concurrent_rollouts, "worker_id": "bench-rollout-0",
        "fileroot": str(workdir / "dumps"),  # where a dump tier (extra_tiers) writes
        "gconfig": {"max_new_tokens": s.completion_tokens, "max_tokens": s.prompt_tokens + s.completion_tokens + 1},
        **s.rollout,
    }
    return pipeline_config(
        services.kafka_bootstrap, services.redis_url, name, kafka={"partitions": s.partitions},
        staleness={"enabled": False, "groups_per_step": 1},  # no trainer publishes versions: measure capacity; one group a step
        producer={"dataset": str(dataset), "group_size": s.group_size, "producer_id": "bench-producer"},
        rollout=rollout,
        reward={"tokenizer_path": tokenizer, "worker_id": "bench-reward-0", "max_workers": 2},
        grouping={"instance_id": "bench-grouping-0", "commit_interval_ms": s.commit_interval_ms},
        trainer={"group_id": "bench-trainer"},
        log_level=s.log_level,
    )


async def _consume(consumer: StepStream, s: PipelineSettings, procs: list[TierProcess],
                   deadline: float) -> tuple[list[float], int, int, int]:
    times: list[float] = []
    episodes = generated = total = 0
    ended = 0
    while ended < s.prompts:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pipeline: only {ended} of {s.prompts} groups ended within {s.timeout_s:.0f}s")
        for p in procs:
            p.check_alive()
        batch = await consumer.next_step(timeout=1.0)
        dropped = sum(consumer.drops_by_reason.values())
        if batch is None:
            ended = len(times) + dropped
            continue
        times.append(time.monotonic())
        episodes += batch.tensors["input_ids"].shape[0]
        generated += int(batch.tensors["loss_mask"].sum())
        total += int(batch.tensors["attention_mask"].sum())
        await consumer.ack(batch)
        ended = len(times) + dropped
    return times, episodes, generated, total


async def run_pipeline(services: Services, workdir: Path, s: PipelineSettings,
                       broker_pid: int | None = None) -> PipelineResult:
    """Run the whole pipeline once over ``s.prompts`` prompts; see the module docstring."""
    name = unique_name("bench")
    began = time.monotonic()
    phases: dict[str, float] = {}
    workdir.mkdir(parents=True, exist_ok=True)
    tree = config_tree(services, name, workdir, s)
    path = write_config(workdir / f"{name}.yaml", tree)
    config: RollstreamConfig = config_from_dict(tree)
    names = TopicNames(name, "t0")
    env = {ENV_RATE: str(s.tokens_per_second), ENV_MIN_SHARE: str(s.min_length_share), ENV_VOCAB: str(s.vocab_size)}
    tiers = (*TIERS, *s.extra_tiers)
    procs = [TierProcess(t, path, workdir / f"{name}.{t}.log", env=env).start() for t in tiers]
    # counted while the tiers start (a JVM each way, in parallel with other work)
    # (skipped by smoke runs: two JVM starts)
    count_records = s.confirm_ready
    offsets_before = asyncio.create_task(asyncio.to_thread(end_offsets, services.kafka_bootstrap) if count_records
                                         else asyncio.sleep(0, {}))
    try:
        await ensure_topics(config.kafka, names)  # the trainer subscribes before any tier made them
        consumer = StepStream(config, ledger=False, client_id="bench-trainer")
        await consumer.start()
        try:
            with Sampler(procs) as sampler:
                if not s.confirm_ready:  # a smoke run: no figures, so no waiting either
                    procs.append(TierProcess("producer", path, workdir / f"{name}.producer.log").start())
                # every tier is in its consumer group before the first prompt: the figures are
                # the pipeline's, not the start-up of four Python processes
                groups = [names.group_id(t) for t in tiers]
                await _wait_ready(services.kafka_bootstrap, groups, procs[: len(tiers)], s.timeout_s, s.confirm_ready)
                phases["tiers ready"] = time.monotonic() - began
                cpu_before = {p.tier: p.cpu_seconds for p in procs}
                ready_rss = {p.tier: rss_bytes(p.pid) for p in procs}
                cpu_before.update(_own_cpu(broker_pid, sampler))
                if s.confirm_ready:
                    procs.append(TierProcess("producer", path, workdir / f"{name}.producer.log").start())
                started = time.monotonic()
                times, episodes, generated, total = await _consume(consumer, s, procs, started + s.timeout_s)
                drops = dict(consumer.drops_by_reason)
                phases["last batch"] = time.monotonic() - began
                for p in procs:
                    p.sample()
                cpu = {p.tier: p.cpu_seconds - cpu_before.get(p.tier, 0.0) for p in procs}
                cpu.update({k: v - cpu_before[k] for k, v in _own_cpu(broker_pid, sampler).items()})
        finally:
            await consumer.close()
    finally:
        stop_all(procs)
    topics = [names.prompts, names.episodes, names.scored, names.batches, names.dead_letter,
              names.grouping_changelog, names.producer_cursor]
    phases["tiers stopped"] = time.monotonic() - began
    sizes, after = await asyncio.gather(asyncio.to_thread(topic_bytes, services.kafka_bootstrap, topics),
                                        asyncio.to_thread(end_offsets, services.kafka_bootstrap) if count_records
                                        else asyncio.sleep(0, {}))
    before = await offsets_before
    records = {t: after.get(t, 0) - before.get(t, 0) for t in [*topics, "__transaction_state", "__consumer_offsets"]}
    phases["log sizes read"] = time.monotonic() - began
    return PipelineResult(
        groups=len(times), episodes=episodes, generated_tokens=generated, total_tokens=total,
        steady_seconds=(times[-1] - times[0]) if len(times) > 1 else float("nan"),
        wall_seconds=times[-1] - started if times else float("nan"), batch_times=times,
        topic_bytes=sizes, peak_rss={p.tier: p.peak_rss for p in procs},
        peak_tree_rss={p.tier: p.peak_tree_rss for p in procs}, peak_private={p.tier: p.peak_private for p in procs}, drops=drops, names=names, cpu_seconds=cpu, ready_rss=ready_rss, phase_seconds=phases,
        records=records,
    )


def _own_cpu(broker_pid: int | None, sampler: Sampler) -> dict[str, float]:
    """CPU seconds of this process (the trainer side: StepStream; the memory sampler's own
    time left out) and of the broker if local."""
    times = os.times()
    found = {"trainer (StepStream, this process)": times.user + times.system - sampler.cpu_seconds}
    if broker_pid is not None:
        found["kafka broker (java)"] = cpu_seconds(broker_pid)
    return found


async def _wait_ready(bootstrap: str, groups: list[str], procs: list[TierProcess], timeout: float,
                      confirm: bool) -> None:
    """The tiers' consumers started (their logs say so), then, with ``confirm``, every group
    holds its partitions (Kafka's group tool: a JVM start, so skipped for --quick)."""
    await wait_until_consuming(procs, timeout)
    if not confirm:
        return
    waiter = asyncio.create_task(wait_for_groups(bootstrap, groups, timeout))
    try:
        while not waiter.done():
            for p in procs:
                p.check_alive()
            await asyncio.wait({waiter}, timeout=0.5)
        waiter.result()
    finally:
        waiter.cancel()


def memory_rows(r: PipelineResult) -> list[dict[str, Any]]:
    """Per tier: RSS once ready (idle), peak RSS (VmHWM), peak private memory, peak RSS with children."""
    mb = 1e6
    return [{"tier": tier, "RSS when ready MB": r.ready_rss.get(tier, 0) / mb, "peak RSS MB": r.peak_rss[tier] / mb,
             "peak private MB": r.peak_private[tier] / mb, "peak RSS with children MB": r.peak_tree_rss[tier] / mb}
            for tier in r.peak_rss]
