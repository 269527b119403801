"""Logging setup for every tier: one line per event, secrets masked wherever they appear.

Two formats (``log_format`` in the config; environment ``ROLLSTREAM__LOG_FORMAT``):

- ``text`` (the default): ``2026-11-30 12:00:00,123 INFO rollstream.cli [producer] message``;
- ``json``: one JSON object per line with ``time`` (UTC, ISO 8601, milliseconds), ``level``,
  ``logger``, ``tier`` (the process's, unless the call names one in ``extra``) and ``message``; ``exception`` (the traceback) when there is one; and
  every field the call passed in ``extra`` (``log.info("...", extra={"task_id": task_id})``: the
  tiers use ``task_id`` for one task, ``task_ids`` for several, ``sample_idx`` for a sample).
  A value JSON cannot hold is written as its ``str``; an extra field named like one of the
  fields above is left out (those keep their meaning).

Secrets (``rollstream.config.secret_values``) are replaced by ``***`` in the message and the
traceback, and in JSON lines in every field too (before JSON escaping, so a secret with quotes
or backslashes is caught as well and the line stays valid JSON).
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Iterable
from typing import Any, Literal

import msgspec

LogFormat = Literal["text", "json"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(tier)s] %(message)s"
# LogRecord's own attributes (and what formatting adds): whatever else a record has came from `extra`
_RECORD_FIELDS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "tier", "taskName",
}
_JSON_FIELDS = ("time", "level", "logger", "tier", "message", "exception")


class SecretMasker:
    """Replaces every configured secret in a text with ``***`` (longest first, so a secret that
    contains another is masked whole)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def mask(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def mask_value(self, value: Any) -> Any:
        """``value`` as JSON can hold it, every string in it masked: lists and dicts element by
        element (keys as strings), numbers, booleans and None as they are, anything else as its
        masked ``str``."""
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, (list, tuple, set, frozenset)):
            return [self.mask_value(v) for v in value]
        if isinstance(value, dict):
            return {self.mask(str(k)): self.mask_value(v) for k, v in value.items()}
        return self.mask(value if isinstance(value, str) else str(value))


class SecretMaskFilter(logging.Filter):
    """Replaces every configured secret in a record's final message with ``***``."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self._masker = SecretMasker(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._masker.secrets:
            return True
        message = record.getMessage()
        masked = self._masker.mask(message)
        if masked != message or record.exc_info:
            record.msg, record.args = masked, None
            if record.exc_info:
                text = logging.Formatter().formatException(record.exc_info)
                record.exc_text, record.exc_info = self._masker.mask(text), None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring for its fields)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._masker = SecretMasker(secrets)
        self._encoder = msgspec.json.Encoder()

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "tier": getattr(record, "tier", ""),
            "message": record.getMessage(),
        }
        exception = record.exc_text or (self.formatException(record.exc_info) if record.exc_info else "")
        if record.stack_info:
            exception = "\n".join(filter(None, (exception, self.formatStack(record.stack_info))))
        if exception:
            fields["exception"] = exception
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and key not in _JSON_FIELDS:
                fields[key] = value
        # masked field by field, extras included, before encoding: the line stays valid JSON
        return self._encoder.encode(self._masker.mask_value(fields)).decode()


class _TierFilter(logging.Filter):
    def __init__(self, tier: str) -> None:
        super().__init__()
        self._tier = tier

    def filter(self, record: logging.LogRecord) -> bool:
        record.tier = getattr(record, "tier", self._tier)
        return True


# The logger hierarchy as the standard library made it, remembered when this module is first
# imported (every tier imports it before any workflow code).
_STANDARD_ROOT = logging.Logger.root
_STANDARD_MANAGER = logging.Logger.manager
_restored_once = False


def restore_standard_logging() -> bool:
    """Put the standard library's logger hierarchy back if a library replaced it; True when it did.

    ``areal.utils.logging.getLogger`` (called when any AReaL module is imported) assigns a new
    ``logging.Logger.root`` and ``logging.Logger.manager``: every logger created afterwards
    hangs under a root without handlers, so rollstream's lines would lose their format, their
    secret masking and, below WARNING, themselves. Loggers the library made keep what it gave
    them. Cheap when nothing changed; called after workflow code is loaded and around AReaL
    episodes (``rollstream.areal.workflow``)."""
    global _restored_once
    if logging.Logger.manager is _STANDARD_MANAGER and logging.Logger.root is _STANDARD_ROOT:
        return False
    logging.Logger.root = _STANDARD_ROOT
    logging.Logger.manager = _STANDARD_MANAGER
    if not _restored_once:
        _restored_once = True
        logging.getLogger(__name__).warning(
            "a library replaced Python's logger hierarchy (AReaL's logging.getLogger does when imported); "
            "restored it, so rollstream's log lines keep their handlers and secret masking")
    return True


def setup_logging(tier: str, level: str = "INFO", secrets: Iterable[str] = (), log_format: LogFormat = "text") -> None:
    """Configure the root logger for a tier process (idempotent): lines to stderr in
    ``log_format`` ("text" or "json"), secrets masked."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be 'text' or 'json', got {log_format!r}")
    secrets = list(secrets)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_rollstream", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._rollstream = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter(secrets) if log_format == "json" else logging.Formatter(_FORMAT))
    handler.addFilter(_TierFilter(tier))
    handler.addFilter(SecretMaskFilter(secrets))
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "kafka", "httpx", "httpx2"):  # httpx: one line per agent request
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # A few lines per rebalance and member: why a group rejoined (a member joined or left, a
    # topic's metadata changed), its generation and what was assigned.
    logging.getLogger("aiokafka.consumer.group_coordinator").setLevel(root.level)
