"""The trainer side: training batches from ``batches``, weight versions to Redis.

Synchronous, one process or every rank of a ``torchrun`` job (docs/TRAINER.md)::

    from rollstream.trainer import TrainerBatches

    with TrainerBatches(config) as batches:
        for batch in batches:          # this rank's share of one step
            train_step(batch.tensors)
            batches.commit(batch)      # once every rank finished it; never delivered again

- :class:`TrainerBatches` (sync, multi-rank; a lost rank ends every rank with a line naming it,
  :class:`RankFailed` / :class:`CollectiveFailed` for failures the ranks share or one rank
  hits), :class:`BatchStream` (asyncio, one process), :class:`BatchDataset` (a
  ``torch.utils.data.IterableDataset``);
- :class:`TrainingBatch` and the layouts: :func:`pack` (varlen), :func:`to_areal`, :func:`to_verl`;
- :class:`Checkpoints` (complete or invisible), :class:`VersionPublisher` /
  :class:`SyncVersionPublisher` (versions only go up; retention);
- :class:`LedgerReplay`, :class:`RangeReplay`, :class:`DumpReplay`: recorded steps fed to a
  trainer, nothing committed; :class:`StepLedger`: the committed steps.
"""

from rollstream.trainer.accumulator import BatchAccumulator
from rollstream.trainer.batch import GroupRows, TrainingBatch, assemble, batch_group
from rollstream.trainer.batches import CollectiveFailed, RankFailed, TrainerBatches
from rollstream.trainer.checkpoints import Checkpoint, CheckpointError, Checkpoints
from rollstream.trainer.dataset import BatchDataset
from rollstream.trainer.kafka_source import CommitRefused, KafkaStepSource, ledger_path
from rollstream.trainer.layouts import VerlBatch, pack, to_areal, to_verl, unpack
from rollstream.trainer.ledger import LedgerEntry, LedgerMismatch, StepLedger
from rollstream.trainer.replay import DumpReplay, LedgerReplay, RangeReplay, ReplayError
from rollstream.trainer.split import split_by_tokens
from rollstream.trainer.stream import BatchStream
from rollstream.trainer.versions import SyncVersionPublisher, VersionPublisher, VersionRefused

__all__ = [
    "BatchAccumulator",
    "BatchDataset",
    "BatchStream",
    "Checkpoint",
    "CheckpointError",
    "Checkpoints",
    "CollectiveFailed",
    "CommitRefused",
    "DumpReplay",
    "GroupRows",
    "KafkaStepSource",
    "LedgerEntry",
    "LedgerMismatch",
    "LedgerReplay",
    "RangeReplay",
    "RankFailed",
    "ReplayError",
    "StepLedger",
    "SyncVersionPublisher",
    "TrainerBatches",
    "TrainingBatch",
    "VerlBatch",
    "VersionPublisher",
    "VersionRefused",
    "assemble",
    "ledger_path",
    "pack",
    "split_by_tokens",
    "batch_group",
    "to_areal",
    "to_verl",
    "unpack",
]
