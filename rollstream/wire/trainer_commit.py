"""What the trainer's consumer group commits beside its offsets on ``batches``.

Kafka keeps a metadata string with every committed offset, durably and replicated in
``__consumer_offsets``. The trainer writes a :class:`TrainerCommit` there (JSON) with each
step: the step and how many groups it has dropped as stale since the trial began. That count
returns staleness slots (``rollstream.state.budget``), and a budget rebuilt from the topics
reads it back from Kafka (``rollstream.producers.budget_restore``), so a Redis that forgot it
(or came back older) cannot take those slots away for good.
"""

from __future__ import annotations

import msgspec

SCHEMA_VERSION = 1


class TrainerCommit(msgspec.Struct, kw_only=True):
    """The trainer's commit metadata: ``step`` committed, ``stale_dropped`` groups dropped as
    stale in all committed steps so far (cumulative, so a repeat is harmless)."""

    schema_version: int = SCHEMA_VERSION
    step: int
    stale_dropped: int = 0


_decoder = msgspec.json.Decoder(TrainerCommit)


def encode_commit(commit: TrainerCommit) -> str:
    return msgspec.json.encode(commit).decode()


def decode_commit(metadata: str | None) -> TrainerCommit | None:
    """The commit in ``metadata``; None for an empty string or something else (a commit made
    by another tool, or a newer schema)."""
    if not metadata:
        return None
    try:
        commit = _decoder.decode(metadata)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    return commit if commit.schema_version <= SCHEMA_VERSION else None
