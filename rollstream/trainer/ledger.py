"""The trainer's ledger: one JSON line per step it committed, with every rank's task ids.

A line is appended (and fsynced) BEFORE the step's offsets are committed to Kafka, so after a
crash the ledger holds every committed step and at most the steps whose commit was cut off:
:func:`reconcile` drops those trailing lines (their offsets are not covered by what Kafka
has committed), which makes the ledger exactly the steps the trainer's consumer group consumed. Those
steps are then read again from the committed offsets and trained again on a model that
never saw them, provided the trainer saved its state before it committed (see
docs/TRAINER.md, "Exactly once across a restart").

A torn last line (the process died inside the write) is ignored: it was never followed by
a commit. The file is rewritten only by :func:`reconcile`, atomically (temporary file, fsync,
rename).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)


class LedgerEntry(msgspec.Struct, forbid_unknown_fields=False):
    """One step: its number; the offsets committing it commits (partition -> next offset of
    ``topic`` for ``group_id``); its groups' task ids in step order with where each group's
    record is (``records[i] = [partition, offset]``, what a replay of the step reads); the task
    ids of each rank's share (``ranks[r]``); when it was written and by which ``torchrun``
    restart of the job; ``stale``: the groups read for it and dropped as stale (never trained)."""

    step: int
    offsets: dict[int, int]
    task_ids: list[str]
    records: list[list[int]]
    ranks: list[list[str]]
    topic: str = ""
    group_id: str = ""
    written_at: float = 0.0
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT of the job that trained the step
    stale: list[str] = msgspec.field(default_factory=list)


_decoder = msgspec.json.Decoder(LedgerEntry)


class StepLedger:
    """The ledger file at ``path`` (its directory is created on the first write)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> list[LedgerEntry]:
        """Every complete line, in order (a torn last line is left out, with a warning)."""
        return self.read_checked()[0]

    def read_checked(self) -> tuple[list[LedgerEntry], bool]:
        """:meth:`read`, and whether a torn last line was left out."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], False
        entries: list[LedgerEntry] = []
        torn = False
        lines = data.split(b"\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                entries.append(_decoder.decode(line))
            except msgspec.DecodeError as exc:
                if number == len(lines):  # the last line, without its newline: cut by a crash
                    log.warning("ledger %s: ignoring a torn last line (%s)", self.path, exc)
                    torn = True
                    continue
                raise ValueError(f"ledger {self.path} line {number} is not a ledger entry: {exc}") from None
        return entries, torn

    def append(self, entries: Iterable[LedgerEntry]) -> None:
        """Append ``entries`` durably (one write, then fsync) before anything is committed."""
        data = b"".join(msgspec.json.encode(e) + b"\n" for e in entries)
        if not data:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def rewrite(self, entries: list[LedgerEntry]) -> None:
        """Replace the file with ``entries`` atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(b"".join(msgspec.json.encode(e) + b"\n" for e in entries))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class LedgerMismatch(ValueError):
    """The ledger file was written for another topic or another consumer group."""


def check_ledger_group(entries: list[LedgerEntry], path: Path, topic: str, group_id: str) -> None:
    """Raise :class:`LedgerMismatch` when ``entries`` were written for another ``topic`` or
    consumer group (``group_id``: the ledger's consumer group)."""
    for entry in entries:
        if (entry.topic, entry.group_id) != (topic, group_id):
            raise LedgerMismatch(
                f"trainer ledger {path} holds steps of consumer group {entry.group_id!r} on {entry.topic!r}, not of "
                f"consumer group {group_id!r} on {topic!r}: give each experiment and trainer consumer group its own "
                "trainer.ledger_path (or trainer.checkpoint_dir)"
            )


def reconcile(ledger: StepLedger, committed: dict[int, int | None]) -> tuple[list[LedgerEntry], list[LedgerEntry]]:
    """Drop the trailing entries whose offsets Kafka has not committed (the crash came between
    the ledger write and the commit). Returns ``(kept, dropped)``; rewrites the file when it
    dropped any, or when its last line was torn."""
    entries, torn = ledger.read_checked()
    kept = list(entries)
    while kept and not all((c := committed.get(p)) is not None and c >= o for p, o in kept[-1].offsets.items()):
        kept.pop()
    dropped = entries[len(kept):]
    if dropped:
        log.warning(
            "ledger %s: steps %s were written but their commit did not happen (the trainer stopped "
            "in between); they are dropped and their groups will be read and trained again",
            ledger.path, [e.step for e in dropped],
        )
    if dropped or torn:  # torn: the next append must not continue the torn line
        ledger.rewrite(kept)
    return kept, dropped
