"""One sync owner per shared inference server: it alone pauses, loads and continues it.

One design for both server kinds: it drives a server only through
:class:`~rollstream.engines.server_admin.ServerAdmin` (SGLang's or vLLM's).
Every rollout worker with ``rollout.engine: sglang`` or ``vllm`` runs a :class:`SharedServerFollower`:

* it follows the trainer's version in Redis like :class:`VersionFollower`, but only declares
  each version to its engine (which then sends calls only to servers that report it, and tags
  tokens with what the servers report); it never pauses or reloads a server;
* it runs one :class:`SyncCandidate` per server URL in its config. All workers' candidates for a
  URL compete for one Redis lease (``rollstream.state.server_lease``); the one holding it is the
  server's only sync owner. A dead sync owner's lease expires after
  ``rollout.server.lease_ttl_seconds`` and another worker's candidate takes the server over.

What a sync owner does while it holds the lease (and checks before every phase of an update,
``ServerSyncState.phase``, that it still does):

* when the server's label is below the newest published version (a new version, or a server
  that restarted or missed updates while down), or was written by an older epoch than one
  already seen on the server (a former sync owner's, after its successor's): pause (mode
  ``rollout.weight_update_mode``: ``abort`` cuts the running requests, ``keep`` freezes them
  with their keys and values), load, continue. How the weights get there: over the wire when
  the trainer sends the version (``rollout.weight_transfer: distributed``) and still serves it;
  else its checkpoint; else (a server that joins or restarts after the version was sent) the
  newest checkpoint at or below it, labelled with that checkpoint's version, so the server
  catches up and takes the next version over the wire. Superseded versions are skipped.
  A failed load resumes the server, which keeps a label no worker trusts (vLLM) or its old one
  (SGLang), and is retried with capped backoff;
* every call carries the sync owner's fencing epoch, its lease token: the server refuses a call
  from an older epoch (vLLM's weight fence), so a sync owner that stalled past its lease changes
  nothing once its successor called. A refusal means a newer sync owner took over: this one gives
  the lease up and competes again (a new grant has a newer token);
* every ``reconcile_seconds`` it re-reads the server's label and probes it: a server that went
  back (restarted on its launch weights) is reloaded; one that is up but does not generate
  while no update runs (a pause left behind) is continued, as is every server at once when a
  sync owner takes it over (its predecessor may have died mid-update);
* it records each phase in Redis (``ServerLeases.write_state``, fenced by its token), which is
  how an operator tells "paused for a weight update" from "down".

Every pause and load is recorded first, and taken only when Redis confirms the lease right then
(a refusal or an unreachable Redis stops the sync owner): a Redis that came back with an earlier
moment's state voids every lease granted before (``rollstream.state.server_lease``), so a sync
owner whose grant it forgot starts no new phase. Where the server cannot fence (SGLang), a sync
owner that stalls past its lease may still have one HTTP call in flight when its successor
starts; SGLang labels weights in the same call that loads them, so such a call can only load
older weights under their own label, which the successor's reconcile replaces within
``reconcile_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from rollstream.api.engine import InferenceEngine, WeightUpdate
from rollstream.config import ServerConfig
from rollstream.engines.server_admin import NotServed, PauseMode, ServerAdmin, ServerHealth
from rollstream.engines.server_http import TRANSPORT_ERRORS, EngineRequestError, FencedOut, Retryable
from rollstream.runtime.metrics import WEIGHT_VERSION
from rollstream.state.server_lease import Lease, Phase, ServerLeases, ServerSyncState
from rollstream.retry import WEIGHTS_RETRY
from rollstream.runtime.tasks import cancel_and_wait, raise_if_cancelled, run_together
from rollstream.rollout_workers.version_follower import TIER, VersionFollower, VersionSource

log = logging.getLogger(__name__)

REDIS_ERRORS = (RedisError, OSError)
SERVER_ERRORS = (*TRANSPORT_ERRORS, Retryable, EngineRequestError)


CheckpointLookup = Callable[[int], Awaitable[WeightUpdate | None]]


async def _no_checkpoints(version: int) -> WeightUpdate | None:
    return None


class LeaseLost(Exception):
    """The sync owner no longer holds the server's lease: it must stop touching the server."""


class SyncCandidate:
    """Competes for one server's lease and, while holding it (the server's sync owner), keeps the
    server on the target.

    ``checkpoints(v)``: the newest checkpoint at or below version ``v`` (None when there is none),
    what a server loads when the version it lacks is no longer sent over the wire.
    """

    def __init__(self, url: str, admin: ServerAdmin, leases: ServerLeases, settings: ServerConfig,
                 mode: PauseMode = "abort", checkpoints: CheckpointLookup = _no_checkpoints) -> None:
        self.url = url
        self._admin = admin
        self._leases = leases
        self._settings = settings
        self._mode = mode
        self._checkpoints = checkpoints
        self._target: WeightUpdate | None = None
        self._changed = asyncio.Event()
        self._waiting_for: int | None = None  # the target it could not load (logged once)
        self._seen_epoch = 0  # the newest fencing epoch seen in the server's labels (its own included)
        self._not_served = -1  # the newest version the trainer answered it no longer sends
        self.loads = 0  # loads this candidate completed as sync owner (for tests and logs)
        self.failed_loads = 0
        self.lease: Lease | None = None

    def offer(self, update: WeightUpdate) -> None:
        """Make ``update`` the target if it is newer than the current one."""
        if self._target is None or update.version > self._target.version:
            self._target = update
            self._changed.set()

    async def run(self) -> None:
        """Compete for the lease and serve while holding it, until cancelled."""
        period = self._leases.ttl_seconds / 3
        try:
            while True:
                try:
                    lease = await self._leases.acquire(self.url)
                except REDIS_ERRORS as exc:
                    log.warning("cannot reach Redis for the lease of %s (%s); not its sync owner for now",
                                self.url, exc)
                    lease = None
                if lease is not None:
                    self.lease = lease  # before the check below, so that stopping releases it
                raise_if_cancelled()  # after each Redis call (see raise_if_cancelled)
                if lease is None:
                    await asyncio.sleep(period)
                    continue
                log.info("sync owner of %s (fencing token %d)", self.url, lease.token)
                try:
                    await self._serve_while_held(lease)
                except FencedOut as exc:  # a newer sync owner's epoch was accepted; a new grant has a newer token
                    log.warning("%s refused fencing token %d (%s): giving the lease up", self.url, lease.token, exc)
                    await self._give_up()
                log.warning("no longer the sync owner of %s", self.url)
        finally:
            await self._give_up()

    async def _give_up(self) -> None:
        """On stop: release a held lease so the next sync owner need not wait for the TTL."""
        lease, self.lease = self.lease, None
        if lease is not None and lease.valid():
            with contextlib.suppress(*REDIS_ERRORS):
                await asyncio.shield(self._leases.release(lease))

    async def _serve_while_held(self, lease: Lease) -> None:
        """Serve until the lease is lost; an unexpected error in either half propagates."""
        keeper = asyncio.create_task(self._keep(lease), name=f"lease-{self.url}")
        server = asyncio.create_task(self._serve(lease), name=f"sync-owner-{self.url}")
        try:
            done, _ = await asyncio.wait({keeper, server}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                with contextlib.suppress(LeaseLost):
                    task.result()
        finally:
            await cancel_and_wait(keeper, server)

    async def _keep(self, lease: Lease) -> None:
        """Renew every ttl/3; returns when the lease is lost or can no longer be confirmed."""
        period = self._leases.ttl_seconds / 3
        while True:
            await asyncio.sleep(period)
            try:
                if not await self._leases.renew(lease):
                    return
            except REDIS_ERRORS as exc:
                log.warning("cannot renew the lease of %s (%s)", self.url, exc)
            raise_if_cancelled()
            if not lease.valid():
                return

    async def _serve(self, lease: Lease) -> None:
        backoff = WEIGHTS_RETRY.backoff()
        taken_over = True
        while True:
            self._changed.clear()
            reconciled = await self._reconcile(lease, taken_over)
            raise_if_cancelled()  # its Redis calls may have lost one; and no wait_for below, for that reason
            if reconciled:
                taken_over = False
                backoff.succeeded()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._settings.reconcile_seconds):
                        await self._changed.wait()
            else:
                await backoff.sleep()

    async def _reconcile(self, lease: Lease, taken_over: bool) -> bool:
        """Bring the server to the target and running; False when it failed (retry later).

        The server is continued on taking it over (a predecessor may have died between its
        pause and its continue) and whenever it is up but does not generate; not blindly,
        since newer SGLang empties the CUDA cache on each continue. A label written by an older
        epoch than one already seen on the server counts as no version (workers discard what it
        labels): the sync owner loads again, under its own epoch.
        """
        self._check(lease)
        target = self._target
        try:
            label = await self._admin.label(self.url)
            version = None if 0 < label.epoch < self._seen_epoch else label.version
            self._seen_epoch = max(self._seen_epoch, label.epoch)
            if target is not None and (version is None or version < target.version):
                update, how = await self._source(target, version)
                if update is not None:
                    return await self._update(lease, update, how, version)
                if self._waiting_for != target.version:
                    self._waiting_for = target.version
                    log.info("%s: v%d is no longer sent and no checkpoint newer than v%s exists: waiting for the "
                             "next version", self.url, target.version, version)
            if not taken_over:
                probe = await self._admin.probe(self.url)
                if probe.health is ServerHealth.DOWN:
                    await self._record(lease, "down", None, probe.detail)
                    return False
                taken_over = probe.health is ServerHealth.NOT_GENERATING
                if taken_over:
                    log.warning("%s is up but does not generate (%s) and no update is running: continuing it",
                                self.url, probe.detail)
            if taken_over:
                await self._admin.resume(self.url, lease.token)
        except FencedOut:
            raise
        except SERVER_ERRORS as exc:
            await self._record(lease, "down", None, f"{type(exc).__name__}: {exc}")
            return False
        await self._record(lease, "serving", version)
        return True

    async def _update(self, lease: Lease, update: WeightUpdate, load: str, version: int | None) -> bool:
        started = time.monotonic()
        log.info("%s: loading weight version %d (server at %s) %s", self.url, update.version, version,
                 f"from the trainer at {update.source}" if load == "receive" else f"from {update.path}")
        loaded = False
        try:
            await self._enter_phase(lease, "pausing", version,
                                    lambda url: self._admin.pause(url, lease.token, self._mode))
            how = self._admin.receive if load == "receive" else self._admin.load
            await self._enter_phase(lease, "loading", version, lambda url: how(url, update, lease.token, self._mode))
            loaded = True
        except FencedOut:
            raise
        except NotServed as exc:  # the trainer moved on: the next try catches up from a checkpoint
            self._not_served = max(self._not_served, update.version)
            log.info("%s: %s; catching up from a checkpoint", self.url, exc)
        except SERVER_ERRORS as exc:
            self.failed_loads += 1
            log.error("%s: loading weight version %d failed (%s: %s); it resumes and is not used until a load "
                      "succeeds", self.url, update.version, type(exc).__name__, exc)
        finally:  # also when stopped (cancelled) mid-update: continue the server it paused
            if lease.valid():  # never continue a server that is no longer ours
                with contextlib.suppress(*SERVER_ERRORS):
                    await self._record(lease, "continuing", update.version if loaded else version)
                    await self._admin.resume(self.url, lease.token)
        if not loaded:
            await self._record(lease, "failed", version, f"loading v{update.version} failed")
            return False
        self.loads += 1
        self._seen_epoch = max(self._seen_epoch, lease.token)
        await self._record(lease, "serving", update.version)
        log.info("%s: now at weight version %d (pause + %s + continue %.2fs)", self.url, update.version, load,
                 time.monotonic() - started)
        return True

    async def _source(self, target: WeightUpdate, version: int | None) -> tuple[WeightUpdate | None, str]:
        """What to load for ``target``: ``(update, "receive")`` while the trainer sends it,
        ``(update, "load")`` for a checkpoint (``target``'s own, else the newest below it that
        is newer than ``version``), ``(None, "")`` when nothing newer can be had now."""
        if target.source and time.time() < target.open_until and target.version > self._not_served:
            return target, "receive"
        if target.path:
            return target, "load"
        try:
            latest = await self._checkpoints(target.version)
        except REDIS_ERRORS as exc:
            log.warning("cannot read the checkpoints of %s from Redis (%s); will retry", self.url, exc)
            return None, ""
        if latest is None or (version is not None and latest.version <= version):
            return None, ""
        return latest, "load"

    async def _enter_phase(self, lease: Lease, phase: Phase, version: int | None,
                           op: Callable[[str], Awaitable[None]]) -> None:
        """Record ``phase`` and run ``op``, only while the lease holds and no stop was asked."""
        self._check(lease)
        await self._record(lease, phase, version, confirm=True)
        raise_if_cancelled()  # the record may have lost a stop: neither pause nor load after one
        await op(self.url)

    def _check(self, lease: Lease) -> None:
        if not lease.valid():
            raise LeaseLost(self.url)

    async def _record(self, lease: Lease, phase: Phase, version: int | None, message: str = "",
                      confirm: bool = False) -> None:
        target = self._target.version if self._target else None
        state = ServerSyncState(url=self.url, owner=lease.owner, token=lease.token, phase=phase,
                                target=target, version=version, since=time.time(), message=message)
        try:
            if not await self._leases.write_state(lease, state):
                lease.lost = True
                raise LeaseLost(self.url)
        except REDIS_ERRORS as exc:
            if confirm:  # a pause or load only on a lease Redis just confirmed: it may have forgotten it
                raise LeaseLost(self.url) from exc
            log.warning("cannot record the weight-sync state of %s (%s)", self.url, exc)


class WeightSync:
    """A :class:`SyncCandidate` per server URL, all fed the same target."""

    def __init__(self, urls: list[str], admin: ServerAdmin, leases: ServerLeases, settings: ServerConfig,
                 mode: PauseMode = "abort", checkpoints: CheckpointLookup = _no_checkpoints) -> None:
        self.candidates = [SyncCandidate(url.rstrip("/"), admin, leases, settings, mode, checkpoints)
                           for url in urls]

    def offer(self, update: WeightUpdate) -> None:
        for candidate in self.candidates:
            candidate.offer(update)

    async def run(self) -> None:
        """Run every candidate until cancelled; an unexpected error of one is raised."""
        await run_together({f"weight-sync-{o.url}": o.run() for o in self.candidates})


class SharedServerFollower(VersionFollower):
    """Follows the trainer's version for an engine on shared servers; see the module docstring."""

    takes_transfers = True  # the sync owners receive them, or catch up from a checkpoint

    def __init__(self, engine: InferenceEngine, store: VersionSource, sync: WeightSync, **kwargs: float) -> None:
        super().__init__(engine, store, **kwargs)
        self.sync = sync

    async def apply(self, update: WeightUpdate) -> None:
        """Declare ``update``'s version to the engine and hand it to the sync candidates."""
        self._engine.set_version(update.version)
        self.sync.offer(update)
        WEIGHT_VERSION.labels(TIER).set(update.version)
        log.info("trainer version %d: generating only on servers that report it", update.version)

    async def run(self) -> None:
        """Follow versions and run the sync candidates until cancelled."""
        await run_together({"version-follow": super().run(), "weight-sync": self.sync.run()})
