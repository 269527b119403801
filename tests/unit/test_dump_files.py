"""Dump files: named by the task id, one group in one directory, nothing written twice."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import unquote

import pytest

from harness.fakes import make_tokenizer
from harness.trajectories import scored, single_turn
from rollstream.dump.files import TaskFiles, dump_path, read_task, task_files
from rollstream.dump.lines import DumpWriter
from rollstream.file_names import MAX_NAME_BYTES, file_stem, is_plain_name


@pytest.mark.parametrize("task_id", ["demo-producer:0:17", "gsm8k-17", "a b", "数学-1", "x" * MAX_NAME_BYTES, "a\\b"])
def test_plain_task_ids_name_their_file_as_written(task_id: str) -> None:
    assert is_plain_name(task_id)
    assert dump_path("/r", "exp", "t0", False, 3, task_id) == Path(f"/r/exp/t0/rollout/3/{task_id}.jsonl")


@pytest.mark.parametrize("task_id", ["a/b", "/etc/passwd", "../x", "..", ".", ".hidden", "50%", "a\x00b", "a\nb"])
def test_other_task_ids_are_percent_encoded_and_stay_in_their_directory(task_id: str) -> None:
    stem = file_stem(task_id)
    assert unquote(stem) == task_id  # reversible
    assert "/" not in stem and "\x00" not in stem and not stem.startswith(".")
    path = dump_path("/r", "exp", "t0", True, 3, task_id)
    assert path.parent == Path("/r/exp/t0/eval-rollout/3") and path.name == f"{stem}.jsonl"
    assert os.path.normpath(path) == str(path)  # no ".." component anywhere


def test_names_never_collide_and_always_fit() -> None:
    ids = ["a/b", "a%2Fb", "a_b", "", "%", "%25", "x" * 500, "x" * 499 + "y", "é" * 300]
    stems = [file_stem(task_id) for task_id in ids]
    assert len(set(stems)) == len(ids)
    assert all(0 < len(stem.encode()) <= MAX_NAME_BYTES for stem in stems)


def record(sample_idx: int, tail: int, row: int | None = None, text: str = "") -> dict[str, object]:
    out: dict[str, object] = {"task_id": "t", "sample_idx": sample_idx, "tail_version": tail, "completion": text}
    if row is not None:
        out["row"] = row
    return out


def merge(files: TaskFiles, records: list[dict[str, object]], task_id: str = "t") -> Path:
    return files.merge(False, task_id, records, [json.dumps(r) + "\n" for r in records]).path


def test_a_group_moves_to_its_newest_version_and_keeps_every_line(tmp_path: Path) -> None:
    files = TaskFiles(tmp_path)
    assert merge(files, [record(1, 12), record(0, 12)]) == tmp_path / "rollout/12/t.jsonl"
    assert merge(files, [record(2, 13)]) == tmp_path / "rollout/13/t.jsonl"
    assert not (tmp_path / "rollout/12/t.jsonl").exists()  # one group, one directory
    lines = (tmp_path / "rollout/13/t.jsonl").read_text().splitlines()
    assert [json.loads(line)["sample_idx"] for line in lines] == [0, 1, 2]  # sorted by key
    # an older sample arriving late does not move the group back
    assert merge(files, [record(3, 11)]) == tmp_path / "rollout/13/t.jsonl"


def test_a_line_already_there_is_never_written_twice(tmp_path: Path) -> None:
    files = TaskFiles(tmp_path)
    merge(files, [record(0, 2, text="first")])
    again = [record(0, 2, text="again"), record(0, 2, row=1)]
    result = files.merge(False, "t", again, [json.dumps(r) + "\n" for r in again])
    assert (result.added, result.skipped) == (1, 1)
    lines = [json.loads(line) for line in result.path.read_text().splitlines()]
    assert [(line["sample_idx"], line.get("row", 0), line["completion"]) for line in lines] == [
        (0, 0, "first"), (0, 1, "")]


def test_a_new_writer_finds_the_group_where_an_earlier_one_left_it(tmp_path: Path) -> None:
    merge(TaskFiles(tmp_path), [record(0, 4)])
    # a crash between writing the moved file and removing the old one leaves two files
    (tmp_path / "rollout/5").mkdir(parents=True)
    (tmp_path / "rollout/5/t.jsonl").write_text(json.dumps(record(1, 5)) + "\nnot json\n")
    path = merge(TaskFiles(tmp_path), [record(0, 4), record(2, 3)])
    assert path == tmp_path / "rollout/5/t.jsonl"
    assert not (tmp_path / "rollout/4/t.jsonl").exists()
    text = path.read_text().splitlines()
    assert [json.loads(line)["sample_idx"] for line in text[:3]] == [0, 1, 2]
    assert text[3] == "not json"  # a line that is not a record is kept, last
    assert not list(tmp_path.rglob(".*.tmp"))  # no temporary file left behind


async def test_writer_puts_a_group_spanning_a_weight_update_in_one_file(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, "exp", "t0", make_tokenizer(), flush_every=1)
    await writer.write(scored(single_turn("hello", "world", [2]), 1.0, task_id="q/1", sample_idx=0))
    assert task_files(tmp_path, "exp", "t0", "q/1") == [tmp_path / "exp/t0/rollout/2/q%2F1.jsonl"]
    await writer.write(scored(single_turn("hello", "four five", [2, 3]), 0.0, task_id="q/1", sample_idx=1))
    await writer.write(scored(single_turn("hello", "five", [5]), 0.0, task_id="q/1", is_eval=True))
    await writer.write(scored(single_turn("hello", "world", [2]), 1.0, task_id="q/1", sample_idx=0))  # again
    await writer.close()
    assert task_files(tmp_path, "exp", "t0", "q/1") == [tmp_path / "exp/t0/rollout/3/q%2F1.jsonl"]
    assert writer.path_of("q/1") == tmp_path / "exp/t0/rollout/3/q%2F1.jsonl"
    lines = read_task(tmp_path, "exp", "t0", "q/1")
    assert [(r["sample_idx"], r["tail_version"], r["completion"]) for r in lines] == [(0, 2, "world"), (1, 3, "four five")]
    assert [r["tail_version"] for r in read_task(tmp_path, "exp", "t0", "q/1", is_eval=True)] == [5]
    assert (writer.lines_written, writer.lines_skipped) == (3, 1)


def test_a_reader_during_a_move_sees_each_line_once_from_the_newest_file(tmp_path: Path) -> None:
    # the moment between writing the moved file and removing the old one: two files
    for version, samples in ((9, [0]), (10, [0, 1])):
        path = tmp_path / f"exp/t0/rollout/{version}/t.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(record(i, version, text=f"v{version}")) + "\n" for i in samples))
    assert [p.parent.name for p in task_files(tmp_path, "exp", "t0", "t")] == ["9", "10"]  # numeric order
    lines = read_task(tmp_path, "exp", "t0", "t")
    assert [(r["sample_idx"], r["completion"]) for r in lines] == [(0, "v10"), (1, "v10")]


def test_a_reader_beside_a_writer_that_moves_the_group_never_loses_or_repeats_a_line(tmp_path: Path) -> None:
    import threading

    files, done, seen, wrong = TaskFiles(tmp_path / "exp/t0"), threading.Event(), [0], []

    def reader() -> None:
        while not done.is_set():
            keys = [(r["sample_idx"], r.get("row", 0)) for r in read_task(tmp_path, "exp", "t0", "t")]
            if len(set(keys)) != len(keys) or len(keys) < seen[0]:
                wrong.append(keys)
            seen[0] = max(seen[0], len(keys))

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(1000):  # each sample of a newer version: every merge moves the group
        merge(files, [record(i, i)])
    done.set()
    thread.join()
    assert not wrong, wrong[:3]
    assert len(read_task(tmp_path, "exp", "t0", "t")) == 1000
