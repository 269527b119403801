"""Dataset reading and the deterministic, resumable sample order (no broker)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.producers.dataset import (
    DatasetError,
    detect_format,
    epoch_order,
    iter_samples,
    load_rows,
    next_position,
    task_id_for,
)

ROWS = [{"question": f"what is {i}", "answer": str(i), "tags": [i, i + 1]} for i in range(5)]


def write_jsonl(path: Path, rows: list[dict], extra: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return path


def test_jsonl_rows_in_file_order(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS, extra="\n   \n")  # blank lines are skipped
    assert load_rows(path) == ROWS


def test_parquet_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows(path) == ROWS
    assert load_rows(path, fmt="parquet") == ROWS


def test_hf_dataset_and_dataset_dict(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    assert load_rows(tmp_path / "single") == ROWS
    dd = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(ROWS[:2])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert load_rows(tmp_path / "dict", fmt="hf") == ROWS
    assert load_rows(tmp_path / "dict", split="test") == ROWS[:2]
    with pytest.raises(DatasetError, match="no split 'valid'.*train"):
        load_rows(tmp_path / "dict", split="valid")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        load_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="producer.dataset"):
        load_rows("")


def test_bad_json_line_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n')
    with pytest.raises(DatasetError, match=r"d.jsonl:3: invalid JSON"):
        load_rows(path)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"d.jsonl:2: expected a JSON object, got list"):
        load_rows(path)


def test_unknown_format(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.csv", ROWS)
    with pytest.raises(DatasetError, match="producer.dataset_format"):
        load_rows(path)
    with pytest.raises(DatasetError, match="unknown dataset format 'xml'"):
        load_rows(path, fmt="xml")
    assert load_rows(path, fmt="jsonl") == ROWS  # an explicit format overrides the suffix


def test_not_parquet_and_not_hf(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    path.write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet"):
        load_rows(path)
    (tmp_path / "empty_dir").mkdir()
    assert detect_format(tmp_path / "empty_dir") == "hf"
    with pytest.raises(DatasetError, match="save_to_disk"):
        load_rows(tmp_path / "empty_dir")


def test_unshuffled_order_is_file_order() -> None:
    assert list(iter_samples(3, 2, False, 0)) == [
        (0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 0), (1, 1, 1), (1, 2, 2),
    ]


def test_shuffled_epochs_are_permutations_that_depend_on_seed_and_epoch() -> None:
    n = 50
    e0, e1 = epoch_order(n, 0, True, 7), epoch_order(n, 1, True, 7)
    assert sorted(e0.tolist()) == list(range(n)) == sorted(e1.tolist())
    assert e0.tolist() != e1.tolist()
    assert epoch_order(n, 0, True, 7).tolist() == e0.tolist()  # same (seed, epoch), same order
    assert epoch_order(n, 0, True, 8).tolist() != e0.tolist()


@settings(max_examples=60, deadline=None)
@given(
    n_rows=st.integers(0, 12),
    epochs=st.integers(1, 3),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    split=st.integers(0, 40),
)
def test_resume_at_any_point_equals_the_unsplit_run(
    n_rows: int, epochs: int, shuffle: bool, seed: int, split: int
) -> None:
    full = list(iter_samples(n_rows, epochs, shuffle, seed))
    split = min(split, len(full))
    head = full[:split]
    # The cursor a producer would have committed after `head`: the position after its last sample.
    epoch, index = next_position(*head[-1][:2], n_rows) if head else (0, 0)
    tail = list(iter_samples(n_rows, epochs, shuffle, seed, start_epoch=epoch, start_index=index))
    assert head + tail == full


def test_cursor_at_epoch_end_means_next_epoch() -> None:
    assert list(iter_samples(2, 2, False, 0, start_epoch=0, start_index=2)) == [(1, 0, 0), (1, 1, 1)]
    assert list(iter_samples(2, 2, False, 0, start_epoch=2, start_index=0)) == []


def test_cursor_beyond_dataset_is_an_error() -> None:
    with pytest.raises(ValueError, match="dataset change"):
        list(iter_samples(2, 1, False, 0, start_index=3))


def test_task_id_scheme() -> None:
    assert task_id_for("producer-0", 2, 17) == "producer-0:2:17"
    # Distinct samples get distinct ids; the same sample always the same id.
    ids = {task_id_for("p", e, i) for e in range(3) for i in range(4)}
    assert len(ids) == 12
    assert next_position(0, 3, 4) == (1, 0)
    assert next_position(0, 2, 4) == (0, 3)
