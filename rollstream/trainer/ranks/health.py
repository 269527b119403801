"""What one rank of a trainer job does about the others' health: where it is, where the job
resumes, and how it ends when another rank is lost.

:class:`TrainerSteps <rollstream.trainer.trainer_steps.TrainerSteps>` owns one
:class:`RankHealth`. It tells it the step and phase the rank is in (the heartbeats carry them,
:mod:`rollstream.trainer.ranks.heartbeats`) and where the job resumes (the last committed step and its
offsets, which rank 0 passes to every rank with each commit), and runs its collectives through
:meth:`RankHealth.collective`. When the heartbeats find a lost rank, :meth:`RankHealth._on_lost`
writes the one line that says which rank, its step and phase, this rank's, the restart that
follows and where the job resumes, ends a stalled rank on this host, and ends this process
(:data:`~rollstream.trainer.ranks.heartbeats.RANK_LOST_EXIT`): its main thread may sit in a collective that
never returns, and ``torchrun`` restarts the job once its ranks are gone.

``torchrun`` ends the surviving ranks with SIGTERM as soon as one rank's process exits, which
can come before a survivor's heartbeat thread ran (a busy machine). So while it watches, a rank
answers SIGTERM by having its heartbeats check the peers once more (a dead peer's connection is
closed by then): a lost peer is named in the one line and the process ends; otherwise the rank
acts as it would have without the watch.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from rollstream.config import TrainerConfig
from rollstream.trainer.kafka_source import CommitRefused
from rollstream.trainer.ranks.heartbeats import RANK_LOST_EXIT, RankWatch, Verdict, end_stalled_rank
from rollstream.trainer.ranks.restarts import Restarts
from rollstream.trainer.ranks.world import Ranks

log = logging.getLogger(__name__)

SETTLE_SECONDS = 5.0  # after a collective failed: how long to wait for the heartbeats' verdict
TERM_CHECK_SECONDS = 2.0  # on SIGTERM: the longest wait for the heartbeats' one more check


class RankFailed(RuntimeError):
    """Rank 0 failed (its error is in the message); every other rank raises this."""


class CollectiveFailed(RankFailed):
    """One of rollstream's collectives failed on this rank while every other rank was alive
    (their heartbeats came): ``trainer.collective_timeout_seconds`` passed, or the process
    group broke. Only this rank knows; the others hear it from the heartbeats."""


class RankHealth:
    """The heartbeats of one rank (none for a single process) and what it says when another
    rank is lost (see the module docstring). ``step``: the last step handed out; ``resume``:
    the last committed step and its offsets (partition -> next offset)."""

    def __init__(self, ranks: Ranks, config: TrainerConfig) -> None:
        self.ranks = ranks
        self.step = 0
        self.resume: tuple[int, dict[int, int]] = (0, {})
        self._collective_timeout = config.collective_timeout_seconds
        self._watch = RankWatch.start(ranks, config.rank_timeout_seconds, self._on_lost) if ranks.process_group is not None else None
        self._previous_term: Any = None
        if self._watch is not None and threading.current_thread() is threading.main_thread():
            self._previous_term = signal.signal(signal.SIGTERM, self._on_term)

    @property
    def lost(self) -> bool:  # see TrainerSteps.peer_lost
        return self._watch is not None and self._watch.verdict is not None

    def at(self, step: int, phase: str) -> None:  # see RankWatch.at
        if self._watch is not None:
            self._watch.at(step, phase)

    def close(self, error: BaseException | None = None) -> None:
        """Say goodbye: ``closed`` when this rank left its loop normally or with a failure every
        rank shares; ``failed`` with ``error`` otherwise, so that the others end too, naming it."""
        if self._watch is None:
            return
        if self._previous_term is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None
        # a failure of rank 0's, passed to every rank, is raised by every rank in the same round
        if error is None or isinstance(error, (RankFailed, CommitRefused)) and not isinstance(error, CollectiveFailed):
            self._watch.close("closed")
        else:
            self._watch.close("failed", f"{type(error).__name__}: {error}")

    def settle(self, error: BaseException) -> None:
        """A distributed error (gloo reports a broken connection when a peer died) waits briefly
        for the heartbeats' verdict, which ends this process with the line naming the lost rank
        instead of a traceback."""
        if self._watch is not None and isinstance(error, RuntimeError) and not isinstance(error, (RankFailed, CommitRefused)):
            self._watch.settle(min(self._watch.timeout, SETTLE_SECONDS))

    def collective(self, call: Callable[[], Any]) -> Any:
        """Run one of rollstream's collectives. When it fails, a lost rank ends this process
        (the heartbeats name it); otherwise :class:`CollectiveFailed` says where and which
        setting bounds the wait."""
        try:
            return call()
        except RuntimeError as exc:
            if self._watch is None:
                raise
            verdict = self._watch.settle(min(self._watch.timeout, SETTLE_SECONDS))
            if verdict is not None:
                raise RankFailed(verdict.describe()) from exc
            step, phase = self._watch.position
            raise CollectiveFailed(
                f"rank {self.ranks.rank}: a collective failed in step {step}, phase '{phase}', while the other "
                f"ranks were alive (heartbeats): {exc} (the longest wait is trainer.collective_timeout_seconds, "
                f"{self._collective_timeout:g} s)"
            ) from exc

    def resume_text(self) -> str:
        """``resuming after step 6 (committed offsets {0: 40, 1: 38})`` or ``starting at step 1``."""
        last, offsets = self.resume
        where = ", ".join(f"{p}: {o}" for p, o in sorted(offsets.items())) or "none"
        return f"resuming after step {last} (committed offsets {{{where}}})" if last else "starting at step 1"

    def log_start(self) -> None:
        """Rank 0, once the ranks agreed where the steps resume: which run of the job this is."""
        restarts = Restarts.from_env()
        if self.ranks.is_leader and (self.ranks.process_group is not None or restarts.under_torchrun):
            world = self.ranks.world_size
            log.info("trainer job of %d rank%s, %s: %s", world, "s" if world > 1 else "", restarts.this_run(),
                     self.resume_text())

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM while watching (see the module docstring): a verdict ends this process with
        its line (on the watch's thread); otherwise the handler that was there before runs."""
        assert self._watch is not None
        if self._watch.check_now(TERM_CHECK_SECONDS) is not None:
            time.sleep(SETTLE_SECONDS)  # the watch's thread writes the line and ends the process
        previous = self._previous_term
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _on_lost(self, verdict: Verdict) -> None:
        """The heartbeats' verdict (on the watch's thread): one line, then end this process."""
        assert self._watch is not None
        step, phase = self._watch.position
        resume = self.resume_text().replace("resuming", "resumes").replace("starting", "starts")
        maybe = f" (after step {step} if rank 0 committed it first)" if phase == "commit" and not self.ranks.is_leader else ""
        log.error("%s; this rank (%d) was in step %d, phase '%s'. Ending this rank: %s; the job %s%s",
                  verdict.describe(), self.ranks.rank, step, phase, Restarts.from_env().after_failure(), resume, maybe)
        if end_stalled_rank(verdict):
            log.error("ended rank %d (pid %d, SIGKILL): a stopped process cannot answer torchrun's SIGTERM",
                      verdict.rank, verdict.beat.pid if verdict.beat else -1)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(RANK_LOST_EXIT)
