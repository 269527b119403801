"""Group filters as users write them (module-level: the grouping config names them by import string)."""

from __future__ import annotations

from typing import Any

SEEN: list[dict[str, Any]] = []  # what keep_all saw, for the tests


def varied_rewards(traj: Any) -> bool:
    """The reference system's DAPO filter as its users write it for ``should_accept_fn``."""
    return traj["rewards"].std() > 0


def keep_all(traj: Any) -> bool:
    SEEN.append({key: traj[key] for key in traj} | {"task_id": traj.task_id, "rejected": traj.rejected})
    return True


def broken(traj: Any) -> bool:
    raise RuntimeError("filter bug")


NOT_CALLABLE = 3
