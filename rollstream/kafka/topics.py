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


@dataclass(frozen=True)
class TopicNames:
    """``rs.<experiment>.<trial>.<role>`` for each role in the pipeline."""

    experiment: str
    trial: str

    @classmethod
    def of(cls, config: RollstreamConfig) -> TopicNames:
        """The topics of ``config``'s trial."""
        return cls(config.experiment.experiment_name, config.experiment.trial_name)

    def _name(self, role: str) -> str:
        return f"rs.{_safe(self.experiment)}.{_safe(self.trial)}.{role}"

    @property
    def prompts(self) -> str:
        return self._name("prompts")

    @property
    def episodes(self) -> str:
        return self._name("episodes")

    @property
    def scored(self) -> str:
        return self._name("scored")

    @property
    def batches(self) -> str:
        return self._name("batches")

    @property
    def dead_letter(self) -> str:
        return self._name("dead-letter")

    @property
    def grouping_changelog(self) -> str:
        """Compacted; co-partitioned with ``scored`` (partition p records scored partition p)."""
        return self._name("grouping-changelog")

    @property
    def producer_cursor(self) -> str:
        """Compacted; the dataset cursor each producer commits with its prompts."""
        return self._name("producer-cursor")

    def data_topics(self) -> list[str]:
        return [self.prompts, self.episodes, self.scored, self.batches, self.dead_letter]

    def compacted_topics(self) -> list[str]:
        return [self.grouping_changelog, self.producer_cursor]

    def role_of(self, topic: str) -> str | None:
        prefix = self._name("")
        return topic[len(prefix) :] if topic.startswith(prefix) else None

    def group_id(self, tier: str) -> str:
        """Consumer group id of ``tier`` for this trial."""
        return f"rs.{_safe(self.experiment)}.{_safe(self.trial)}.{tier}"
