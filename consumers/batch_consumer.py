"""Kept for existing imports: the trainer API is ``rollstream.trainer`` (docs/TRAINER.md).

``BatchConsumer`` is :class:`rollstream.trainer.BatchStream` without a ledger (as before: only
Kafka's committed offsets survive a restart); ``ack`` commits a step and answers False
instead of raising when the commit was refused. ``VersionPublisher`` is
:class:`rollstream.trainer.VersionPublisher`.
"""

from __future__ import annotations

from typing import Any

from rollstream.config import RollstreamConfig
from rollstream.trainer import BatchStream, TrainingBatch, VersionPublisher


class BatchConsumer(BatchStream):
    """:class:`~rollstream.trainer.BatchStream` with ``ledger=False`` by default."""

    def __init__(self, config: RollstreamConfig, *, ledger: bool = False, **kwargs: Any) -> None:
        super().__init__(config, ledger=ledger, **kwargs)


__all__ = ["BatchConsumer", "TrainingBatch", "VersionPublisher"]
