"""The trainer side: steps from ``batches``, weight versions to Redis (docs/TRAINER.md).

Synchronous, one process or every rank of a ``torchrun`` job::

    from rollstream.trainer import TrainerSteps

    with TrainerSteps(config) as steps:
        for step in steps:             # this rank's share of one step
            train_step(step.tensors)
            steps.commit(step)         # once every rank finished it; never delivered again

Steps:

- :class:`TrainerSteps`: this rank's share of each step; synchronous, one process or ``torchrun``
- :class:`StepStream`: each step, for an asyncio trainer in one process
- :class:`StepDataset`: a ``torch.utils.data.IterableDataset`` over a :class:`TrainerSteps`
- :class:`TrainingStep`: one step's groups (this rank's share) padded into ``[N, L]`` tensors
- :class:`RankFailed` / :class:`CollectiveFailed`: a rank of the job was lost / a collective failed
- :class:`CommitRefused`: the consumer group would not take a step's commit

Layouts of a :class:`TrainingStep`:

- :func:`pack` / :func:`unpack`: varlen rows with ``cu_seqlens``, and back
- :func:`to_areal`: the dict AReaL's PPO actor reads
- :func:`to_verl` (:class:`VerlBatch`): the parts of a verl ``DataProto``

Weights and bookkeeping:

- :class:`Checkpoints` (:class:`Checkpoint`, :class:`CheckpointError`): checkpoints complete or invisible
- :class:`VersionPublisher` / :class:`SyncVersionPublisher` (:class:`VersionRefused`): versions to Redis, only up
- :class:`StepLedger` (:class:`LedgerEntry`, :class:`LedgerMismatch`, :func:`ledger_path`): the committed steps

Replay (recorded steps fed to a trainer, nothing committed; :class:`ReplayError`):

- :class:`LedgerReplay`: steps the ledger recorded
- :class:`RangeReplay`: a range of offsets of ``batches``
- :class:`DumpReplay`: a ``rollstream replay batches --to-jsonl`` file

Building blocks:

- :class:`KafkaStepSource`: the live source of steps (``batches`` in the trainer's consumer group)
- :class:`StepAccumulator`: groups record by record into steps, with the offsets to commit
- :class:`GroupRows`, :func:`emitted_group_rows`, :func:`assemble`: a record's group, groups into a :class:`TrainingStep`
- :func:`split_by_tokens`: a step's groups split between ranks

Rank coordination lives in :mod:`rollstream.trainer.ranks`.
"""

from typing import Any

from rollstream.trainer.accumulator import StepAccumulator
from rollstream.trainer.checkpoints import Checkpoint, CheckpointError, Checkpoints
from rollstream.trainer.dataset import StepDataset
from rollstream.trainer.kafka_source import CommitRefused, KafkaStepSource, ledger_path
from rollstream.trainer.layouts import VerlBatch, pack, to_areal, to_verl, unpack
from rollstream.trainer.ledger import LedgerEntry, LedgerMismatch, StepLedger
from rollstream.trainer.ranks.split import split_by_tokens
from rollstream.trainer.replay import DumpReplay, LedgerReplay, RangeReplay, ReplayError
from rollstream.trainer.stream import StepStream
from rollstream.trainer.trainer_steps import CollectiveFailed, RankFailed, TrainerSteps
from rollstream.trainer.training_step import GroupRows, TrainingStep, assemble, emitted_group_rows
from rollstream.trainer.version_publisher import SyncVersionPublisher, VersionPublisher, VersionRefused


#: renamed -> the name to use; an old name is refused with it
RENAMED = {
    "TrainerBatches": "TrainerSteps",
    "TrainingBatch": "TrainingStep",
    "BatchStream": "StepStream",
    "BatchDataset": "StepDataset",
    "BatchAccumulator": "StepAccumulator",
    "batch_group": "emitted_group_rows",
}


def __getattr__(name: str) -> Any:
    """An old name of :data:`RENAMED` is an ``ImportError`` naming the one to use (an
    ``AttributeError`` would reach ``from rollstream.trainer import ...`` without its message)."""
    if name in RENAMED:
        raise ImportError(f"rollstream.trainer.{name} was renamed: use {RENAMED[name]}", name=name)
    raise AttributeError(f"module 'rollstream.trainer' has no attribute {name!r}")


__all__ = [
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
    "StepAccumulator",
    "StepDataset",
    "StepLedger",
    "StepStream",
    "SyncVersionPublisher",
    "TrainerSteps",
    "TrainingStep",
    "VerlBatch",
    "VersionPublisher",
    "VersionRefused",
    "assemble",
    "emitted_group_rows",
    "ledger_path",
    "pack",
    "split_by_tokens",
    "to_areal",
    "to_verl",
    "unpack",
]
