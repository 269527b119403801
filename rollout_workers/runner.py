"""Run the samples of each prompt record and publish them as they finish.

:meth:`PromptRunner.take` is called for every prompt record, in offset order. It records the
offset in the :class:`OffsetTracker` and resolves the record: what this worker knows itself
(running here, finished here: ``rollout_workers/local_claims.py``) needs no Redis; anything else
is claimed (``rollout_workers/claims.py``): a record another live worker runs is not run again;
a finished one is marked done at once. While Redis cannot be reached, or cannot vouch yet that
nobody runs a record, only a record nobody else can have fetched (beyond its partition's fresh
frontier) runs; the others wait. A record run here starts in the background. Each of the
prompt's ``group_size`` samples runs the workflow under the rollout semaphore (so at most
``max_concurrent_rollouts`` episodes generate at once) and publishes its ``Episode`` or
``SampleRejected`` keyed by task id as soon as it ends. Only when every sample's send has been
acknowledged is the record finished: the offset may be committed, and its claim says done as
soon as Redis answers (nothing waits for Redis). Records held by another worker, or not vouched
for, are asked again (:meth:`PromptRunner.recheck_held`) until they are done or may run here.

A record that cannot be run (undecodable, or naming a workflow outside the allow-list) is
dead-lettered and answered with a ``TaskFailed`` on ``episodes`` (when its task id is known),
then marked done. A failing workflow is a failed ``SampleRejected``; a failing publish is fatal
and surfaces through :attr:`PromptRunner.tasks`.

Images: each run of a prompt has an :class:`ImageLedger`, so an image's bytes go out with the
first episode that shows it and later episodes only name it. An episode message larger than
``kafka.max_message_bytes`` could never be written: it is published as a failed sample naming
its size and the limit instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollstream.runtime.tasks import cancel_and_wait, wait_event
from rollstream.api.context import workflow_context
from rollstream.api.engine import InferenceEngine
from rollstream.api.workflow import RolloutWorkflow
from rollstream.dump.lines import DumpWriter
from rollstream.kafka.dead_letter import dead_letter_for, send_dead_letter
from rollstream.kafka.record_size import size_problem
from rollstream.kafka.topics import TopicNames
from rollstream.runtime.metrics import DEAD_LETTERS, EPISODES, MESSAGES_IN, MESSAGES_OUT, PROMPT_CLAIMS, TOKENS
from rollstream.wire import Episode, PromptTask, SampleRejected, TaskFailed, WireDecodeError, decode_prompt, encode
from rollstream.rollout_workers.claims import Claim, Outcome, PromptClaims, record_identity
from rollstream.rollout_workers.local_claims import Known
from rollstream.rollout_workers.data_copies import copier
from rollstream.rollout_workers.episode_images import ImageLedger
from rollstream.rollout_workers.episodes import MAX_REASON_CHARS, describe_error, failed_sample, to_episode
from rollstream.rollout_workers.offsets import OffsetTracker
from rollstream.engines.episode_engine import EpisodeEngine
from rollstream.rollout_workers.registry import UnknownWorkflowError, WorkflowRegistry
from rollstream.rollout_workers.tasks import TaskSet

log = logging.getLogger(__name__)

TIER = "rollout-worker"


def outcome_of(message: Episode | SampleRejected) -> str:
    """Metric label: "episode", "rejected" (workflow returned None) or "failed"."""
    if isinstance(message, Episode):
        return "episode"
    return "failed" if message.failed else "rejected"


class PromptRunner:
    """Turns prompt records into published samples; see the module docstring."""

    def __init__(
        self,
        *,
        producer: AIOKafkaProducer,
        names: TopicNames,
        registry: WorkflowRegistry,
        engine: InferenceEngine,
        tracker: OffsetTracker,
        claims: PromptClaims,
        worker_id: str,
        max_concurrent_rollouts: int,
        dump: DumpWriter | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self._producer = producer
        self._names = names
        self._registry = registry
        self._engine = engine
        self._tracker = tracker
        self.claims = claims
        self._worker_id = worker_id
        self._dump = dump  # rollout.dump_to_file: AReaL's in-worker dumps
        self._max_message_bytes = max_message_bytes  # kafka.max_message_bytes (None: unchecked)
        self._rollouts = asyncio.Semaphore(max_concurrent_rollouts)
        self.tasks = TaskSet()
        self.inflight_samples = 0  # samples started (or waiting to start) and not yet published
        self.claiming = 0  # records taken whose claim is not answered yet
        self.local = claims.local if claims is not None else None  # type: ignore[union-attr]
        self.held: dict[tuple[TopicPartition, int], tuple[ConsumerRecord, str]] = {}  # run elsewhere, or unsure
        self.unsure: set[tuple[TopicPartition, int]] = set()  # held only because Redis could not vouch: may run here
        self._room = asyncio.Event()  # set whenever a sample ends

    def take(self, record: ConsumerRecord) -> None:
        """Take one prompt record: its offset is recorded at once, then it is claimed and,
        when the claim says so, run (see the module docstring)."""
        tp = TopicPartition(record.topic, record.partition)
        self._tracker.add(tp, record.offset)
        MESSAGES_IN.labels(TIER, record.topic).inc()
        self.claiming += 1
        self.tasks.spawn(self._claim(tp, record), f"claim-{record.topic}[{record.partition}]@{record.offset}")

    async def _claim(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        try:
            claim = await self._resolve(tp, record)
        finally:
            self.claiming -= 1
        self._follow(tp, record, claim)

    async def _resolve(self, tp: TopicPartition, record: ConsumerRecord) -> Claim:
        """What to do with ``record``: this worker's own knowledge first, then Redis; while
        Redis cannot answer (or vouch for an absence), a record runs only if it is fresh."""
        identity = record_identity(record)
        known = self.local.known(tp, record.offset, identity)
        if known is not None:
            return Claim(Outcome.MINE if known is Known.MINE else Outcome.DONE, self._worker_id)
        claim = await self.claims.claim(tp.partition, record.offset, identity)
        if claim is None or claim.outcome is Outcome.UNSURE:
            if self.local.fresh(tp, record.offset):  # nobody else can have fetched it: run, claim later
                self.claims.running(tp.partition, record.offset, identity)
                return Claim(Outcome.RUN)
            return Claim(Outcome.UNSURE, "Redis unreachable" if claim is None else "Redis not vouching yet")
        if claim.outcome is Outcome.MINE:  # our incarnation's claim, not running here: run it
            return Claim(Outcome.RUN)
        return claim

    def _follow(self, tp: TopicPartition, record: ConsumerRecord, claim: Claim) -> None:
        """Do what ``claim`` says for ``record`` (run it, wait for it, or count it done)."""
        PROMPT_CLAIMS.labels(TIER, claim.outcome.value).inc()
        where = f"{record.topic}[{record.partition}]@{record.offset}"
        self.held.pop((tp, record.offset), None)
        self.unsure.discard((tp, record.offset))
        if claim.outcome is Outcome.DONE:
            self.local.finished(tp, record.offset, record_identity(record))
            self._tracker.done(tp, record.offset)
        elif claim.outcome in (Outcome.HELD, Outcome.UNSURE):
            if claim.outcome is Outcome.HELD:
                log.info("prompt %s runs on worker %s: waiting for it to end", where, claim.holder)
            else:
                log.info("prompt %s waits (%s): it may run on another worker", where, claim.holder)
                self.unsure.add((tp, record.offset))
            self.held[(tp, record.offset)] = (record, claim.holder)
        elif claim.run_here:
            if claim.outcome is Outcome.TAKEN:
                log.warning("prompt %s: worker %s that ran it is gone; running it again", where, claim.holder)
            self._start(tp, record)
        # Outcome.MINE: running here already; its end marks the offset done

    async def recheck_held(self, owned: set[TopicPartition]) -> None:
        """Ask again about the records other workers hold (or Redis could not vouch for): done,
        still running, gone, or runnable now. Records of partitions no longer ``owned`` are
        forgotten (their new partition owner asks)."""
        for (tp, offset), (record, _) in list(self.held.items()):
            if tp not in owned:
                self._stop_waiting(tp, offset)
                continue
            claim = await self._resolve(tp, record)
            if (tp, offset) in self.held and claim.outcome not in (Outcome.HELD, Outcome.UNSURE):
                self._follow(tp, record, claim)

    def forget(self, tps: set[TopicPartition]) -> None:
        """Partitions revoked: stop waiting for their held records (what runs here goes on)."""
        for tp, offset in [key for key in self.held if key[0] in tps]:
            self._stop_waiting(tp, offset)

    def _stop_waiting(self, tp: TopicPartition, offset: int) -> None:
        self.held.pop((tp, offset), None)
        self.unsure.discard((tp, offset))
        self.claims.abandon(tp.partition, offset)

    async def release_unfinished(self) -> None:
        """After cancelling: give up the claims of records that did not finish, so their
        partition owner runs them at once instead of after this worker's liveness expired."""
        unfinished = sorted(self.local.running)
        for tp, offset in unfinished:
            await self.claims.release(tp.partition, offset)
            self.local.stopped(tp, offset)
        if unfinished:
            log.info("released the claims of %d unfinished prompts", len(unfinished))

    def _start(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        """Run a record claimed here (or refuse it: undecodable, unknown workflow)."""
        where = f"{record.topic}[{record.partition}]@{record.offset}"
        self.local.started(tp, record.offset, record_identity(record))
        try:
            task = decode_prompt(record.value)
        except WireDecodeError as exc:
            self.tasks.spawn(self._refuse(tp, record, None, "undecodable", exc.reason, exc), f"refuse-{where}")
            return
        try:
            workflow = self._registry.resolve(task.workflow)
        except UnknownWorkflowError as exc:
            self.tasks.spawn(self._refuse(tp, record, task, "unknown_workflow", str(exc), exc), f"refuse-{where}")
            return
        self.inflight_samples += task.group_size
        log.info("task %s: running %d samples with workflow %s (%s)", task.task_id, task.group_size,
                 task.workflow or self._registry.default_key, where, extra={"task_id": task.task_id})
        self.tasks.spawn(self._run_prompt(tp, record.offset, task, workflow), f"prompt-{task.task_id}")

    async def wait_for_room(self, timeout: float, has_room: Callable[[], bool]) -> None:
        """Return when a sample ends (room for more work), or after ``timeout`` seconds; at once
        when ``has_room()`` (a sample that ended before the wait began)."""
        self._room.clear()
        if not has_room():
            await wait_event(self._room, timeout)

    async def _publish_sample(
        self, task: PromptTask, message: Episode | SampleRejected, ledger: ImageLedger,
    ) -> Episode | SampleRejected:
        """Publish one sample (its images once per run, its size checked); returns what went out."""
        key = task.task_id.encode()
        async with ledger.lock:  # images go out with the first episode queued that shows them
            if isinstance(message, Episode):
                message = ledger.unsent(message)
            value = encode(message)
            problem = self._size_problem(message, value, key)
            if problem is not None:
                log.warning("task %s sample %d: %s", task.task_id, message.sample_idx, problem)
                message = failed_sample(task, message.sample_idx, problem)
                value = encode(message)
            delivery = await self._producer.send(self._names.episodes, value, key=key)
            if isinstance(message, Episode):
                ledger.mark(message)
        await delivery
        MESSAGES_OUT.labels(TIER, self._names.episodes).inc()
        return message

    def _size_problem(self, message: Episode | SampleRejected, value: bytes, key: bytes) -> str | None:
        if self._max_message_bytes is None or not isinstance(message, Episode):
            return None
        images = sum(len(data) for data in message.images.values())
        what = f"the episode message ({images} bytes of images)"
        return size_problem(what, value, key, self._max_message_bytes)

    async def _refuse(
        self, tp: TopicPartition, record: ConsumerRecord, task: PromptTask | None,
        label: str, reason: str, exc: BaseException,
    ) -> None:
        """Dead-letter ``record``, answer its task with ``TaskFailed``, then mark it done."""
        await send_dead_letter(self._producer, self._names.dead_letter, dead_letter_for(record, TIER, reason, exc))
        DEAD_LETTERS.labels(TIER, label).inc()
        MESSAGES_OUT.labels(TIER, self._names.dead_letter).inc()
        task_id = task.task_id if task else (record.key or b"").decode("utf-8", "replace")
        if task_id:
            failed = TaskFailed(
                task_id=task_id, group_size=task.group_size if task else 0,
                is_eval=task.is_eval if task else False, reason=reason[:MAX_REASON_CHARS],
            )
            delivery = await self._producer.send(self._names.episodes, encode(failed), key=task_id.encode())
            await delivery
            MESSAGES_OUT.labels(TIER, self._names.episodes).inc()
            log.warning("task %s: failed before running (%s)", task_id, label, extra={"task_id": task_id})
        else:
            log.warning("prompt record %s[%d]@%d has no key: dead-lettered without a TaskFailed",
                        record.topic, record.partition, record.offset)
        await self._producer.flush()  # the dead letter too must be stored before the commit
        await self._finished(tp, record.offset)

    async def _run_prompt(self, tp: TopicPartition, offset: int, task: PromptTask, workflow: RolloutWorkflow) -> None:
        fresh_data = copier(task.data)  # a workflow may mutate its data: each sample gets a copy
        ledger = ImageLedger()
        samples = [
            asyncio.create_task(self._run_sample(task, workflow, i, fresh_data, ledger), name=f"sample-{task.task_id}-{i}")
            for i in range(task.group_size)
        ]
        try:
            await asyncio.gather(*samples)
        except BaseException:
            await cancel_and_wait(*samples)
            raise
        await self._finished(tp, offset)
        log.info("task %s: all %d samples published", task.task_id, task.group_size, extra={"task_id": task.task_id})

    async def _finished(self, tp: TopicPartition, offset: int) -> None:
        """Everything of the record is published: the offset may be committed, and its claim
        says done as soon as Redis answers (a reader meanwhile finds it running here, on a live
        worker, and waits; one that reads it after the commit never reads it at all)."""
        identity = self.local.running.get((tp, offset), "")
        self.local.finished(tp, offset, identity)
        self.claims.done(tp.partition, offset, identity)
        self._tracker.done(tp, offset)

    async def _run_sample(
        self, task: PromptTask, workflow: RolloutWorkflow, sample_idx: int, fresh_data: Callable[[], dict[str, Any]],
        ledger: ImageLedger,
    ) -> None:
        try:
            async with self._rollouts:
                message = await self._roll(task, workflow, sample_idx, fresh_data())
            message = await self._publish_sample(task, message, ledger)
            EPISODES.labels(TIER, outcome_of(message)).inc()
            if self._dump is not None and isinstance(message, Episode):
                await self._dump.write(message)
        finally:
            self.inflight_samples -= 1
            self._room.set()

    async def _roll(
        self, task: PromptTask, workflow: RolloutWorkflow, sample_idx: int, data: dict[str, Any],
    ) -> Episode | SampleRejected:
        """Run one episode (on its own copy of the task's ``data``) in its own workflow context
        and convert its result."""
        engine = EpisodeEngine(self._engine, training=not task.is_eval)
        with workflow_context.scope(task_id=task.task_id, is_eval=task.is_eval, sample_idx=sample_idx):
            try:
                result = await workflow.arun_episode(engine, data)
            except Exception as exc:  # a failure, counted apart from rejections
                log.warning("task %s sample %d: workflow failed: %s", task.task_id, sample_idx, describe_error(exc),
                            exc_info=True, extra={"task_id": task.task_id, "sample_idx": sample_idx})
                return failed_sample(task, sample_idx, describe_error(exc))
            finally:
                TOKENS.labels(TIER).inc(engine.output_tokens)
        # The engine's version now versions generated tokens the trajectory leaves unversioned.
        message = to_episode(
            task, sample_idx, result, engine.stop_reason, self._worker_id, engine.get_version(), engine.responses,
            engine.image_data,
        )
        if isinstance(message, SampleRejected) and message.failed:
            log.warning("task %s sample %d: %s", task.task_id, sample_idx, message.reason,
                        extra={"task_id": task.task_id, "sample_idx": sample_idx})
        return message
