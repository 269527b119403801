"""Each sample's copy of the dataset row is independent and equal to the row."""

from __future__ import annotations

from rollstream.rollout_workers.data_copies import copier
from rollstream.wire import PromptTask, decode_prompt, encode


def test_copies_from_the_wire_are_equal_and_independent() -> None:
    row = {"prompt": "2+2?", "answer": "4", "input_ids": list(range(512)), "meta": {"tags": ["a"], "w": 0.5},
           "flag": True, "none": None, "raw": b"\x00\x01"}
    data = decode_prompt(encode(PromptTask(task_id="t", group_size=2, data=row))).data
    fresh = copier(data)
    first, second = fresh(), fresh()
    assert first == second == data
    first["input_ids"].append(-1)
    first["meta"]["tags"].append("b")
    first["answer"] = "5"
    assert second == data == row
    assert fresh() == row  # later copies are unaffected too
    assert type(fresh()["flag"]) is bool and type(fresh()["meta"]["w"]) is float


def test_rows_with_non_messagepack_types_fall_back_to_deepcopy() -> None:
    row = {"pair": (1, 2), "bag": {3, 4}, "nested": [[1], [2]]}
    fresh = copier(row)
    first = fresh()
    assert first == row and isinstance(first["pair"], tuple) and isinstance(first["bag"], set)
    first["nested"][0].append(9)
    row["nested"][1].append(8)  # the copier took a snapshot: later changes to the row do not leak in
    assert fresh() == {"pair": (1, 2), "bag": {3, 4}, "nested": [[1], [2]]}
