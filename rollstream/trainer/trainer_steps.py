"""The synchronous trainer API: one process, or every rank of a ``torchrun`` job.

    with TrainerSteps(config) as steps:
        for step in steps:           # this rank's share of one step
            train_step(step)         # as long as it takes
            steps.commit(step)       # returns once every rank finished and the step is committed

Single process: the Kafka client runs on a background thread (it keeps the consumer in its
consumer group while a step computes), and the loop is plain Python.

Under ``torchrun`` (``torch.distributed`` initialized, more than one rank), every rank
creates ``TrainerSteps`` and runs the same loop; every call is collective:

- rank 0 alone owns the Kafka consumer. Each round it takes the next step's
  ``staleness.groups_per_step`` groups, splits them into one share per rank (whole groups, balanced
  by tokens, deterministic: :func:`~rollstream.trainer.ranks.split.split_by_tokens`) and scatters
  the shares over a gloo process group (:mod:`rollstream.trainer.ranks.world`), so the ranks step in
  lockstep, each on different groups;
- :meth:`TrainerSteps.commit` waits until every rank called it for the same step, then
  rank 0 writes the step to the ledger and commits its offsets, once; every rank returns
  (or raises) with the outcome;
- a round without a step (nothing arrived within ``wait_seconds``) returns None on every
  rank from :meth:`next_step` and is skipped by the iterator, so no collective waits longer
  than one round for the pipeline; :meth:`stop` on any rank ends every rank's iteration at
  the next round; a failure on rank 0 ends it too, raising on every rank.

The ranks watch each other apart from the collectives (:mod:`rollstream.trainer.ranks.heartbeats`,
:mod:`rollstream.trainer.ranks.health`): a rank that dies, stalls (no heartbeat for ``trainer.rank_timeout_seconds``) or fails ends
every rank within seconds, each with one log line naming the rank, its step and phase, the
restart that follows and where the job resumes; ``torchrun`` then restarts the job, which
resumes after the last committed step: no group lost, none trained twice (docs/TRAINER.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rollstream.config import ConfigError, RollstreamConfig
from rollstream.trainer.kafka_source import CommitRefused
from rollstream.trainer.loop_thread import LoopThread
from rollstream.trainer.ranks.health import CollectiveFailed, RankFailed, RankHealth
from rollstream.trainer.ranks.share import StepShare, decode_share, encode_share, group_rows, share_group
from rollstream.trainer.ranks.split import split_by_tokens
from rollstream.trainer.ranks.world import Ranks
from rollstream.trainer.step_source import StepSource
from rollstream.trainer.stream import StepFrontEnd
from rollstream.trainer.training_step import GroupRows, TrainingStep

log = logging.getLogger(__name__)


class TrainerSteps(StepFrontEnd):
    """Synchronous iterator of :class:`TrainingStep`, this rank's share of each step.

    ``source`` makes the step source on rank 0's I/O thread (default: the live Kafka source;
    see :mod:`rollstream.trainer.replay` for a replay). ``process_group`` is
    the torch process group whose ranks share the steps (default: every rank). ``wait_seconds`` is the
    length of one round of :meth:`__iter__`. Every rank rebuilds the vision inputs of its share
    with ``image_processor`` (default: the one of ``trainer.processor_path``, when set).
    ``published`` (rank 0): the newest version this trainer published (e.g.
    ``SyncVersionPublisher.last_published``), the version a step trains for ``trainer.drop_stale``
    (default: what Redis says, which a Redis that came back older understates).
    """

    def __init__(
        self,
        config: RollstreamConfig,
        *,
        include_eval: bool = False,
        client_id: str = "trainer",
        source: Callable[[], StepSource] | None = None,
        ledger: bool = True,
        process_group: Any = None,
        wait_seconds: float = 2.0,
        image_processor: Any = None,
        published: Callable[[], int] | None = None,
    ) -> None:
        self.ranks = Ranks.detect(process_group, config.trainer.collective_timeout_seconds)
        if config.staleness.groups_per_step < self.ranks.world_size:
            raise ConfigError(
                f"invalid configuration: staleness.groups_per_step {config.staleness.groups_per_step} is smaller than the "
                f"{self.ranks.world_size} ranks: every rank needs at least one group per step"
            )
        self.wait_seconds = wait_seconds
        super().__init__(config, image_processor, include_eval=include_eval, client_id=client_id, ledger=ledger,
                         published=published)
        self._stop = threading.Event()
        self._stopped = False
        self._mine: list[GroupRows] = []
        self._thread: LoopThread | None = None
        self.source: StepSource | None = None  # rank 0's (None on other ranks)
        self._health = RankHealth(self.ranks, config.trainer)
        if self.ranks.is_leader:
            factory = source or self.live_source
            self._thread = LoopThread()

            async def make() -> StepSource:
                return factory()

            try:
                self.source = self._thread.run(make())
            except BaseException as exc:
                self.close(exc)
                raise

    # -- lifecycle --

    def start(self) -> None:
        """Start the source (rank 0) and agree on where the steps resume (collective)."""
        self._health.at(0, "start")
        resume = None
        if self._thread is not None and self.source is not None:
            last = self._thread.run(self.source.start())
            resume = (last, dict(getattr(self.source, "resumed_offsets", {})))
        self._health.resume = self._health.collective(lambda: self.ranks.broadcast(resume))
        self.book.last_committed = self._health.step = self._health.resume[0]
        self._health.log_start()

    def close(self, error: BaseException | None = None) -> None:
        """Release the source and say goodbye to the other ranks (``error``: this rank failed
        with it; they end too, naming it)."""
        try:
            if self._thread is not None:
                try:
                    if self.source is not None:
                        self._thread.run(self.source.close(), timeout=30)
                finally:
                    self._thread.close()
                    self._thread = None
        finally:
            self._health.close(error)

    def __enter__(self) -> TrainerSteps:
        try:
            self.start()
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self._health.settle(exc)
        self.close(exc)

    @property
    def peer_lost(self) -> bool:
        """True once the heartbeats found a dead, stalled or failed rank: this process is
        ending (a stop requested now could not finish the step)."""
        return self._health.lost

    def phase(self, name: str) -> None:
        """Name what this rank does now (e.g. ``checkpoint``, ``publish``), within its step: the
        other ranks' log names it if this rank dies or stalls in it."""
        self._health.at(self._health.step, name)

    def stop(self) -> None:
        """Ask every rank to leave its loop at the next round (safe from a signal handler)."""
        self._stop.set()

    # -- steps --

    def __iter__(self) -> Iterator[TrainingStep]:
        while True:
            step = self.next_step(self.wait_seconds)
            if step is not None:
                yield step
            elif self._stopped:
                return

    def next_step(self, timeout: float | None = None) -> TrainingStep | None:
        """This rank's share of the next step; None when no step came within ``timeout``
        seconds, or when the ranks stopped (``stopped`` is then True). Collective."""
        self._health.at(self._health.step + 1, "next step")
        if self._stopped or self._agree_to_stop():
            self._stopped = True
            self._health.at(self._health.step, "stopped")
            return None
        payloads = self._lead_round(timeout) if self.ranks.is_leader else None
        share = decode_share(self._health.collective(lambda: self.ranks.scatter(payloads)))
        if share.kind == "stop":
            self._stopped = True
            if share.error:
                raise RankFailed(share.error if self.ranks.is_leader else f"rank 0 failed: {share.error}")
            return None
        if share.kind == "idle":
            return None
        self._health.step = share.step
        self._health.at(share.step, "train")
        groups = self._mine if self.ranks.is_leader else [group_rows(g) for g in share.groups]
        offsets = self.book.pending[share.step].offsets if self.ranks.is_leader else {}
        step = self._assemble(groups, share.step, offsets)
        step.rank, step.world_size, step.step_groups = share.rank, share.world_size, share.step_groups
        return step

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _agree_to_stop(self) -> bool:
        if self.ranks.process_group is None:
            return self._stop.is_set()
        flag = torch.tensor([1 if self._stop.is_set() else 0], dtype=torch.int32)
        self._health.collective(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ranks.process_group))
        return bool(flag.item())

    def _lead_round(self, timeout: float | None) -> list[bytes]:
        """Rank 0: the payload of every rank for this round (a step's groups split between them)."""
        assert self._thread is not None and self.source is not None
        world = self.ranks.world_size
        try:
            step = self._thread.run(self.source.next_step(timeout))
        except Exception as exc:  # every rank must hear of it, or they would wait forever
            log.exception("trainer step source failed")
            return [encode_share(StepShare(kind="stop", error=f"{type(exc).__name__}: {exc}"))] * world
        if step is None:
            kind = "stop" if self.source.exhausted else "idle"
            return [encode_share(StepShare(kind=kind))] * world
        shares = split_by_tokens([g.tokens for g in step.groups], world)
        self.book.handed_out(step, [[step.groups[i].task_id for i in share] for share in shares])
        self._mine = [step.groups[i] for i in shares[0]]
        head = dict(kind="step", step=step.number, world_size=world, step_groups=len(step.groups))
        payloads = [encode_share(StepShare(rank=0, **head))]  # rank 0 keeps its groups as they are
        for rank in range(1, world):
            groups = [share_group(step.groups[i]) for i in shares[rank]]
            payloads.append(encode_share(StepShare(rank=rank, groups=groups, **head)))
        return payloads

    def commit(self, step: TrainingStep) -> None:
        """Commit ``step`` (and every step before it) once every rank finished it.

        Collective: every rank calls it with its share of the same step. Raises
        :class:`CommitRefused` (rank 0) or :class:`RankFailed` (the others) on every rank
        when the commit failed."""
        self._health.at(step.step, "commit")
        steps = self._gather(step.step)
        if len(set(steps)) != 1:
            raise RuntimeError(f"ranks committed different steps {steps}: every rank must commit the same step")
        failure = None
        error: BaseException | None = None
        if self.ranks.is_leader:
            assert self._thread is not None and self.source is not None
            try:
                entries = self.book.due(step.step)
                if entries:
                    self._thread.run(self.source.commit(entries))
                    offsets = {p: o for entry in entries for p, o in entry.offsets.items()}  # the newest per partition
                    self._health.resume = (step.step, {**self._health.resume[1], **offsets})
            except Exception as exc:
                error, failure = exc, f"{type(exc).__name__}: {exc}"
        failure, self._health.resume = self._health.collective(lambda: self.ranks.broadcast((failure, self._health.resume)))
        if failure is not None:
            if error is not None:
                raise error
            raise RankFailed(f"rank 0 could not commit step {step.step}: {failure}")
        self.book.committed(step.step)
        self._health.at(step.step, "after commit")

    def _gather(self, step: int) -> list[int]:
        if self.ranks.process_group is None:
            return [step]
        steps: list[Any] = [None] * self.ranks.world_size
        self._health.collective(lambda: dist.all_gather_object(steps, step, group=self.ranks.process_group))
        return steps


__all__ = ["CollectiveFailed", "CommitRefused", "RankFailed", "TrainerSteps"]
