"""The chaos run's observer without a broker: a Redis sample is judged only once the trainer's
ledger was read after it, with the version the ledger says; versions may read 0 only after a
wipe; a prompt published twice and a batch with bad versions are reported once each
(bench/chaos/observe.py)."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
from aiokafka import ConsumerRecord

from bench.chaos import invariants as inv
from bench.chaos.observe import Observer
from harness.configs import pipeline_config
from harness.episodes import group
from rollstream.config import config_from_dict
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.trainer.ledger import LedgerEntry, StepLedger
from rollstream.wire import PromptTask, encode


def observer(tmp_path: Path) -> Observer:
    tree = pipeline_config("127.0.0.1:1", "redis://127.0.0.1:1/0", "obs", tmp_path, tmp_path / "d.jsonl", None)
    tree["staleness"] = {"groups_per_step": 4, "max_head_offpolicyness": 1}  # capacity (2 + v) * 4
    return Observer(config_from_dict(tree), tmp_path / "ledger.jsonl")


def record(value: bytes, timestamp_ms: int = 0) -> ConsumerRecord:
    return ConsumerRecord("t", 0, 0, timestamp_ms, 0, None, value, None, 0, len(value), [])


def test_a_redis_sample_waits_for_the_ledger_read_after_it_and_uses_its_version(tmp_path: Path) -> None:
    seen = observer(tmp_path)
    ledger = StepLedger(tmp_path / "ledger.jsonl")
    now = time.time()
    ledger.append([LedgerEntry(step=1, offsets={0: 1}, task_ids=["a"], records=[[0, 0]], ranks=[["a"]],
                               written_at=now - 5)])
    seen.sampled(now - 1, admitted=12, dropped=0, version=1)  # capacity 12 at version 1: fine
    seen.sampled(now - 1, admitted=13, dropped=0, version=1)  # 13 > 12
    assert seen.violations == []  # not judged before the ledger is read
    seen.read_ledger()
    assert [v.invariant for v in seen.violations] == [inv.STALENESS] and "13 > " in seen.violations[0].saw
    seen.sampled(time.time() + 60, admitted=99, dropped=0, version=1)  # after the last read: waits
    seen.read_ledger()
    assert len(seen.violations) == 1


def test_the_version_in_redis_may_read_less_only_after_a_restart_that_may_have_lost_data(tmp_path: Path) -> None:
    seen = observer(tmp_path)
    seen.sampled(1.0, 0, 0, version=5)
    seen.redis_forgets()
    seen.sampled(time.time(), 0, 0, version=9)  # read just before the restart: it is still coming
    seen.sampled(time.time(), 0, 0, version=3)
    seen.redis_back()
    seen.sampled(time.time(), 0, 0, version=3)  # an earlier snapshot's version
    seen.sampled(time.time() + 1, 0, 0, version=10)  # the trainer published again
    assert seen.violations == []
    seen.sampled(time.time() + 2, 0, 0, version=0)  # no restart this time
    assert [v.invariant for v in seen.violations] == [inv.VERSIONS_UP]


def test_trained_groups_are_judged_against_their_steps_version_once_their_batch_is_read(tmp_path: Path) -> None:
    seen = observer(tmp_path)  # eta 1
    StepLedger(tmp_path / "ledger.jsonl").append(
        [LedgerEntry(step=n, offsets={0: 1}, task_ids=[], records=[], ranks=[[]]) for n in (1, 2, 3)]
        + [LedgerEntry(step=4, offsets={0: 2}, task_ids=["old"], records=[[0, 0]], ranks=[["old"]], stale=["x"],
                       written_at=7.0)])
    seen.read_ledger()
    assert seen.violations == [] and seen.stale_times == [7.0]  # its batch not read yet
    batch = build_emitted_group(group("old", [1, 1]), trainer_version=3)  # head 1: 3 - 1 = 2 > eta 1
    seen.ledger.add(batch)
    seen.on_batch(record(b""), batch)
    seen.read_ledger()
    assert [v.invariant for v in seen.violations] == [inv.TRAINED_STALENESS]


def test_prompts_and_batches_are_checked_as_they_arrive(tmp_path: Path) -> None:
    seen = observer(tmp_path)
    prompt = encode(PromptTask(task_id="p:0:1", group_size=2, data={"prompt": "x"}))
    seen.on_prompt(record(prompt, 1500))
    seen.on_prompt(record(prompt, 1600))
    assert seen.prompts == {"p:0:1": 1.5} and seen.prompt_records == 2
    assert [v.saw for v in seen.violations] == ["prompt p:0:1 published twice"]
    # a trainer version older than the batch's tail 3 that the batch says it knows
    batch = msgspec.structs.replace(build_emitted_group(group("a", [2, 3]), trainer_version=3), trainer_version=2, staleness=0)
    seen.follow(seen.ledger)
    seen.ledger.add(batch)
    seen.on_batch(record(b""), batch)
    seen.ledger.add(batch)  # the same group again: it ends twice, its rows repeat
    seen.on_batch(record(b""), batch)  # and its versions' breach, seen again, is not reported again
    assert [v.invariant for v in seen.violations[1:]] == [inv.TOKEN_VERSIONS] + [inv.ENDS_ONCE] * 3
    assert "ended 2 times" in seen.violations[2].saw and "row a/0 emitted 2 times" == seen.violations[3].saw
    assert seen.batches_checked == 2 and seen.tokens_checked == 12
