"""Follow the trainer's weight version: pause, load the new weights, continue.

:class:`VersionFollower` is for an engine this worker owns alone (the HF engine, a custom
one): it pauses, loads and resumes that engine itself. Engines whose servers are shared with
other workers (SGLang, vLLM servers) are followed by ``rollstream.rollout_workers.weight_sync.SharedServerFollower``,
which overrides :meth:`VersionFollower.apply` so that the worker only declares the version
and the server's one sync owner loads it.

:class:`VersionFollower.run` runs for the worker's lifetime. It never gives up on transient
trouble: while Redis is unreachable the engine keeps its last version and the follower
reconnects with capped exponential backoff; a weight load that fails is logged, generation
resumes on the old weights, and the load is retried (with backoff) until it works or a newer
version replaces it. Anything else (a bug) is raised to its caller, which stops the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from redis.exceptions import RedisError

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.runtime.metrics import WEIGHT_VERSION
from rollstream.retry import WEIGHTS_RETRY, RetryPolicy
from rollstream.runtime.tasks import raise_if_cancelled, run_together

log = logging.getLogger(__name__)

TIER = "rollout-worker"
REDIS_ERRORS = (RedisError, OSError)


class VersionSource(Protocol):
    """What the follower needs of :class:`rollstream.state.version_store.VersionStore`."""

    def watch(self, poll_seconds: float = 2.0) -> AsyncIterator[int]: ...

    async def get_update(self, version: int | None = None) -> WeightUpdate | None: ...

    async def latest_checkpoint(self, at_most: int) -> WeightUpdate | None: ...


class VersionFollower:
    """Keeps ``engine`` on the newest version published in ``store``."""

    def __init__(
        self,
        engine: InferenceEngine,
        store: VersionSource,
        *,
        poll_seconds: float = 2.0,
        retry: RetryPolicy = WEIGHTS_RETRY,
    ) -> None:
        self._engine = engine
        self._store = store
        self._poll_seconds, self._retry = poll_seconds, retry
        self._target = engine.get_version()
        self._changed = asyncio.Event()
        self.failed_loads = 0

    takes_transfers = False  # versions sent over the wire (no checkpoint) reach this engine
    async def apply(self, update: WeightUpdate) -> None:
        """Make ``update`` the engine's version: here, pause, load ``update``, declare its version,
        resume (also when the load raises)."""
        started = time.monotonic()
        await self._engine.pause()
        try:
            await self._engine.update_weights(update)
            self._engine.set_version(update.version)
        finally:
            await self._engine.resume()
        WEIGHT_VERSION.labels(TIER).set(update.version)
        log.info("now generating with weight version %d from %s (load took %.2fs)",
                 update.version, update.path, time.monotonic() - started)

    async def catch_up(self) -> int:
        """At start, before the first prompt: apply the trainer's current weights if Redis
        names any; returns the engine's version. Raises when they cannot be applied (a worker
        that cannot load the current weights should not start)."""
        try:
            update = await self._store.get_update()
        except REDIS_ERRORS as exc:  # the watch loop retries; a worker does not die of it
            log.warning("cannot read the trainer's version at start (%s: %s); starting with version %d",
                        type(exc).__name__, exc, self._engine.get_version())
            return self._engine.get_version()
        if update is not None and update.version != self._engine.get_version():
            await self.apply(update)
        log.info("starting with weight version %d", self._engine.get_version())
        self._target = max(self._target, self._engine.get_version())
        return self._engine.get_version()

    async def run(self) -> None:
        """Follow versions until cancelled; raises only on unexpected errors."""
        await run_together({"version-watch": self._watch_loop(), "version-apply": self._apply_loop()})

    def _offer(self, version: int) -> None:
        if version > self._target:
            log.info("trainer published weight version %d", version)
            self._target = version
            self._changed.set()
        elif version < self._target:
            log.warning("version store went back to %d (following %d); ignored", version, self._target)

    async def _watch_loop(self) -> None:
        backoff = self._retry.backoff()
        while True:
            try:
                async for version in self._store.watch(self._poll_seconds):
                    backoff.succeeded()
                    self._offer(version)
            except REDIS_ERRORS as exc:
                log.warning(
                    "version store unreachable (%s: %s); keeping version %d, retrying in %.1fs",
                    type(exc).__name__, exc, self._engine.get_version(), backoff.next_pause,
                )
                await backoff.sleep()

    async def _apply_loop(self) -> None:
        backoff = self._retry.backoff()
        while True:
            await self._changed.wait()
            self._changed.clear()
            while self._target > self._engine.get_version():
                outcome = await self._try_load(self._target)
                raise_if_cancelled()  # its Redis read may have lost a cancellation (see raise_if_cancelled)
                if outcome == "loaded":
                    backoff.succeeded()
                elif outcome == "no_weights":
                    break  # wait for the next version
                else:
                    await backoff.sleep()

    async def _try_load(self, version: int) -> str:
        """"loaded", "no_weights" (the version names no weights) or "failed"."""
        try:
            update = await self._store.get_update(version)
        except REDIS_ERRORS as exc:
            log.warning("cannot read weights of version %d (%s); will retry", version, exc)
            return "failed"
        if update is None:
            log.warning("version %d was published without weights; keeping version %d",
                        version, self._engine.get_version())
            return "no_weights"
        if not update.path and not self.takes_transfers:
            log.warning("version %d was published without a checkpoint (sent over the wire only); keeping "
                        "version %d", version, self._engine.get_version())
            return "no_weights"
        try:
            await self.apply(update)
        except Exception as exc:  # a bad checkpoint or a flaky server: keep generating, retry
            self.failed_loads += 1
            log.error(
                "loading weight version %d from %s failed (%s: %s); generating with version %d "
                "meanwhile, will retry", version, update.path, type(exc).__name__, exc,
                self._engine.get_version(),
            )
            await self._ensure_resumed()
            return "failed"
        return "loaded"

    async def _ensure_resumed(self) -> None:
        """Retry ``resume`` until it works, so a failed load never leaves generation paused."""
        backoff = self._retry.backoff()
        while True:
            try:
                await self._engine.resume()
                return
            except Exception as exc:
                log.error("engine resume failed (%s); retrying in %.1fs", exc, backoff.next_pause)
                await backoff.sleep()
