"""Where a replay starts in each partition: ``--offset``, ``--since``, a resume file.

The resume file is JSON ``{"topic": T, "next": {"0": 17, "1": 4}}``: the next offset to read
per partition. It is replaced atomically (write a temporary file, fsync, rename), so a crash
leaves either the old or the new file, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ALL_PARTITIONS = -1  # key of an --offset given without a partition


def parse_offset_specs(specs: list[str]) -> dict[int, int]:
    """``["0:15", "1:7"]`` -> ``{0: 15, 1: 7}``; a bare ``"15"`` applies to every partition
    (key ``ALL_PARTITIONS``). Raises ``ValueError`` naming the bad spec."""
    parsed: dict[int, int] = {}
    for spec in specs:
        partition, sep, offset = spec.partition(":")
        try:
            if sep:
                key, value = int(partition), int(offset)
                if key < 0:
                    raise ValueError
            else:
                key, value = ALL_PARTITIONS, int(partition)
        except ValueError:
            raise ValueError(f"--offset {spec!r} must look like PARTITION:OFFSET or OFFSET") from None
        if value < 0:
            raise ValueError(f"--offset {spec!r}: offsets are >= 0")
        parsed[key] = value
    return parsed


def parse_since(text: str) -> int:
    """Epoch milliseconds from digits (already ms) or ISO 8601 (a naive time is UTC)."""
    stripped = text.strip()
    if stripped.isdigit():
        return int(stripped)
    try:
        moment = datetime.fromisoformat(stripped.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {text!r} is neither epoch milliseconds nor ISO 8601") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def start_offsets(
    partitions: list[int],
    begin: dict[int, int],
    end: dict[int, int],
    *,
    offsets: dict[int, int] | None = None,
    since: dict[int, int | None] | None = None,
    resume: dict[int, int] | None = None,
) -> dict[int, int]:
    """The start offset of each partition, clamped into ``[begin, end]``.

    Precedence per partition: the resume file, then ``offsets`` (its own partition, then
    ``ALL_PARTITIONS``), then ``since`` (a partition with no record at or after the time starts
    at its end), then the beginning.
    """
    starts: dict[int, int] = {}
    for p in partitions:
        if resume is not None and p in resume:
            wanted = resume[p]
        elif offsets and (p in offsets or ALL_PARTITIONS in offsets):
            wanted = offsets.get(p, offsets.get(ALL_PARTITIONS, begin[p]))
        elif since is not None:
            found = since.get(p)
            wanted = end[p] if found is None else found
        else:
            wanted = begin[p]
        starts[p] = min(max(wanted, begin[p]), end[p])
    return starts


def load_resume(path: Path, topic: str) -> dict[int, int] | None:
    """The saved next offsets, or None when ``path`` does not exist. ``ValueError`` when it
    belongs to another topic or cannot be read."""
    try:
        raw = json.loads(path.read_text())
        saved_topic, nxt = raw["topic"], raw["next"]
        result = {int(p): int(o) for p, o in nxt.items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"resume file {path} is not usable: {exc}") from None
    if saved_topic != topic:
        raise ValueError(f"resume file {path} belongs to topic {saved_topic!r}, not {topic!r}")
    return result


def save_resume(path: Path, topic: str, next_offsets: dict[int, int]) -> None:
    """Atomically replace ``path`` with the next offsets of ``topic``."""
    payload = json.dumps({"topic": topic, "next": {str(p): o for p, o in sorted(next_offsets.items())}})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
