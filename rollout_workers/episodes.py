"""Turn what a workflow returned into the message published on ``episodes``.

Pure functions, no I/O. Every return form of ``arun_episode`` maps to exactly one message:

* a tensor dict -> :class:`Episode`, after ``rollstream.trajectory.normalize.episode_tensors`` made it
  standard (dtypes converted exactly, batch dim and attention mask added, the ``input_ids`` +
  ``output_ids`` + ``reward`` form joined into one row with the engine's logprobs and versions);
  what cannot be made standard -> failed :class:`SampleRejected` naming the key;
* a dict of :class:`Interaction` -> converted with ``interactions_to_tensors``, then as above;
* ``None`` -> :class:`SampleRejected` with ``reason="rejected"`` (a rejection, not a failure);
* anything else, or tensors that cannot be encoded -> :class:`SampleRejected` with
  ``failed=True`` and a reason naming the problem.

An exception raised by the workflow itself is turned into a failed rejection by
:func:`failed_sample`; failures and rejections are always counted apart.

Vision: an episode names the images each row showed (``Episode.row_images``, from the images
its engine calls sent; ``rollstream.rollout_workers.episode_images``) and holds their bytes in
``Episode.images`` (the runner keeps only those its prompt's run has not sent yet). Its
``data`` leaves out the prompt's ``images`` (``rollstream.vision.IMAGES_KEY``): they travel
once per group, never once per sample, and the reward tier does not receive them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rollstream.api.io_struct import ModelResponse
from rollstream.trajectory.normalize import TrajectoryError, episode_tensors
from rollstream.trajectory.staleness import PROMPT_VERSION, head_and_tail, row_spans
from rollstream.vision.images import IMAGES_KEY
from rollstream.wire import Episode, PromptTask, SampleRejected
from rollstream.wire.torch_tensors import encode_tensor_dict
from rollstream.rollout_workers.episode_images import episode_images

MAX_REASON_CHARS = 500


def rejected_sample(task: PromptTask, sample_idx: int) -> SampleRejected:
    """The message for a sample the workflow rejected on purpose (returned ``None``)."""
    return SampleRejected(
        task_id=task.task_id, sample_idx=sample_idx, group_size=task.group_size,
        is_eval=task.is_eval, reason="rejected", failed=False,
    )


def failed_sample(task: PromptTask, sample_idx: int, reason: str) -> SampleRejected:
    """The message for a sample that failed (an exception or a malformed result)."""
    return SampleRejected(
        task_id=task.task_id, sample_idx=sample_idx, group_size=task.group_size,
        is_eval=task.is_eval, reason=reason[:MAX_REASON_CHARS], failed=True,
    )


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def to_episode(
    task: PromptTask, sample_idx: int, result: Any, stop_reason: str, worker_id: str,
    fallback_version: int = PROMPT_VERSION, responses: Sequence[ModelResponse] = (),
    image_data: Sequence[Sequence[Any]] = (),
) -> Episode | SampleRejected:
    """The message for sample ``sample_idx`` of ``task`` whose workflow returned ``result``;
    ``fallback_version`` (the engine's version) versions generated tokens that have none;
    ``responses`` are the engine responses of the episode, oldest first, and ``image_data``
    the images each of its engine calls sent."""
    if result is None:
        return rejected_sample(task, sample_idx)
    try:
        td = episode_tensors(result, responses)
        trajectory = encode_tensor_dict(td)
    except TrajectoryError as exc:
        return failed_sample(task, sample_idx, str(exc))
    except (TypeError, ValueError) as exc:  # e.g. a dtype the wire format does not carry
        return failed_sample(task, sample_idx, f"cannot encode trajectory: {describe_error(exc)}")
    try:
        shown = episode_images(result, td["input_ids"].shape[0], image_data)
    except ValueError as exc:
        return failed_sample(task, sample_idx, f"cannot ship the episode's images: {exc}")
    head, tail = head_and_tail(row_spans(td, fallback_version))
    return Episode(
        task_id=task.task_id,
        sample_idx=sample_idx,
        group_size=task.group_size,
        trajectory=trajectory,
        is_eval=task.is_eval,
        data=task.data if IMAGES_KEY not in task.data else {k: v for k, v in task.data.items() if k != IMAGES_KEY},
        stop_reason=stop_reason,
        head_version=head,
        tail_version=tail,
        has_reward="rewards" in td,
        worker_id=worker_id,
        generated_at=time.time(),
        row_images=shown.row_images,
        images=shown.images,
    )

