"""Group filters: functions named in the grouping config that see each complete train group.

AReaL's dynamic filtering (``should_accept_fn``, DAPO's zero-variance filter)
has its home here. ``grouping.group_filters`` lists import strings
(``"pkg.module:fn"``; configuration names code, messages never do); each names
``fn(group) -> bool``, called once per complete train group, in order, until one answers False:
the group is then dropped with reason ``filtered`` (a ``dropped`` record on ``batches``,
counted per reason, its staleness slot returned so the producer admits another prompt in its
place). Eval groups are never filtered. ``grouping.drop_equal_rewards: true`` puts the built-in
:func:`distinct_rewards` first.

What a filter gets is a :class:`GroupTrajectory`: a read-only mapping of the group's rows, padded
as the trainer will get them (``input_ids``, ``attention_mask``, ``loss_mask``, ``logprobs``,
``versions``, ``rewards`` ``[rows]``, ...: numpy arrays, as the torch-free grouping tier holds
them, bfloat16 as its 2-byte words; padded with ``grouping.pad_value`` as the emitted group is), so AReaL's ``lambda traj: traj["rewards"].std() > 0``
works as written; plus the group's ``task_id``, ``group_size``, ``rejected``, ``failed`` and
``head_version``. Only ``rewards`` is cheap; other keys are padded on first use. A filter that
raises drops the group as ``filtered`` with the error in the drop's detail (logged as an error):
a group nobody could judge is not trained on, as AReaL rejects such a trajectory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy

from rollstream.config import GroupingConfig
from rollstream.consumers.grouping.records import episode_rows
from rollstream.consumers.grouping.groups import CompleteGroup, GroupFilter
from rollstream.imports import import_callable
from rollstream.trajectory.padding import align_keys, concat_padded_arrays

log = logging.getLogger(__name__)

DISTINCT_REWARDS = "rollstream.consumers.grouping.filters:distinct_rewards"
MAX_REWARDS_SHOWN = 16


class GroupTrajectory(Mapping[str, numpy.ndarray]):
    """One complete group as a filter sees it (see the module doc)."""

    def __init__(self, group: CompleteGroup, pad_value: float = 0.0) -> None:
        self._group = group
        self._pad_value = pad_value  # grouping.pad_value: what the emitted group is padded with
        self._rows = [episode_rows(scored) for scored in group.episodes]
        self._padded: dict[str, numpy.ndarray] | None = None
        self.task_id: str = group.task_id
        self.group_size: int = group.group_size
        self.rejected: int = group.rejected
        self.failed: int = group.failed

    @property
    def head_version(self) -> int:
        return self._group.head_version

    @property
    def rewards(self) -> numpy.ndarray:
        """float32 ``[rows]``: the reward of every row of the group's accepted episodes."""
        return numpy.concatenate([rows["rewards"] for rows in self._rows])

    def __getitem__(self, key: str) -> numpy.ndarray:
        if key == "rewards":
            return self.rewards
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def _all(self) -> dict[str, numpy.ndarray]:
        if self._padded is None:
            rows = align_keys([dict(rows) for rows in self._rows], self._pad_value)
            self._padded = concat_padded_arrays(rows, self._pad_value)
        return self._padded


def distinct_rewards(group: GroupTrajectory) -> bool:
    """The built-in filter (``grouping.drop_equal_rewards``): keeps a group whose rows' rewards
    are not all exactly equal. A group whose rewards are equal gives every row advantage 0 under
    group normalisation: it teaches nothing (DAPO's dynamic sampling)."""
    rewards = group.rewards
    return bool((rewards != rewards[0]).any())


def load_group_filters(config: GroupingConfig) -> tuple[GroupFilter, ...]:
    """The filters of ``config`` ready for :class:`~rollstream.consumers.grouping.groups.GroupBuffer`;
    :class:`ConfigError` naming the setting when one cannot be imported or is not callable."""
    named = [("grouping.drop_equal_rewards", DISTINCT_REWARDS)] if config.drop_equal_rewards else []
    named += [(f"grouping.group_filters[{i}]", path) for i, path in enumerate(config.group_filters)]
    return tuple(_judge(path, import_callable(path, key), config.pad_value) for key, path in named)


def _judge(path: str, fn: Callable[[GroupTrajectory], Any], pad_value: float) -> GroupFilter:
    """``fn`` as the buffer runs it: ``None`` keeps the group, a detail string drops it."""

    def judge(group: CompleteGroup) -> str | None:
        view = GroupTrajectory(group, pad_value)
        try:
            keep = bool(fn(view))
        except Exception as exc:  # noqa: BLE001 - the group ends, counted, with the error named
            log.error("group filter %s raised on task %s", path, group.task_id, exc_info=True,
                      extra={"task_id": group.task_id})
            return f"group filter {path} raised {type(exc).__name__}: {exc}"
        if keep:
            return None
        return f"group filter {path} refused it (rewards {_shown(view.rewards)})"

    judge.__qualname__ = f"judge[{path}]"
    return judge


def _shown(rewards: numpy.ndarray) -> str:
    values = [float(r) for r in rewards[:MAX_REWARDS_SHOWN]]
    more = f" and {len(rewards) - MAX_REWARDS_SHOWN} more" if len(rewards) > MAX_REWARDS_SHOWN else ""
    return f"{values}{more}"
