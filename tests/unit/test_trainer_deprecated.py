"""The trainer's deprecated names still work and warn with the name to use."""

from __future__ import annotations

import importlib

import pytest

import rollstream.trainer as trainer
from rollstream.trainer import StepAccumulator, StepDataset, StepStream, TrainerSteps, TrainingStep
from rollstream.trainer.deprecated import NAMES


@pytest.mark.parametrize(("old", "new"), [
    ("TrainerBatches", TrainerSteps),
    ("TrainingBatch", TrainingStep),
    ("BatchStream", StepStream),
    ("BatchDataset", StepDataset),
    ("BatchAccumulator", StepAccumulator),
])
def test_an_old_name_is_the_new_object_and_warns_naming_it(old: str, new: type) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated, use {new.__name__}"):
        assert getattr(trainer, old) is new
    with pytest.warns(DeprecationWarning, match=new.__name__):
        namespace: dict[str, object] = {}
        exec(f"from rollstream.trainer import {old}", namespace)
    assert namespace[old] is new


def test_every_old_name_is_tested_and_none_is_in_all() -> None:
    assert set(NAMES) == {"TrainerBatches", "TrainingBatch", "BatchStream", "BatchDataset", "BatchAccumulator"}
    assert not set(NAMES) & set(trainer.__all__)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        trainer.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        exec("from rollstream.trainer import NoSuchThing", {})
    assert importlib.import_module("rollstream.trainer.ranks").Ranks is not None


class _Source:
    """Enough of a step source for next_step to ask it once."""

    topic = "t"
    exhausted = True

    async def next_step(self, timeout: float | None) -> None:
        return None


def _stream() -> StepStream:
    stream = StepStream.__new__(StepStream)
    stream.source = _Source()  # type: ignore[assignment]
    return stream


async def test_next_batch_is_next_step_and_warns() -> None:
    stream = _stream()
    with pytest.warns(DeprecationWarning, match=r"StepStream.next_batch is deprecated, use StepStream.next_step"):
        method = stream.next_batch
    assert method == stream.next_step
    assert await method(timeout=0) is None
    assert StepStream.next_batch is StepStream.__dict__["next_batch"]  # no warning on the class
    with pytest.warns(DeprecationWarning, match=r"TrainerSteps.next_batch is deprecated, use TrainerSteps.next_step"):
        bound = TrainerSteps.__new__(TrainerSteps).next_batch
    assert bound.__func__ is TrainerSteps.next_step
