"""The ranks' heartbeats (rollstream.trainer.ranks.heartbeats) over real sockets, in one process: a silent
rank is stalled after the timeout, a closed connection is a rank gone at once, a goodbye ends
the watching, a failure is passed on with its error, and rank 0 tells the other ranks which
rank ended the job. (Across real processes under torchrun: tests/integration/test_trainer_ranks.py.)"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from rollstream.trainer.ranks.restarts import Restarts
from rollstream.trainer.ranks.heartbeats import Beat, RankWatch, Verdict

TIMEOUT = 0.8


@dataclass
class Box:
    value: Any = None


@dataclass
class OneProcessRanks:
    """Ranks.broadcast in one process: rank 0 starts first and leaves its value in the box."""

    rank: int
    world_size: int
    box: Box

    def broadcast(self, value: Any) -> Any:
        if self.rank == 0:
            self.box.value = value
        return self.box.value


@dataclass
class Job:
    world: int
    box: Box = field(default_factory=Box)
    verdicts: dict[int, queue.Queue[Verdict]] = field(default_factory=dict)
    watches: list[RankWatch] = field(default_factory=list)

    def start(self, rank: int) -> RankWatch:
        self.verdicts[rank] = queue.Queue()
        watch = RankWatch.start(OneProcessRanks(rank, self.world, self.box), TIMEOUT, self.verdicts[rank].put)
        self.watches.append(watch)
        return watch

    def impostor(self, rank: int, step: int, phase: str) -> socket.socket:
        """A rank that says hello, then only what the test sends."""
        sock = socket.create_connection(tuple(self.box.value))
        sock.sendall(msgspec.json.encode(Beat(rank, 4242, socket.gethostname(), 0, step, phase)) + b"\n")
        return sock

    def verdict(self, rank: int, within: float) -> Verdict:
        return self.verdicts[rank].get(timeout=within)

    def no_verdict(self, rank: int, during: float) -> None:
        with pytest.raises(queue.Empty):
            self.verdicts[rank].get(timeout=during)


@pytest.fixture
def job() -> Iterator[Job]:
    made = Job(world=2)
    yield made
    for watch in made.watches:
        watch.close()


def test_a_silent_rank_is_stalled_after_the_timeout(job: Job) -> None:
    job.start(0)
    silent = job.impostor(1, step=3, phase="train")
    began = time.monotonic()
    verdict = job.verdict(0, within=TIMEOUT * 4)
    waited = time.monotonic() - began
    assert (verdict.rank, verdict.kind, verdict.step, verdict.phase) == (1, "stalled", 3, "train")
    assert TIMEOUT <= waited < TIMEOUT * 3, waited
    assert verdict.describe().startswith(f"rank 1 (pid 4242 on {socket.gethostname()}) stopped answering: no heartbeat for")
    assert "(trainer.rank_timeout_seconds 0.8) in step 3, phase 'train'" in verdict.describe()
    silent.close()


def test_a_rank_whose_connection_closes_without_a_goodbye_is_gone_at_once(job: Job) -> None:
    job.start(0)
    job.impostor(1, step=2, phase="commit").close()  # what the kernel does for a killed process
    began = time.monotonic()
    verdict = job.verdict(0, within=TIMEOUT)
    assert (verdict.kind, verdict.step, verdict.phase) == ("gone", 2, "commit")
    assert time.monotonic() - began < TIMEOUT / 2
    assert "is gone: its connection closed without a goodbye (the process ended) in step 2, phase 'commit'" in verdict.describe()


def test_a_check_now_names_a_peer_that_died_just_before_and_returns_at_once_while_all_live(job: Job) -> None:
    """What a rank does on torchrun's SIGTERM, which follows a peer's death by milliseconds:
    the peer's closed connection is named without waiting for the next heartbeat."""
    leader = job.start(0)
    follower = job.impostor(1, step=6, phase="train")
    time.sleep(0.05)
    began = time.monotonic()
    assert leader.check_now(5.0) is None
    assert time.monotonic() - began < TIMEOUT / 2  # one round of the watching thread, not a heartbeat's wait
    follower.close()  # rank 1 dies: the kernel closes its connection
    verdict = leader.check_now(5.0)
    assert verdict is not None and (verdict.rank, verdict.kind, verdict.step) == (1, "gone", 6), verdict


def test_live_ranks_reach_no_verdict_and_a_goodbye_ends_the_watching(job: Job) -> None:
    leader, follower = job.start(0), job.start(1)
    follower.at(5, "checkpoint")
    job.no_verdict(0, during=TIMEOUT * 2)  # both beat: nobody is stalled
    follower.close("closed")
    job.no_verdict(0, during=TIMEOUT * 2)  # said goodbye: not watched any more
    assert leader.verdict is None


def test_a_failure_reaches_the_other_rank_with_its_error_and_position(job: Job) -> None:
    job.start(0)
    follower = job.start(1)
    follower.at(4, "train")
    follower.close("failed", "ValueError: boom")
    verdict = job.verdict(0, within=TIMEOUT)
    assert (verdict.rank, verdict.kind, verdict.step, verdict.phase, verdict.detail) == (1, "failed", 4, "train", "ValueError: boom")
    assert job.watches[0].settle(0) is verdict  # what a rank whose collective failed asks


def test_rank_0_tells_every_rank_which_rank_ended_the_job() -> None:
    job = Job(world=3)
    try:
        job.start(0)
        job.start(1)
        silent = job.impostor(2, step=7, phase="train")
        about_2 = job.verdict(0, within=TIMEOUT * 4)
        told = job.verdict(1, within=TIMEOUT)
        assert (about_2.rank, about_2.kind) == (2, "stalled")
        assert (told.rank, told.kind) == (0, "ending") and told.detail == about_2.describe()
        assert told.describe().startswith("rank 0 (pid") and "ended the job in step" in told.describe()
        silent.close()
    finally:
        for watch in job.watches:
            watch.close()


def test_the_restart_a_line_announces(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Restarts.from_env().after_failure() == "nothing restarts it (not under torchrun)"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert Restarts.from_env().this_run() == "first run (at most 3 restarts)"
    assert Restarts.from_env().after_failure() == "torchrun restarts the job (restart 1 of at most 3)"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert Restarts.from_env().this_run() == "restart 3 of at most 3"
    assert Restarts.from_env().after_failure() == "torchrun has no restart left (3 of 3 used): the job ends"
