"""The trainer's old names are refused with the name to use."""

from __future__ import annotations

import importlib

import pytest

import rollstream.trainer as trainer
from rollstream.trainer import RENAMED, StepStream, TrainerSteps


@pytest.mark.parametrize(("old", "new"), [
    ("TrainerBatches", "TrainerSteps"),
    ("TrainingBatch", "TrainingStep"),
    ("BatchStream", "StepStream"),
    ("BatchDataset", "StepDataset"),
    ("BatchAccumulator", "StepAccumulator"),
    ("batch_group", "emitted_group_rows"),
])
def test_an_old_name_is_refused_naming_the_new_one(old: str, new: str) -> None:
    assert getattr(trainer, new) is not None
    with pytest.raises(ImportError, match=rf"rollstream.trainer.{old} was renamed: use {new}"):
        getattr(trainer, old)
    with pytest.raises(ImportError, match=rf"rollstream.trainer.{old} was renamed: use {new}"):
        exec(f"from rollstream.trainer import {old}", {})


def test_every_old_name_is_tested_and_none_is_in_all() -> None:
    assert set(RENAMED) == {"TrainerBatches", "TrainingBatch", "BatchStream", "BatchDataset", "BatchAccumulator",
                            "batch_group"}
    assert not set(RENAMED) & set(trainer.__all__)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        trainer.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        exec("from rollstream.trainer import NoSuchThing", {})
    assert importlib.import_module("rollstream.trainer.ranks").Ranks is not None


def test_next_batch_is_gone() -> None:
    assert not hasattr(StepStream, "next_batch")
    assert not hasattr(TrainerSteps, "next_batch")
