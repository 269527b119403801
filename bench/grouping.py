"""Grouping benchmark: gather + pad + emit of groups in the grouping logic alone (no broker).

Groups of 8 samples with mixed lengths (prompt 128-512, completion 256-1,536 tokens) go through
``GroupBuffer.add`` -> ``build_emitted_group`` -> ``encode`` (what the grouping tier does per group,
minus Kafka), from decoded ``ScoredEpisode`` messages whose tensors view their record buffers.
The floor pads the same row tensors with ``torch.nn.utils.rnn.pad_sequence`` (one call per key,
plus the rewards), which is the least any grouping must do. ``build_emitted_group`` pads numpy arrays
(the grouping tier never imports torch) with ``concat_padded_arrays`` straight into the batch's
one packed buffer (so ``encode`` copies the bytes once); the padding rows time it alone (on the
rows decoded as arrays, as the tier has them), and ``concat_padded_tensors`` (the trainer's and
the workflows' torch padding). Episodes/s; no target (the issue asks for the ratio).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from bench.common import Report, base_parser
from bench.data import mixed_lengths, scored_episode, trajectory
from rollstream.consumers.grouping.records import build_emitted_group
from rollstream.consumers.grouping.groups import CompleteGroup, GroupBuffer
from rollstream.trajectory.padding import concat_padded_arrays
from rollstream.trajectory.padding import concat_padded_tensors
from rollstream.wire import ScoredEpisode, decode_arrays, decode_scored, encode
from rollstream.wire.torch_tensors import decode_tensor_dict

GROUP_SIZE = 8
SEQUENCE_PAD = {"input_ids": 0, "attention_mask": 0, "loss_mask": 0, "logprobs": 0.0, "versions": -1}


def make_records(groups: int, seed: int = 0) -> list[list[bytes]]:
    """Encoded ``scored`` records, ``GROUP_SIZE`` per group, mixed lengths."""
    lengths = mixed_lengths(groups * GROUP_SIZE, seed)
    records = []
    for g in range(groups):
        group = []
        for i in range(GROUP_SIZE):
            prompt, completion = lengths[g * GROUP_SIZE + i]
            tensors = trajectory(prompt, completion, seed=g * GROUP_SIZE + i, reward=float(i % 2))
            group.append(encode(scored_episode(f"bench:0:{g}", i, GROUP_SIZE, tensors, reward=float(i % 2))))
        records.append(group)
    return records


def run_grouping(messages: list[list[ScoredEpisode]]) -> int:
    """GroupBuffer + build_emitted_group + encode for every group; returns the bytes emitted."""
    buffer = GroupBuffer(group_timeout_seconds=600.0, dedupe_window_seconds=3600.0)
    emitted = 0
    offset = 0
    now = time.monotonic()
    for group in messages:
        for message in group:
            for result in buffer.add(message, 0, offset, now, trainer_version=0):
                assert isinstance(result, CompleteGroup)
                emitted += len(encode(build_emitted_group(result, trainer_version=0)))
            offset += 1
    return emitted


def run_decode_and_grouping(records: list[list[bytes]]) -> int:
    return run_grouping([[decode_scored(r) for r in group] for group in records])


def rows_of(messages: list[list[ScoredEpisode]]) -> list[list[dict[str, Tensor]]]:
    return [[decode_tensor_dict(m.episode.trajectory) for m in group] for group in messages]


def run_pad_sequence(rows: list[list[dict[str, Tensor]]]) -> int:
    """The floor: pad each key of each group with pad_sequence (1-D rows), cat the rewards."""
    padded = 0
    for group in rows:
        out = {k: pad_sequence([r[k][0] for r in group], batch_first=True, padding_value=v) for k, v in SEQUENCE_PAD.items()}
        out["rewards"] = torch.cat([r["rewards"] for r in group])
        padded += out["input_ids"].numel()
    return padded


def run_concat_padded(rows: list[list[dict[str, Tensor]]]) -> int:
    """rollstream's concat_padded_tensors alone (the padding trainers and workflows use)."""
    padded = 0
    for group in rows:
        padded += concat_padded_tensors(group)["input_ids"].numel()
    return padded


def array_rows_of(messages: list[list[ScoredEpisode]]) -> list[list[dict[str, numpy.ndarray]]]:
    return [[decode_arrays(m.episode.trajectory) for m in group] for group in messages]


def run_concat_padded_arrays(rows: list[list[dict[str, numpy.ndarray]]]) -> int:
    """concat_padded_arrays alone: the padding inside build_emitted_group, into one packed buffer."""
    padded = 0
    for group in rows:
        padded += concat_padded_arrays(group)["input_ids"].size
    return padded


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("grouping", __doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=None, help="groups per pass (default 200; --quick 5)")
    args = parser.parse_args(argv)
    groups = args.groups or (5 if args.quick else 200)
    repeats = 1 if args.quick else 5
    report = Report("grouping", args.quick)
    records = make_records(groups)
    messages = [[decode_scored(r) for r in group] for group in records]
    rows = rows_of(messages)
    array_rows = array_rows_of(messages)
    episodes = groups * GROUP_SIZE
    tokens = sum(r["input_ids"].shape[1] for group in rows for r in group)
    cases = {
        "floor: pad_sequence": lambda: run_pad_sequence(rows),
        "concat_padded_tensors only": lambda: run_concat_padded(rows),
        "concat_padded_arrays only (build_emitted_group's padding)": lambda: run_concat_padded_arrays(array_rows),
        "GroupBuffer+build_emitted_group+encode": lambda: run_grouping(messages),
        "decode_scored+above (tier's per-record work)": lambda: run_decode_and_grouping(records),
    }
    results = {name: best_seconds(fn, repeats) for name, fn in cases.items()}
    floor = results["floor: pad_sequence"]
    table = [{
        "path": name, "episodes/s": episodes / s, "groups/s": groups / s, "tokens/s": tokens / s,
        "us/episode": s / episodes * 1e6, "x floor time": s / floor,
    } for name, s in results.items()]
    report.table(f"Gather + pad + emit, group size {GROUP_SIZE}, {groups} groups, mixed lengths (best of {repeats})", table)
    report.extra["episodes"] = episodes
    report.extra["mean_tokens_per_episode"] = tokens / episodes
    ours = results["GroupBuffer+build_emitted_group+encode"]
    report.note(f"grouping logic costs {ours / floor:.2f}x the pad_sequence floor; at "
                f"{episodes / ours:,.0f} episodes/s it takes {1e6 * ours / episodes:.0f} us of one core per episode")
    return report.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())
