"""Secrets never reach the log output, whatever the logger or the exception says."""

from __future__ import annotations

import logging

import pytest

from rollstream.config import load_config, redacted, secret_values
from rollstream.logs import setup_logging


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
