"""The Redis epoch: which redis-server process holds the trial's keys.

Redis loses data in production by coming back with the state of an earlier moment: a restart
that loads its last RDB snapshot, an append-only file that lost its last second, a failover to
a replica that lagged. Each of these brings a NEW redis-server process to the keys (a restart
loads the files into a new process, a failover promotes another server's process, a slot
migration moves keys to another node), and redis-server draws a random ``run_id`` at every
start (``INFO server``). That ``run_id`` is the *epoch*.

State that must not be trusted once it may be older than the truth is stamped with the epoch it
was built (or checked) on, by the script that wrote it, and every script that relies on it
compares the stamp with the epoch it runs on, read inside the script (:data:`EPOCH_LUA`), so no
client can carry an old epoch across a restart. A stamp from another epoch means "this may be
an earlier moment's state": the caller rebuilds it from the durable facts (the topics), or
waits until every live holder has asserted its part again (docs/GUARANTEES.md, "Redis that
comes back older").

What this does not see: keys rewritten into a RUNNING process that keeps its run_id (an
operator's ``RESTORE`` of old values, ``DEBUG RELOAD`` of another file). Those are not ways Redis
loses data; an operator who does that deletes the stamps too (docs/DEPLOYMENT.md).
"""

from __future__ import annotations

# Lua: defines ``run_id``, the epoch of the process running the script. INFO is allowed in
# scripts (Redis >= 5 replicates scripts by their effects, so a non-deterministic read is fine).
EPOCH_LUA = "local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')\n"

# A whole script. KEYS: a key valued ``"<holder>|<epoch>"`` (a worker's liveness, the budget's
# rebuild lock). ARGV: the holder. Deletes the key while that holder holds it, on any epoch.
DELETE_IF_HELD = """
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then redis.call('DEL', KEYS[1]) end
return 1
"""
