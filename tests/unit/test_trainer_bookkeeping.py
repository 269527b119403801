"""The trainer's bookkeeping without a broker: rank shares, the ledger, checkpoints, the share wire format."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rollstream.trainer import Checkpoints, CheckpointError, LedgerEntry, LedgerMismatch, StepLedger, split_by_tokens
from rollstream.trainer.training_step import GroupRows
from rollstream.trainer.ledger import check_ledger_group, reconcile
from rollstream.trainer.ranks.share import StepShare, decode_share, encode_share, group_rows, share_group


# -- shares --

def test_every_rank_gets_whole_groups_balanced_by_tokens() -> None:
    tokens = [900, 100, 120, 880, 300, 310, 50, 60]
    shares = split_by_tokens(tokens, 3)
    assert sorted(i for s in shares for i in s) == list(range(len(tokens)))  # each group once
    assert all(s == sorted(s) for s in shares) and all(shares)
    loads = [sum(tokens[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(tokens)
    assert shares == split_by_tokens(list(tokens), 3)  # deterministic: same input, same shares


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_split_bounds_hold_for_random_steps(ranks: int) -> None:
    rng = random.Random(ranks)
    for _ in range(200):
        tokens = [rng.randint(1, 4000) for _ in range(rng.randint(ranks, 40))]
        shares = split_by_tokens(tokens, ranks)
        loads = [sum(tokens[i] for i in s) for s in shares]
        assert all(shares) and max(loads) - min(loads) <= max(tokens)
        assert sorted(i for s in shares for i in s) == list(range(len(tokens)))


def test_a_share_survives_the_wire_bit_for_bit() -> None:
    tensors = {"input_ids": torch.arange(12, dtype=torch.int32).reshape(2, 6),
               "logprobs": torch.randn(2, 6), "rewards": torch.tensor([1.0, 0.0])}
    group = GroupRows("task-1", 2, False, 7, tensors, [0, 1], partition=1, offset=42)
    share = decode_share(encode_share(StepShare(kind="step", step=3, rank=1, world_size=2, groups=[share_group(group)])))
    back = group_rows(share.groups[0])
    assert (back.task_id, back.group_size, back.trainer_version, back.partition, back.offset) == ("task-1", 2, 7, 1, 42)
    assert all(torch.equal(back.tensors[k], v) for k, v in tensors.items())


# -- the ledger --

def entry(step: int, offsets: dict[int, int], tasks: list[str]) -> LedgerEntry:
    return LedgerEntry(step, offsets, tasks, [[0, 0]] * len(tasks), [tasks], topic="t", group_id="g")


def test_reconcile_drops_only_the_steps_kafka_never_committed(tmp_path: Path) -> None:
    ledger = StepLedger(tmp_path / "ledger.jsonl")
    ledger.append([entry(1, {0: 3}, ["a"]), entry(2, {0: 5, 1: 2}, ["b"])])
    ledger.append([entry(3, {0: 7, 1: 2}, ["c"])])  # written, then the trainer died before the commit
    kept, dropped = reconcile(ledger, {0: 5, 1: 2})
    assert [e.step for e in kept] == [1, 2] and [e.step for e in dropped] == [3]
    assert [e.step for e in ledger.read()] == [1, 2]  # rewritten
    kept, dropped = reconcile(ledger, {0: 5, 1: 2})
    assert [e.step for e in kept] == [1, 2] and dropped == []


def test_a_torn_last_line_is_ignored_and_cut_before_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = StepLedger(path)
    ledger.append([entry(1, {0: 3}, ["a"])])
    with path.open("ab") as handle:
        handle.write(b'{"step": 2, "offsets": {"0"')  # the process died inside the write
    assert [e.step for e in ledger.read()] == [1]
    reconcile(ledger, {0: 3})
    ledger.append([entry(2, {0: 4}, ["b"])])
    assert [e.step for e in ledger.read()] == [1, 2]


def test_a_corrupt_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"nonsense": true}\n')
    StepLedger(path).append([entry(1, {0: 3}, ["a"])])
    with pytest.raises(ValueError, match="line 1"):
        StepLedger(path).read()


def test_a_ledger_of_another_group_is_refused(tmp_path: Path) -> None:
    ledger = StepLedger(tmp_path / "ledger.jsonl")
    ledger.append([entry(1, {0: 3}, ["a"])])
    with pytest.raises(LedgerMismatch, match="trainer.ledger_path"):
        check_ledger_group(ledger.read(), ledger.path, "t", "other-group")


# -- checkpoints --

def test_a_checkpoint_is_complete_or_absent(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    with checkpoints.write(1) as out:
        (out / "weights.bin").write_bytes(b"1" * 100)
    with pytest.raises(RuntimeError, match="boom"):
        with checkpoints.write(2) as out:
            (out / "weights.bin").write_bytes(b"2" * 10)
            raise RuntimeError("boom")
    assert [c.version for c in checkpoints.complete()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]  # the failed write left nothing
    with pytest.raises(CheckpointError, match="exists already"):
        with checkpoints.write(1):
            pass
    latest = checkpoints.latest()
    assert latest is not None and latest.version == 1 and (latest.path / "weights.bin").read_bytes() == b"1" * 100


def test_a_writer_killed_mid_write_leaves_no_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, signal
        from rollstream.trainer import Checkpoints
        with Checkpoints({str(tmp_path)!r}).write(3) as out:
            (out / "half.bin").write_bytes(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ}, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    checkpoints = Checkpoints(tmp_path)
    assert checkpoints.complete() == [] and checkpoints.get(3) is None
    assert any(p.name.startswith(".v3.partial-") for p in tmp_path.iterdir())
    checkpoints.remove_partials()  # what the writer does when it starts again
    assert list(tmp_path.iterdir()) == []


def test_resume_picks_the_checkpoint_of_the_last_committed_step(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path)
    for version in (1, 2, 3):
        with checkpoints.write(version):
            pass
    latest = checkpoints.latest(at_most_step=2)
    assert latest is not None and latest.version == 2
    assert checkpoints.discard_after(2) == [3]  # taken after a step that was never committed
    assert [c.version for c in checkpoints.complete()] == [1, 2]
