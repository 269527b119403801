"""Dump files on disk: one file per task (its whole group), in the directory of the group's version.

Layout (AReaL's)::

    {fileroot}/{experiment}/{trial}/{rollout|eval-rollout}/{version}/{task_id}.jsonl

What callers may rely on (at length: docs/DEBUGGING.md, "Trajectory dumps"): the file is named
by the task id as written when the id is a plain file name, else escaped
(:mod:`rollstream.file_names`); a group lies in one file, in its version's directory (the newest
``tail_version`` of its lines), its lines sorted by ``(sample_idx, row)``, rewritten whole
(temporary file + rename) by :meth:`TaskFiles.merge`; a line whose ``(sample_idx, row)`` the
file already holds is skipped, and a line on disk is never removed. One process writes a
task's file at a time; :func:`read_task` reads a task back.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.file_names import file_stem
from rollstream.trajectory.staleness import PROMPT_VERSION, Versions, head_and_tail

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"
_NO_KEY = (1 << 62, 0)  # sorts unreadable lines last (kept, never dropped)


def scope_dir(is_eval: bool) -> str:
    """``eval-rollout`` for eval groups, ``rollout`` for training groups."""
    return "eval-rollout" if is_eval else "rollout"


def dump_path(
    fileroot: str | Path, experiment: str, trial: str, is_eval: bool, version: int, task_id: str
) -> Path:
    """Where the group of ``task_id`` lies when its version is ``version``."""
    return Path(fileroot) / experiment / trial / scope_dir(is_eval) / str(version) / f"{file_stem(task_id)}{SUFFIX}"


def line_key(record: dict[str, Any]) -> tuple[int, int]:
    """A line's key inside its task's file: ``(sample_idx, row)``; ``row`` is 0 when absent."""
    return int(record["sample_idx"]), int(record.get("row", 0))


def task_files(fileroot: str | Path, experiment: str, trial: str, task_id: str, is_eval: bool = False) -> list[Path]:
    """The file(s) of ``task_id``, oldest version first: one, or two for a moment while a group
    moves to a newer version's directory (or after a crash in that moment, until the task is
    written again)."""
    return _find(Path(fileroot) / experiment / trial / scope_dir(is_eval), file_stem(task_id) + SUFFIX)


def read_task(
    fileroot: str | Path, experiment: str, trial: str, task_id: str, is_eval: bool = False
) -> list[dict[str, Any]]:
    """Every dump line of ``task_id``, each ``(sample_idx, row)`` once, sorted by it; [] when
    none. While a group moves (two files for a moment) the newer version's file wins: it holds
    every line of the older one. A move during the read (a version directory made meanwhile,
    or a file gone under it) makes the read start again."""
    scope = Path(fileroot) / experiment / trial / scope_dir(is_eval)
    name = file_stem(task_id) + SUFFIX
    while True:
        directories = _version_dirs(scope)
        records: dict[tuple[int, int], dict[str, Any]] = {}
        try:
            for path in reversed(_files_in(directories, name)):
                for line in path.read_text(encoding="utf-8").splitlines():
                    if line:
                        record = json.loads(line)
                        records.setdefault(line_key(record), record)
        except FileNotFoundError:
            continue
        if _version_dirs(scope) == directories:
            return [records[key] for key in sorted(records)]


def _find(scope: Path, name: str) -> list[Path]:
    return _files_in(_version_dirs(scope), name)


def _version_dirs(scope: Path) -> list[Path]:
    """The directories under ``scope``, versions in numeric order (9 before 10), others after."""
    try:
        entries = list(os.scandir(scope))
    except FileNotFoundError:
        return []
    return sorted((Path(e.path) for e in entries if e.is_dir()), key=lambda p: _version_order(p.name))


def _files_in(directories: list[Path], name: str) -> list[Path]:
    """``name`` in each of ``directories`` that holds it, looked for oldest version first: a
    move writes the new file before it removes the old one, so a file gone from an older
    directory is found in a newer one looked at after it."""
    return [d / name for d in directories if (d / name).is_file()]


def _version_order(directory: str) -> tuple[int, str]:
    """Version directories in numeric order (9 before 10); any other name after them."""
    return (int(directory), "") if directory.isdigit() else (1 << 62, directory)


@dataclass(frozen=True)
class MergeResult:
    """What :meth:`TaskFiles.merge` did: lines added, lines skipped (key already there), the file."""

    added: int
    skipped: int
    path: Path


class TaskFiles:
    """Merges lines into their task's file under ``base`` (``{fileroot}/{experiment}/{trial}``).

    Remembers where it last put each task (up to ``cache_size`` tasks), so only a task's first
    write looks through the version directories. Not thread-safe: one caller at a time.
    """

    def __init__(self, base: Path, cache_size: int = 65_536) -> None:
        self.base = base
        self._where: OrderedDict[tuple[bool, str], Path] = OrderedDict()
        self._cache_size = cache_size

    def merge(self, is_eval: bool, task_id: str, records: list[dict[str, Any]], texts: list[str]) -> MergeResult:
        """Add ``records`` (with their JSON ``texts``, one line each) to the file of ``task_id``."""
        scope = self.base / scope_dir(is_eval)
        name = file_stem(task_id) + SUFFIX
        paths = self._paths(scope, name, (is_eval, task_id))
        lines = _read_lines(paths)
        keys = {key for key, _, _ in lines}
        added = 0
        for record, text in zip(records, texts):
            key = line_key(record)
            if key in keys:
                continue
            keys.add(key)
            lines.append((key, int(record["tail_version"]), text))
            added += 1
        if added == 0 and len(paths) == 1:
            return self._remember((is_eval, task_id), MergeResult(0, len(records), paths[0]))
        # the directory is named by the group's tail version (AReaL's choice)
        version = head_and_tail(Versions(PROMPT_VERSION, tail) for key, tail, _ in lines if key != _NO_KEY).tail_version
        target = scope / str(version) / name
        _replace(target, "".join(text for _, _, text in sorted(lines, key=lambda line: line[0])))
        for old in paths:
            if old != target:
                old.unlink(missing_ok=True)
        return self._remember((is_eval, task_id), MergeResult(added, len(records) - added, target))

    def known_path(self, is_eval: bool, task_id: str) -> Path | None:
        """Where this object last put ``task_id``'s file (None when it does not remember)."""
        return self._where.get((is_eval, task_id))

    def _paths(self, scope: Path, name: str, key: tuple[bool, str]) -> list[Path]:
        known = self._where.get(key)
        if known is not None:
            self._where.move_to_end(key)
            return [known] if known.is_file() else []
        return _find(scope, name)

    def _remember(self, key: tuple[bool, str], result: MergeResult) -> MergeResult:
        self._where[key] = result.path
        self._where.move_to_end(key)
        if len(self._where) > self._cache_size:
            self._where.popitem(last=False)
        return result


def _read_lines(paths: list[Path]) -> list[tuple[tuple[int, int], int, str]]:
    """``(key, tail_version, text)`` of every line in ``paths``; an unreadable line is kept
    as it is (sorted last) and logged."""
    lines = []
    for path in paths:
        try:
            content = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        for text in content.splitlines(keepends=True):
            if not text.strip():
                continue
            if not text.endswith("\n"):
                text += "\n"
            try:
                record = json.loads(text)
                lines.append((line_key(record), int(record["tail_version"]), text))
            except (ValueError, KeyError, TypeError):
                log.warning("dump file %s holds a line that is not a dump record; kept as it is", path)
                lines.append((_NO_KEY, PROMPT_VERSION, text))
    return lines


def _replace(target: Path, content: str) -> None:
    """Write ``content`` to ``target`` atomically: readers see the old file or the new one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temporary.write_text(content, encoding="utf-8")
    os.replace(temporary, target)
