"""The replay progress bar: offsets covered of the planned total, with rate and ETA (rich)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class RateColumn(ProgressColumn):
    """Offsets per second (rich's running estimate)."""

    def render(self, task: Any) -> Text:
        speed = task.speed
        return Text("     - rec/s" if speed is None else f"{speed:>7.1f} rec/s", style="cyan")


class ReplayBar:
    """``start(stats)`` sets the total (end - start offsets); ``advance(n)`` moves it on."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._task: TaskID | None = None

    def start(self, stats: Any) -> None:
        self._task = self._progress.add_task(stats.topic, total=max(stats.total, 0))

    def advance(self, covered: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, covered)


@contextmanager
def replay_progress(enabled: bool = True) -> Iterator[ReplayBar]:
    """A progress bar on stderr (nothing shown when disabled)."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        transient=False,
        disable=not enabled,
    )
    with progress:
        yield ReplayBar(progress)
