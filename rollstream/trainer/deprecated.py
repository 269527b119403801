"""Deprecated names of the trainer API: each still works and warns with the name to use.

``from rollstream.trainer import TrainerBatches`` gives :class:`TrainerSteps` with a
``DeprecationWarning`` (the package's ``__getattr__`` asks :func:`alias`), and
``next_batch`` on :class:`TrainerSteps` / :class:`StepStream` is ``next_step`` with the same
warning (:class:`DeprecatedMethod`).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: deprecated name -> (module, name to use)
NAMES: dict[str, tuple[str, str]] = {
    "TrainerBatches": ("rollstream.trainer.trainer_steps", "TrainerSteps"),
    "TrainingBatch": ("rollstream.trainer.training_step", "TrainingStep"),
    "BatchStream": ("rollstream.trainer.stream", "StepStream"),
    "BatchDataset": ("rollstream.trainer.dataset", "StepDataset"),
    "BatchAccumulator": ("rollstream.trainer.accumulator", "StepAccumulator"),
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    """Warn at the caller ``stacklevel`` frames above this function's caller."""
    warnings.warn(f"rollstream.trainer: {old} is deprecated, use {new}", DeprecationWarning, stacklevel=stacklevel + 1)


def alias(name: str) -> Any:
    """The object a deprecated ``name`` stands for, with a ``DeprecationWarning``;
    ``AttributeError`` for any other name."""
    if name not in NAMES:
        raise AttributeError(f"module 'rollstream.trainer' has no attribute {name!r}")
    module, new = NAMES[name]
    _warn(name, new, stacklevel=3)  # alias <- the package's __getattr__ <- the importer
    return getattr(importlib.import_module(module), new)


class DeprecatedMethod:
    """A method under a deprecated name: calls the method ``new`` of the same object, warning."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = f"{owner.__name__}.{name}"

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        _warn(self.old, f"{type(obj).__name__}.{self.new}", stacklevel=2)
        return getattr(obj, self.new)
