"""Logging setup for every tier: one line per event, secrets masked wherever they appear."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(tier)s] %(message)s"


class SecretMaskFilter(logging.Filter):
    """Replaces every configured secret in a record's final message with ``***``."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._secrets:
            return True
        message = record.getMessage()
        masked = message
        for secret in self._secrets:
            masked = masked.replace(secret, "***")
        if masked != message or record.exc_info:
            record.msg, record.args = masked, None
            if record.exc_info:
                text = logging.Formatter().formatException(record.exc_info)
                for secret in self._secrets:
                    text = text.replace(secret, "***")
                record.exc_text, record.exc_info = text, None
        return True


class _TierFilter(logging.Filter):
    def __init__(self, tier: str) -> None:
        super().__init__()
        self._tier = tier

    def filter(self, record: logging.LogRecord) -> bool:
        record.tier = getattr(record, "tier", self._tier)
        return True


def setup_logging(tier: str, level: str = "INFO", secrets: Iterable[str] = ()) -> None:
    """Configure the root logger for a tier process (idempotent)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_rollstream", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._rollstream = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_TierFilter(tier))
    handler.addFilter(SecretMaskFilter(secrets))
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "kafka", "httpx", "httpx2"):  # httpx: one line per agent request
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
