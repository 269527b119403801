"""Publishing weight versions so that nothing can go wrong.

- Versions only go up: publishing a version at or below the current one raises
  :class:`VersionRefused` (checked and written in one Redis script, so two publishers cannot
  interleave between the check and the write).
- A version is published only once its checkpoint is complete: a
  :class:`~rollstream.trainer.checkpoints.Checkpoint` must carry its completion marker, a plain
  local path must exist (``scheme://`` locations are taken as given: the caller vouches).
- Retention: after a publish, checkpoints older than the newest ``trainer.keep_checkpoints``
  are deleted together with their Redis entries (the entry first, so no reader is ever handed
  a path that is being deleted); the version Redis points at is never among them.

``current_version()`` and ``current()`` (the version and where its weights are) are what a
restarted trainer resumes from.

Redis down or restarting is waited out (the one retry policy, ``REDIS_RETRY``), not raised: a
trainer must not die on an outage of Redis between two steps. A publish whose answer was lost
and that finds its own version current on the retry counts as published.

Over the wire (``rollout.weight_transfer: distributed``): rank 0 publishes with the model in
hand (``publish(version, checkpoint_or_None, model=model)``); its :class:`WeightSender` sends the
tensors to every inference server (``rollout.server_urls``) before the publish returns, and a
checkpoint, when one is given, is recorded for recovery and for servers that missed the
version. Servers whose weight-sync owner reports them down are not waited for. What went where
is ``last_transfer``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from redis.exceptions import RedisError

from rollstream.api.engine import WeightUpdate
from rollstream.config import RollstreamConfig
from rollstream.retry import REDIS_RETRY
from rollstream.state.client import RedisKeys, connect
from rollstream.state.server_lease import ServerLeases
from rollstream.state.version_store import VersionStore
from rollstream.trainer.checkpoints import Checkpoint, CheckpointError, Checkpoints
from rollstream.trainer.loop_thread import LoopThread
from rollstream.trainer.weight_sender import TransferReport, WeightSender, named_tensors

log = logging.getLogger(__name__)

T = TypeVar("T")
REDIS_FAULTS = (RedisError, OSError)


async def _waiting_out(call: Callable[[], Awaitable[T]], what: str) -> T:
    return await REDIS_RETRY.call(call, retry_on=REDIS_FAULTS, what=what)


class VersionRefused(ValueError):
    """The version is not above the current one; versions only go up."""

    def __init__(self, version: int, current: int) -> None:
        super().__init__(
            f"weight version {version} refused: the current version is {current} and versions only go up "
            f"(publish {current + 1} or later; a restarted trainer resumes from current_version())"
        )
        self.version = version
        self.current = current


def _location(version: int, weights: str | Path | Checkpoint) -> str:
    """Where ``version``'s weights are, once it is sure they are complete."""
    if isinstance(weights, Checkpoint):
        if weights.version != version:
            raise CheckpointError(f"checkpoint {weights.path} is version {weights.version}, not {version}")
        if Checkpoint.read(weights.path) is None:
            raise CheckpointError(f"checkpoint {weights.path} is not complete (no marker): not publishing it")
        return str(weights.path.resolve())
    text = str(weights)
    if "://" in text:
        return text
    path = Path(text)
    if not path.exists():
        raise CheckpointError(
            f"weights of version {version} at {text} do not exist: publish a version only after its "
            "checkpoint is completely written (Checkpoints.write)"
        )
    return str(path.resolve())


class VersionPublisher:
    """Publishes the trainer's weight versions to Redis (an async context manager).

    With ``checkpoints``, each publish also applies the retention (``keep``, default
    ``trainer.keep_checkpoints``) to that directory and to Redis.
    """

    def __init__(self, config: RollstreamConfig, checkpoints: Checkpoints | None = None, keep: int | None = None) -> None:
        self._redis = connect(config.redis)
        keys = RedisKeys(config.experiment.experiment_name, config.experiment.trial_name)
        self.store = VersionStore(self._redis, keys)
        self.checkpoints = checkpoints
        self.keep = keep if keep is not None else config.trainer.keep_checkpoints
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        self.last_published = 0  # the newest version this publisher published (what its steps train)
        self.sender: WeightSender | None = None
        self.last_transfer: TransferReport | None = None
        self._servers = [u.rstrip("/") for u in config.rollout.server_urls]
        self._leases = ServerLeases(self._redis, keys, "trainer", config.rollout.server.lease_ttl_seconds)
        if config.rollout.weight_transfer == "distributed":
            self.sender = WeightSender(config.trainer.weight_sender)

    async def __aenter__(self) -> VersionPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._redis.aclose()

    async def current_version(self) -> int:
        """The published version (0 when none was)."""
        return await _waiting_out(self.store.get_version, "reading the weight version")

    async def current(self) -> WeightUpdate | None:
        """The published version and where its weights are; None when none was published."""
        return await _waiting_out(self.store.get_update, "reading the weight version")

    async def publish(self, version: int, weights: str | Path | Checkpoint | None = None, model: Any = None) -> None:
        """Make ``version`` current and announce it: its weights at ``weights`` (a checkpoint),
        sent over the wire from ``model`` too when the transfer is distributed; see the module
        docstring for what is refused (:class:`VersionRefused`, :class:`CheckpointError`)."""
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        location = _location(version, weights) if weights is not None else ""
        update = WeightUpdate(version, location)
        if self.sender is not None:
            if model is None:
                raise ValueError("rollout.weight_transfer is 'distributed': publish(version, checkpoint, model=model) "
                                 "so that rank 0 sends the model's weights to the inference servers")
            self.sender.open(version, named_tensors(model))
            update = WeightUpdate(version, location, self.sender.address,
                                  time.time() + self.sender.settings.timeout_seconds, self.sender.settings.backend)
        elif not location:
            raise CheckpointError(f"weight version {version} needs its checkpoint (rollout.weight_transfer is "
                                  "'checkpoint': inference servers load it)")
        try:
            await self._publish(update)
        except BaseException:
            if self.sender is not None:
                self.sender.close()
            raise
        if self.sender is not None:
            self.last_transfer = await asyncio.to_thread(self.sender.serve, await self._expected_servers())
            log.info("sent weight version %s", self.last_transfer)
        if self.checkpoints is not None:
            await self.retain(version)

    async def _publish(self, update: WeightUpdate) -> None:
        tries = 0

        async def once() -> int | None:
            nonlocal tries
            tries += 1
            return await self.store.publish_newer(update)

        current = await _waiting_out(once, f"publishing weight version {update.version}")
        if current is not None and not (tries > 1 and current == update.version):  # a retry may find its own
            raise VersionRefused(update.version, current)
        self.last_published = max(self.last_published, update.version)

    async def _expected_servers(self) -> list[str]:
        """The servers to wait for: every configured one whose owner does not report it down."""
        try:
            states = await self._leases.states()
        except REDIS_FAULTS as exc:
            log.warning("cannot read the servers' weight-sync states (%s): waiting for every server", exc)
            states = {}
        return [url for url in self._servers if url not in states or states[url].phase != "down"]

    async def retain(self, published: int) -> list[int]:
        """Delete checkpoints older than the newest ``keep`` up to ``published``, each Redis
        entry before its directory; returns the versions deleted."""
        assert self.checkpoints is not None
        versions = [c.version for c in self.checkpoints.complete() if c.version <= published]
        old = versions[:-self.keep]
        if old:
            await _waiting_out(lambda: self.store.forget(old), f"forgetting versions {old}")
            for version in old:
                self.checkpoints.delete(version)
            log.info("retention: deleted checkpoints %s and their redis entries", old)
        return old


class SyncVersionPublisher:
    """:class:`VersionPublisher` for synchronous trainers (its Redis client on a thread)."""

    def __init__(self, config: RollstreamConfig, checkpoints: Checkpoints | None = None, keep: int | None = None) -> None:
        self._thread = LoopThread("rollstream-versions")

        async def make() -> VersionPublisher:
            return VersionPublisher(config, checkpoints, keep)

        self._publisher = self._thread.run(make())

    def __enter__(self) -> SyncVersionPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._thread.run(self._publisher.close(), timeout=10)
        finally:
            self._thread.close()

    @property
    def last_published(self) -> int:
        """The newest version this publisher published (0: none yet); safe from any thread."""
        return self._publisher.last_published

    def current_version(self) -> int:
        return self._thread.run(self._publisher.current_version())

    def current(self) -> WeightUpdate | None:
        return self._thread.run(self._publisher.current())

    @property
    def last_transfer(self) -> TransferReport | None:
        """How the last version sent over the wire went (None: none was)."""
        return self._publisher.last_transfer

    def publish(self, version: int, weights: str | Path | Checkpoint | None = None, model: Any = None) -> None:
        self._thread.run(self._publisher.publish(version, weights, model))
