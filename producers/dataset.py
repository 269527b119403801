"""Read a dataset into rows and walk it in a deterministic, resumable order.

``load_rows`` reads JSONL, Parquet, or a Hugging Face dataset saved with ``save_to_disk``.
``iter_samples`` yields ``(epoch, index, row)``: the order of epoch ``e`` depends only on
``(seed, e)``, so a producer restarted at ``(epoch, index)`` continues the exact sequence an
uninterrupted producer would have followed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FORMATS = ("auto", "jsonl", "parquet", "hf")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


class DatasetError(ValueError):
    """A dataset that cannot be read: missing, malformed, or of an unknown format."""


def detect_format(path: Path) -> str:
    """``hf`` for a directory, else by suffix (``.jsonl``/``.json``/``.ndjson``, ``.parquet``/``.pq``)."""
    if path.is_dir():
        return "hf"
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise DatasetError(
            f"cannot tell the format of dataset {path} from its suffix {path.suffix!r}; "
            f"set producer.dataset_format to one of {', '.join(FORMATS[1:])}"
        )
    return fmt


def load_rows(path: str | Path, fmt: str = "auto", split: str = "train") -> list[dict[str, Any]]:
    """Every row of the dataset at ``path`` as a dict, in file order.

    ``fmt`` is ``auto`` (see :func:`detect_format`), ``jsonl``, ``parquet`` or ``hf``
    (``datasets.load_from_disk``; a ``DatasetDict`` is narrowed to ``split``).
    Raises ``DatasetError`` naming the path (and the line, for a bad JSONL line).
    """
    if not str(path).strip():
        raise DatasetError("no dataset given: set producer.dataset to a JSONL, Parquet or HF dataset path")
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset not found: {path}")
    if fmt not in FORMATS:
        raise DatasetError(f"unknown dataset format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(path)
    readers = {"jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf}
    rows = readers[fmt](path, split)
    log.info("loaded %d rows from %s (%s)", len(rows), path, fmt)
    return rows


def _read_jsonl(path: Path, split: str) -> list[dict[str, Any]]:
    if path.is_dir():
        raise DatasetError(f"dataset {path} is a directory, not a JSONL file")
    rows: list[dict[str, Any]] = []
    with path.open("r", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) carry no row
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: invalid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path, split: str) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{path}: not a readable Parquet dataset: {exc}") from None
    return table.to_pylist()


def _read_hf(path: Path, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:  # an optional dependency: only HF datasets need it
        raise DatasetError(
            f"dataset {path} is a Hugging Face dataset but the `datasets` package is not installed "
            "(pip install 'rollstream[datasets]')"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise DatasetError(f"{path}: not a dataset saved with save_to_disk: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(
                f"{path} has no split {split!r} (producer.split); available: {', '.join(loaded)}"
            )
        loaded = loaded[split]
    return loaded.to_list()


def epoch_order(n_rows: int, epoch: int, shuffle: bool, seed: int) -> np.ndarray:
    """Row indices in the order epoch ``epoch`` visits them; depends only on its arguments."""
    if not shuffle:
        return np.arange(n_rows)
    # A generator seeded by (seed, epoch) alone: resuming needs no state from earlier epochs.
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def iter_samples(
    n_rows: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    start_epoch: int = 0,
    start_index: int = 0,
) -> Iterator[tuple[int, int, int]]:
    """``(epoch, index_within_epoch, row_index)`` from ``(start_epoch, start_index)`` to the end.

    ``start_index == n_rows`` means "the start of the next epoch" (a cursor written after an
    epoch's last sample). A start position beyond the dataset raises ``ValueError`` (the
    dataset shrank since the cursor was written).
    """
    if n_rows < 0 or epochs < 0 or start_epoch < 0 or start_index < 0:
        raise ValueError("n_rows, epochs, start_epoch and start_index must be >= 0")
    if start_index > n_rows:
        raise ValueError(
            f"start index {start_index} is beyond the dataset's {n_rows} rows "
            "(did the dataset change since the cursor was written?)"
        )
    if n_rows == 0:
        return
    for epoch in range(start_epoch, epochs):
        order = epoch_order(n_rows, epoch, shuffle, seed)
        first = start_index if epoch == start_epoch else 0
        for index in range(first, n_rows):
            yield epoch, index, int(order[index])


def next_position(epoch: int, index: int, n_rows: int) -> tuple[int, int]:
    """The position after ``(epoch, index)``: ``(epoch, index + 1)`` or the next epoch's start."""
    if index + 1 >= n_rows:
        return epoch + 1, 0
    return epoch, index + 1


def task_id_for(producer_id: str, epoch: int, index: int) -> str:
    """The deterministic task id of a sample, so a retried sample is re-admitted idempotently."""
    return f"{producer_id}:{epoch}:{index}"
