"""A ``torch.utils.data.IterableDataset`` over a trainer's steps, for ``DataLoader`` loops.

    loader = DataLoader(StepDataset(steps), batch_size=None)   # one item per step
    for step in loader:
        train_step(step)

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

from rollstream.trainer.trainer_steps import TrainerSteps
from rollstream.trainer.training_step import TrainingStep


class StepDataset(IterableDataset):  # type: ignore[type-arg]
    """Yields ``transform(step)`` (default: the :class:`TrainingStep`) for each step of
    ``steps`` (started by the caller); commits as described in the module docstring."""

    def __init__(self, steps: TrainerSteps, transform: Callable[[TrainingStep], Any] | None = None,
                 commit: bool = True) -> None:
        self.steps = steps
        self.transform = transform
        self.commit = commit

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is not None:
            raise RuntimeError("StepDataset runs in the main process only: use DataLoader(..., num_workers=0)")
        previous: TrainingStep | None = None
        for step in self.steps:
            if previous is not None and self.commit:
                self.steps.commit(previous)
            previous = step
            yield self.transform(step) if self.transform is not None else step
        if previous is not None and self.commit:
            self.steps.commit(previous)
