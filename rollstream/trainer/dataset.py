"""A ``torch.utils.data.IterableDataset`` over a trainer's steps, for ``DataLoader`` loops.

    loader = DataLoader(BatchDataset(batches), batch_size=None)   # one item per step
    for batch in loader:
        train_step(batch)

A ``DataLoader`` loop has no place to commit, so the dataset commits a step when the loop
asks for the next one (the step is finished then), and the last one when the iteration ends
because the ranks stopped. A loop left early (``break``) does not commit its last step: it
is delivered again. Use ``num_workers=0`` (the default): the steps come from rank 0's Kafka
client and every rank's collectives, which must stay in the main process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from rollstream.trainer.batch import TrainingBatch
from rollstream.trainer.batches import TrainerBatches


class BatchDataset(IterableDataset):  # type: ignore[type-arg]
    """Yields ``transform(batch)`` (default: the :class:`TrainingBatch`) for each step of
    ``batches`` (started by the caller); commits as described in the module docstring."""

    def __init__(self, batches: TrainerBatches, transform: Callable[[TrainingBatch], Any] | None = None,
                 commit: bool = True) -> None:
        self.batches = batches
        self.transform = transform
        self.commit = commit

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is not None:
            raise RuntimeError("BatchDataset runs in the main process only: use DataLoader(..., num_workers=0)")
        previous: TrainingBatch | None = None
        for batch in self.batches:
            if previous is not None and self.commit:
                self.batches.commit(previous)
            previous = batch
            yield self.transform(batch) if self.transform is not None else batch
        if previous is not None and self.commit:
            self.batches.commit(previous)
