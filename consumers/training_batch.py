"""Kept for existing imports: the trainer's batches now live in ``rollstream.trainer``.

``TrainingBatch``, ``GroupRows``, ``split_groups`` and ``assemble`` are in
:mod:`rollstream.trainer.batch`; ``BatchAccumulator`` and ``RecentTasks`` in
:mod:`rollstream.trainer.accumulator`.
"""

from rollstream.trainer.accumulator import BatchAccumulator, RecentTasks, StepGroups
from rollstream.trainer.batch import GroupRows, TrainingBatch, assemble, split_groups

__all__ = ["BatchAccumulator", "GroupRows", "RecentTasks", "StepGroups", "TrainingBatch", "assemble", "split_groups"]
