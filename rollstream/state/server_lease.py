"""Leases in Redis that elect one sync owner per inference server, with fencing tokens.

The sync owner of a server is the rollout worker process that holds its lease (``owner`` in this
module's names and in the stored values always means the sync owner).

Keys (hash-tagged like every rollstream key, so each script touches one slot on Redis Cluster):

* ``rs:{experiment.trial}:sync:lease:<url>``: ``"<owner>|<token>|<epoch>"`` with a TTL: the sync
  owner now, granted on which redis-server process (``rollstream.state.epoch``);
* ``rs:{experiment.trial}:sync:fence:<url>``: the fencing token of the last grant;
* ``rs:{experiment.trial}:sync:state``: hash ``url -> ServerSyncState`` (JSON), what the sync owner did;
* channel ``rs:{experiment.trial}:sync:events``: the new state, each time one is written.

Callers may rely on:

* :meth:`ServerLeases.acquire` grants a server to at most one sync owner at a time *in Redis*, also
  when Redis comes back with an earlier moment's state (empty, from a snapshot, a lagging
  replica): a lease granted on another redis-server process is no lease, so the holder of a
  grant Redis forgot can neither renew it nor write with it, and the server is granted anew.
  Each new grant gets a larger fencing token (across a restore too: tokens go on above
  Redis's clock in ms); the holder acquiring again renews.
* Acting on a server is safe only right after Redis confirmed the lease: a sync owner records each
  phase (pause, load) with :meth:`write_state` first and takes a refusal OR an unreachable Redis
  as "not mine" (``rollout_workers/weight_sync.py``), so a sync owner whose grant Redis forgot
  starts no new phase; only a call already in flight can overlap its successor.
* :meth:`renew`, :meth:`release` and :meth:`write_state` take effect only while the caller's
  ``(owner, token)`` still holds the lease, atomically (one Lua script): a sync owner whose lease
  expired and was taken over can neither extend it nor overwrite its successor's state.
* :meth:`Lease.valid` is the holder's own, conservative view: ``ttl`` after the last grant was
  *sent*, less a margin, so it ends before Redis can grant the lease to anyone else (as long as
  Redis keeps its state). A sync owner acts on a server only while it is valid and just confirmed.
* Redis errors (``redis.exceptions.RedisError``, ``OSError``) propagate: callers treat them as
  "not confirmed" and never crash on them.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import redis.asyncio as aioredis

from rollstream.state.client import RedisKeys
from rollstream.state.epoch import EPOCH_LUA

log = logging.getLogger(__name__)

Phase = Literal["pausing", "loading", "continuing", "serving", "failed", "down"]

# A lease is "owner|token|epoch": granted on which redis-server process (rollstream.state.epoch).
# One granted on another process (Redis came back from a snapshot, a lagging replica, a restart)
# is no lease at all: nobody can renew it, write with it or be refused because of it. Defines
# ``lease_of(raw) -> owner, token`` (nil for no lease on this epoch) and ``now`` (Redis's clock, ms).
_LEASES = EPOCH_LUA + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function lease_of(raw)
  if not raw then return nil end
  local owner, token, epoch = string.match(raw, '^(.*)|(%d+)|(%x+)$')
  if epoch ~= run_id then return nil end
  return owner, token
end
"""

# KEYS: lease, fence. ARGV: owner, ttl ms. The token granted (or renewed), 0 when another owner
# holds it. A new token is above the last one AND above Redis's clock in ms: the counter may
# have come back older with its process, the clock has not (as long as fewer than one lease a
# millisecond is granted, tokens only grow across a restore too).
_ACQUIRE = _LEASES + """
local owner, token = lease_of(redis.call('GET', KEYS[1]))
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(token)
end
if owner then return 0 end
local fence = (tonumber(redis.call('GET', KEYS[2]) or '0') or 0) + 1
if fence < now then fence = now end
redis.call('SET', KEYS[2], fence)
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. fence .. '|' .. run_id, 'PX', ARGV[2])
return fence
"""

# KEYS: lease (then the script's own). ARGV: "owner|token" first. Defines ``mine``: the caller
# holds the lease on this epoch.
_MINE = _LEASES + """
local owner, token = lease_of(redis.call('GET', KEYS[1]))
local mine = owner ~= nil and owner .. '|' .. token == ARGV[1]
"""

# KEYS: lease. ARGV: "owner|token", ttl ms.
_RENEW = _MINE + """
if mine then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: "owner|token".
_RELEASE = _MINE + """
if mine then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS: lease, state hash. ARGV: "owner|token", url, state, channel.
_WRITE_STATE = _MINE + """
if mine then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
  redis.call('PUBLISH', ARGV[4], ARGV[3])
  return 1
end
return 0
"""

# KEYS: lease. {owner, token} holding it on this epoch, or nil.
_HOLDER = _LEASES + """
local owner, token = lease_of(redis.call('GET', KEYS[1]))
if owner then return {owner, token} end
return nil
"""


class ServerSyncState(msgspec.Struct, kw_only=True):
    """What the sync owner of ``url`` last did: ``phase`` toward ``target`` since ``since`` (unix
    seconds); ``version`` is the version the server reported then (None: not read)."""

    url: str
    owner: str
    token: int
    phase: Phase
    target: int | None = None
    version: int | None = None
    since: float = 0.0
    message: str = ""


@dataclass
class Lease:
    """A granted lease: the server, its sync owner, the fencing token and the local deadline."""

    url: str
    owner: str
    token: int
    valid_until: float = 0.0  # time.monotonic()
    lost: bool = field(default=False)

    @property
    def value(self) -> str:
        return f"{self.owner}|{self.token}"

    def valid(self) -> bool:
        return not self.lost and time.monotonic() < self.valid_until


def sync_owner_id(worker_id: str) -> str:
    """A sync owner name unique to this process (a restarted worker is a new sync owner)."""
    return f"{worker_id}:{uuid.uuid4().hex[:8]}"


class ServerLeases:
    """Lease operations for one sync owner over any number of servers; see the module docstring."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, owner: str, ttl_seconds: float) -> None:
        if "|" in owner:
            raise ValueError(f"a sync owner name may not contain '|': {owner!r}")
        self._redis = client
        self._keys = keys
        self.owner = owner
        self.ttl_seconds = ttl_seconds
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._write = client.register_script(_WRITE_STATE)
        self._holder = client.register_script(_HOLDER)

    def _lease_key(self, url: str) -> str:
        return self._keys.key(f"sync:lease:{url}")


    @property
    def state_key(self) -> str:
        return self._keys.key("sync:state")

    @property
    def channel(self) -> str:
        return self._keys.key("sync:events")

    def _deadline(self, sent_at: float) -> float:
        # Redis starts the TTL when it runs the script, after we sent it: ending ttl after the
        # send (less a margin for clock rate differences) ends before anyone else can hold it.
        return sent_at + self.ttl_seconds - min(0.5, 0.1 * self.ttl_seconds)

    async def acquire(self, url: str) -> Lease | None:
        """The lease on ``url`` if it is free or already ours; None when another sync owner holds it."""
        sent_at = time.monotonic()
        keys = [self._lease_key(url), self._keys.key(f"sync:fence:{url}")]
        token = int(await self._acquire(keys=keys, args=[self.owner, self._ttl_ms()]))
        if token == 0:
            return None
        return Lease(url, self.owner, token, self._deadline(sent_at))

    async def renew(self, lease: Lease) -> bool:
        """Extend ``lease``; False (and ``lease.lost``) when it is no longer ours."""
        sent_at = time.monotonic()
        if await self._renew(keys=[self._lease_key(lease.url)], args=[lease.value, self._ttl_ms()]):
            lease.valid_until = self._deadline(sent_at)
            return True
        lease.lost = True
        return False

    async def release(self, lease: Lease) -> None:
        """Give ``lease`` up now (a graceful stop), so another sync owner need not wait for the TTL."""
        lease.lost = True
        await self._release(keys=[self._lease_key(lease.url)], args=[lease.value])

    async def write_state(self, lease: Lease, state: ServerSyncState) -> bool:
        """Record ``state`` and announce it, only while ``lease`` holds; False otherwise."""
        payload = msgspec.json.encode(state).decode()
        keys = [self._lease_key(lease.url), self.state_key]
        return bool(await self._write(keys=keys, args=[lease.value, lease.url, payload, self.channel]))

    async def holder(self, url: str) -> tuple[str, int] | None:
        """``(owner, token)`` holding ``url`` now (on this redis-server process), or None."""
        answer = await self._holder(keys=[self._lease_key(url)])
        if answer is None:
            return None
        owner, token = answer
        return owner.decode(), int(token)

    async def states(self) -> dict[str, ServerSyncState]:
        """The last state each server's sync owners wrote (unreadable entries are skipped)."""
        raw = await self._redis.hgetall(self.state_key)
        states: dict[str, ServerSyncState] = {}
        for url, value in raw.items():
            try:
                states[url.decode()] = msgspec.json.decode(value, type=ServerSyncState)
            except msgspec.DecodeError:
                log.warning("unreadable weight-sync state for %s: %r", url, value[:200])
        return states

    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_seconds * 1000))
