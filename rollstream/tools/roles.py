"""Topic roles the tools accept, and how to decode each role's records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollstream.config import KafkaConfig
from rollstream.kafka.clients import make_admin
from rollstream.kafka.topics import TopicNames
from rollstream.wire import (
    decode_batch,
    decode_dead_letter,
    decode_episode,
    decode_prompt,
    decode_scored,
)

DECODERS: dict[str, Callable[[bytes | None], Any]] = {
    "prompts": decode_prompt,
    "episodes": decode_episode,
    "scored": decode_scored,
    "batches": decode_batch,
    "dead-letter": decode_dead_letter,
}
ROLES: tuple[str, ...] = tuple(DECODERS)


def check_role(role: str) -> str:
    if role not in DECODERS:
        raise ValueError(f"unknown topic role {role!r}; expected one of {', '.join(ROLES)}")
    return role


def topic_for(names: TopicNames, role: str) -> str:
    """The topic of ``role`` in the trial named by ``names``."""
    check_role(role)
    return names.dead_letter if role == "dead-letter" else getattr(names, role)


def decode_record(role: str, value: bytes | None) -> Any:
    """The message in ``value``; raises ``WireDecodeError`` like the tiers' decoders."""
    return DECODERS[check_role(role)](value)


async def partitions_of(config: KafkaConfig, topic: str) -> list[int] | None:
    """The sorted partition numbers of ``topic``; None when it does not exist.

    Asks the admin API: a consumer only knows the partitions of topics it already follows,
    and the topic list is checked first so that no metadata request can auto-create it.
    """
    admin = make_admin(config, "tools")
    await admin.start()
    try:
        if topic not in set(await admin.list_topics()):
            return None
        for entry in await admin.describe_topics([topic]):
            if entry["topic"] == topic and entry["error_code"] == 0:
                return sorted(part["partition"] for part in entry["partitions"])
        return None
    finally:
        await admin.close()
