"""Topic roles the tools accept, and how to decode each role's records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollstream.kafka.topics import TopicNames
from rollstream.wire import (
    decode_dead_letter,
    decode_episode,
    decode_group,
    decode_prompt,
    decode_scored,
)

DECODERS: dict[str, Callable[[bytes | None], Any]] = {
    "prompts": decode_prompt,
    "episodes": decode_episode,
    "scored": decode_scored,
    "batches": decode_group,
    "dead-letter": decode_dead_letter,
}
ROLES: tuple[str, ...] = tuple(DECODERS)


def check_role(role: str) -> str:
    if role not in DECODERS:
        raise ValueError(f"unknown topic role {role!r}; expected one of {', '.join(ROLES)}")
    return role


def topic_for(names: TopicNames, role: str) -> str:
    """The topic of ``role`` in the trial named by ``names``."""
    return names.topic(check_role(role))


def decode_record(role: str, value: bytes | None) -> Any:
    """The message in ``value``; raises ``WireDecodeError`` like the tiers' decoders."""
    return DECODERS[check_role(role)](value)
