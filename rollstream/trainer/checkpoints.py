"""Checkpoint directories that are either complete or invisible.

``v<version>`` under ``trainer.checkpoint_dir`` is a complete checkpoint: :meth:`Checkpoints.write`
fills a hidden temporary directory, writes the marker file ``rollstream-checkpoint.json``
last, fsyncs, and renames the directory into place (one atomic ``rename``). A crash at any
point leaves either no ``v<version>`` or a complete one; temporary leftovers never had
readers and are removed by :meth:`Checkpoints.remove_partials` (the writer calls it when it
starts, before it writes anything). Only complete checkpoints are listed,
resumed from or published (:class:`~rollstream.trainer.version_publisher.VersionPublisher`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = "rollstream-checkpoint.json"
_NAME = re.compile(r"^v(\d+)$")
_PARTIAL = re.compile(r"^\.v(\d+)\.partial-")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used as asked."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: ``version``, its directory, the trainer step it was taken after,
    and what the trainer stored with it (``meta``, JSON; e.g. the step's figures)."""

    version: int
    path: Path
    step: int
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def read(cls, path: Path) -> Checkpoint | None:
        """The checkpoint at ``path``, or None when it is not a complete one."""
        try:
            marker = json.loads((path / MARKER).read_text())
            meta = marker.get("meta") or {}
            return cls(int(marker["version"]), path, int(marker.get("step", marker["version"])), dict(meta))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync(Path(directory) / name)
        _fsync(Path(directory))


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: its renames and new files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpoints:
    """The checkpoints in ``directory``; see the module docstring."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, version: int) -> Path:
        return self.directory / f"v{version}"

    @contextlib.contextmanager
    def write(self, version: int, step: int | None = None, meta: dict[str, Any] | None = None) -> Iterator[Path]:
        """Yield an empty directory to write version ``version`` into; on a clean exit it
        becomes ``v<version>``, complete. On an exception it is removed and nothing appears.

        ``step`` is the trainer step the checkpoint was taken after (default: ``version``);
        ``meta`` (JSON) is kept in the marker file, as durable as the checkpoint
        (:attr:`Checkpoint.meta`)."""
        if version < 0:
            raise CheckpointError(f"checkpoint version must be >= 0, got {version}")
        final = self.path_for(version)
        if final.exists():
            raise CheckpointError(
                f"checkpoint {final} exists already; versions are written once (discard_after() "
                "removes checkpoints that were never committed)"
            )
        tmp = self.directory / f".v{version}.partial-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()
        try:
            yield tmp
            marker = {"version": version, "step": version if step is None else step, "written_at": time.time(),
                      **({"meta": meta} if meta else {})}
            (tmp / MARKER).write_text(json.dumps(marker))
            _fsync_tree(tmp)
            os.rename(tmp, final)  # the one atomic step: readers see all of it or nothing
            _fsync(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("checkpoint v%d complete at %s", version, final)

    def complete(self) -> list[Checkpoint]:
        """Every complete checkpoint, oldest version first."""
        found = []
        for child in self.directory.iterdir():
            match = _NAME.match(child.name)
            if match and child.is_dir():
                checkpoint = Checkpoint.read(child)
                if checkpoint is not None and checkpoint.version == int(match.group(1)):
                    found.append(checkpoint)
        return sorted(found, key=lambda c: c.version)

    def latest(self, at_most_step: int | None = None) -> Checkpoint | None:
        """The newest complete checkpoint (taken after a step <= ``at_most_step`` when given)."""
        candidates = [c for c in self.complete() if at_most_step is None or c.step <= at_most_step]
        return candidates[-1] if candidates else None

    def get(self, version: int) -> Checkpoint | None:
        return Checkpoint.read(self.path_for(version))

    def discard_after(self, step: int) -> list[int]:
        """Delete the checkpoints taken after a step later than ``step`` (the trainer stopped
        before it committed that step, so it trains it again); returns their versions."""
        gone = [c for c in self.complete() if c.step > step]
        for checkpoint in gone:
            log.warning("discarding checkpoint v%d (step %d was never committed)", checkpoint.version, checkpoint.step)
            self.delete(checkpoint.version)
        return [c.version for c in gone]

    def delete(self, version: int) -> None:
        """Remove ``v<version>``: first out of sight (renamed), then its files."""
        path = self.path_for(version)
        if not path.exists():
            return
        hidden = self.directory / f".v{version}.partial-deleting-{time.monotonic_ns()}"
        os.rename(path, hidden)
        shutil.rmtree(hidden, ignore_errors=True)

    def remove_partials(self) -> None:
        """Delete what writers that died left behind. Only the one writer calls this, when it
        starts: a partial directory of a writer still running would go too."""
        for child in self.directory.iterdir():
            if _PARTIAL.match(child.name):
                log.info("removing %s, a checkpoint that was never completed", child)
                shutil.rmtree(child, ignore_errors=True)
