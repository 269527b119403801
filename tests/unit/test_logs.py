"""Log lines: text or JSON (task ids as fields), and secrets never reach the output, whatever
the logger, the exception or an extra field says."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from rollstream.cli import run_tier
from rollstream.reward_workers.service import declare
from rollstream.tier.declaration import Tier
from rollstream.config import ConfigError, RollstreamConfig, load_config, redacted, secret_values
from rollstream.runtime.logs import setup_logging


def test_secrets_are_masked_in_messages_arguments_and_tracebacks(capfd: pytest.CaptureFixture[str]) -> None:
    config = load_config(
        overrides=[
            "kafka.security_protocol=SASL_PLAINTEXT",
            "kafka.sasl_mechanism=SCRAM-SHA-256",
            "kafka.sasl_username=alice",
            "kafka.sasl_password=kafka-pw-123",
            "redis.url=redis://:redis-pw-456@127.0.0.1:6379/0",
        ],
        environ={},
    )
    setup_logging("test", "INFO", secret_values(config))
    log = logging.getLogger("rollstream.test")
    log.info("config %s", redacted(config))
    log.info("connecting with password %s", "kafka-pw-123")
    log.warning("redis url is redis://:redis-pw-456@127.0.0.1:6379/0")
    try:
        raise RuntimeError("auth failed for kafka-pw-123")
    except RuntimeError:
        log.exception("failure")
    err = capfd.readouterr().err
    assert "kafka-pw-123" not in err
    assert "redis-pw-456" not in err
    assert err.count("***") >= 4
    assert "auth failed" in err


SECRET_CONFIG = [
    "kafka.security_protocol=SASL_PLAINTEXT",
    "kafka.sasl_mechanism=SCRAM-SHA-256",
    "kafka.sasl_username=alice",
    'kafka.sasl_password=pw"with\\quote-789',  # JSON escapes it: masked before escaping
    "redis.url=redis://:redis-pw-456@127.0.0.1:6379/0",
]


def json_lines(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_json_lines_carry_time_level_logger_tier_message_and_task_ids(capfd: pytest.CaptureFixture[str]) -> None:
    setup_logging("rollout-worker", "INFO", (), "json")
    log = logging.getLogger("rollstream.test")
    log.info("task %s: all %d samples published", "t-1", 8, extra={"task_id": "t-1"})
    log.warning("sample %d", 3, extra={"task_id": "t-2", "sample_idx": 3, "where": Path("/x"), "tags": {"a"}})
    log.debug("not at INFO")
    first, second = json_lines(capfd.readouterr().err)
    assert first["level"] == "INFO" and first["logger"] == "rollstream.test" and first["tier"] == "rollout-worker"
    assert first["message"] == "task t-1: all 8 samples published" and first["task_id"] == "t-1"
    when = datetime.datetime.fromisoformat(first["time"])
    assert when.tzinfo is not None and abs(time.time() - when.timestamp()) < 60
    assert "exception" not in first and "args" not in first and "msg" not in first  # no LogRecord internals
    assert second == {**second, "level": "WARNING", "task_id": "t-2", "sample_idx": 3, "where": "/x", "tags": ["a"]}


def test_json_extra_fields_cannot_replace_the_standard_ones(capfd: pytest.CaptureFixture[str]) -> None:
    setup_logging("grouping", "INFO", (), "json")
    log = logging.getLogger("rollstream.test")
    log.info("hello", extra={"level": "FAKE", "time": 0, "exception": "none", "task_ids": ["a", "b"]})
    log.info("from another tier", extra={"tier": "trainer"})  # a record may name its tier, as in text
    first, second = json_lines(capfd.readouterr().err)
    assert first["level"] == "INFO" and first["time"] != 0 and "exception" not in first
    assert first["tier"] == "grouping" and first["task_ids"] == ["a", "b"]
    assert second["tier"] == "trainer"


def test_secrets_are_masked_in_json_lines_everywhere(capfd: pytest.CaptureFixture[str]) -> None:
    config = load_config(overrides=[*SECRET_CONFIG, "log_format=json"], environ={})
    password = config.kafka.sasl_password
    assert password and '"' in password and "\\" in password
    setup_logging("test", "INFO", secret_values(config), config.log_format)
    log = logging.getLogger("rollstream.test")
    log.info("config %s", redacted(config))
    log.info("connecting with password %s", password, extra={"dsn": f"sasl://alice:{password}@h", "more": [password]})
    try:
        raise RuntimeError(f"auth failed for {password} at redis://:redis-pw-456@h")
    except RuntimeError:
        log.exception("failure", extra={"task_id": "t-9"})
    err = capfd.readouterr().err
    lines = json_lines(err)  # every line still valid JSON
    assert len(lines) == 3
    for secret in (password, json.dumps(password)[1:-1], "redis-pw-456", "kafka-pw"):
        assert secret not in err
    assert lines[1]["message"] == "connecting with password ***"
    assert lines[1]["dsn"] == "sasl://alice:***@h" and lines[1]["more"] == ["***"]
    assert lines[2]["task_id"] == "t-9" and "RuntimeError: auth failed for *** at redis://:***@h" in lines[2]["exception"]


def test_text_format_is_unchanged_by_extra_fields(capfd: pytest.CaptureFixture[str]) -> None:
    setup_logging("producer", "INFO", (), "text")
    logging.getLogger("rollstream.test").info("task %s done", "t-1", extra={"task_id": "t-1"})
    err = capfd.readouterr().err.strip()
    assert err.endswith("INFO rollstream.test [producer] task t-1 done") and not err.startswith("{")


def test_log_format_from_config_and_environment() -> None:
    assert load_config(environ={}).log_format == "text"
    assert load_config(environ={"ROLLSTREAM__LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(ConfigError, match="log_format"):
        load_config(overrides=["log_format=xml"], environ={})
    with pytest.raises(ValueError, match="log_format"):
        setup_logging("test", "INFO", (), "xml")  # type: ignore[arg-type]


def test_a_tier_started_with_log_format_json_logs_json(capfd: pytest.CaptureFixture[str]) -> None:
    async def scores(tier: Tier, config: RollstreamConfig, stop: asyncio.Event) -> None:
        logging.getLogger("rollstream.test").info("scored", extra={"task_ids": ["t-1", "t-2"]})

    config = load_config(overrides=["log_format=json", "reward.worker_id=w-1"], environ={})
    assert run_tier(declare(config), config, scores) == 0
    lines = json_lines(capfd.readouterr().err)
    assert lines[0]["message"].startswith("starting reward-worker w-1 with config")
    assert {"message": "scored", "task_ids": ["t-1", "t-2"], "tier": "reward-worker"}.items() <= lines[1].items()
    assert lines[-1]["message"] == "reward-worker w-1 stopped"


async def test_the_reward_tiers_commit_log_names_its_tasks_as_a_field(caplog: pytest.LogCaptureFixture) -> None:
    from rollstream.reward_workers.transform import RewardTransform
    from rollstream.kafka.consume_transform_produce import PartitionOutput
    from rollstream.kafka.topics import TopicNames

    transform = RewardTransform(TopicNames("e", "t"), scorer=None)  # type: ignore[arg-type]  # not scoring here
    out = PartitionOutput(1, 1 << 20)
    for task in ("t-2", "t-1", "t-2"):
        out.send("scored", b"x", key=task.encode())
    out.offset = 3
    with caplog.at_level(logging.INFO, logger="rollstream.reward_workers.transform"):
        await transform.committed(1, out)
    (record,) = [r for r in caplog.records if "committed" in r.getMessage()]
    assert record.task_ids == ["t-1", "t-2"] and record.partition == 1  # type: ignore[attr-defined]
