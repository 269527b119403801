"""Topic names for one experiment trial. Every name carries the experiment and trial."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollstream.config import RollstreamConfig

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _safe(part: str) -> str:
    cleaned = _SAFE.sub("-", part)
    if not cleaned:
        raise ValueError("experiment and trial names must not be empty")
    return cleaned


class _Role:
    """The topic of one role, read as an attribute of :class:`TopicNames`."""

    def __init__(self, role: str) -> None:
        self.role = role

    def __get__(self, names: TopicNames, owner: type | None = None) -> str:
        return names.topic(self.role)


@dataclass(frozen=True)
class TopicNames:
    """``rs.<experiment>.<trial>.<role>`` for each role in the pipeline."""

    experiment: str
    trial: str
    extra_roles: tuple[str, ...] = ()  # data topics of a tier of one's own (rollstream.tier), beside the trial's

    @classmethod
    def of(cls, config: RollstreamConfig) -> TopicNames:
        """The topics of ``config``'s trial."""
        return cls(config.experiment.experiment_name, config.experiment.trial_name)

    prompts = _Role("prompts")
    episodes = _Role("episodes")
    scored = _Role("scored")
    batches = _Role("batches")
    dead_letter = _Role("dead-letter")
    # Compacted; co-partitioned with ``scored`` (partition p records scored partition p).
    grouping_changelog = _Role("grouping-changelog")
    # Compacted; the dataset cursor each producer commits with its prompts.
    producer_cursor = _Role("producer-cursor")

    def topic(self, role: str) -> str:
        """The topic of ``role``: one of the roles above (``dead-letter`` with its dash) or one of
        :attr:`extra_roles`."""
        return f"rs.{_safe(self.experiment)}.{_safe(self.trial)}.{role}"

    def with_roles(self, roles: list[str]) -> TopicNames:
        """These names, with the roles in ``roles`` that are not the trial's own as data topics."""
        own = {self.role_of(topic) for topic in self.data_topics() + self.compacted_topics()}
        extra = tuple(dict.fromkeys([*self.extra_roles, *(r for r in roles if r not in own)]))
        return TopicNames(self.experiment, self.trial, extra)

    def data_topics(self) -> list[str]:
        extra = [self.topic(role) for role in self.extra_roles]
        return [self.prompts, self.episodes, self.scored, self.batches, self.dead_letter, *extra]

    def compacted_topics(self) -> list[str]:
        return [self.grouping_changelog, self.producer_cursor]

    def role_of(self, topic: str) -> str | None:
        prefix = self.topic("")
        return topic[len(prefix) :] if topic.startswith(prefix) else None

    def group_id(self, tier: str) -> str:
        """Consumer group id of ``tier`` for this trial."""
        return self.topic(tier)
