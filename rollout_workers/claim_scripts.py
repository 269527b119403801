"""The prompt claims' Lua scripts (``rollout_workers/claims.py``); every key carries the trial's
hash tag, so each script touches one slot.

A claim is a hash ``{worker, inc, state, rec}``: the worker and its incarnation, ``running`` or
``done``, and the record's identity (its timestamp and key): a claim whose identity differs is
another record's (the topic was recreated and offsets start again) and counts as no claim. A
worker's liveness key holds ``"<incarnation>|<epoch>"``: alive only on the redis-server process
it was written on (``rollstream.state.epoch``).

An ABSENCE (no claim; a holder whose liveness is not there) is trusted only when the caller
trusts it (``ARGV`` trust "1": it saw no disruption lately) AND the redis-server process is
settled for the trial's claims (the gate ``claims:epoch`` = ``"<epoch>|<since ms>"``): a process
that serves them for less than the window (the claims' failure detection time) may hold an
earlier moment's claims, or none, while live workers have not written theirs again yet. The
first script on a process sets the gate: ``since`` is now when the gate names another process,
and the process's start when there is none (a fresh trial on a Redis that has been up long is
settled at once; a Redis that came back empty is a new process). Otherwise the answer is
``unsure``. Every script answers the epoch it ran on last.
"""

from __future__ import annotations

from rollstream.state.epoch import DELETE_IF_HELD, EPOCH_LUA

# KEYS[#KEYS]: the gate; ARGV[#ARGV]: the window in ms. Defines ``settled``.
_GATE = EPOCH_LUA + """
local info = redis.call('INFO', 'server')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gate = redis.call('GET', KEYS[#KEYS])
local since
if gate and string.match(gate, '^(%x+)|') == run_id then
  since = tonumber(string.match(gate, '|(%d+)$'))
else
  if gate then since = now else since = now - 1000 * tonumber(string.match(info, 'uptime_in_seconds:(%d+)')) end
  redis.call('SET', KEYS[#KEYS], run_id .. '|' .. since)
end
local settled = now - since >= tonumber(ARGV[#ARGV])
"""

# KEYS: liveness. ARGV: incarnation, ttl ms, take ("1": at start, after the caller checked that
# no live worker holds the id). {"ok" | "other", holder incarnation, "1" when this incarnation's
# key was not there (Redis forgot it, or it expired), epoch}: a heartbeat never overwrites
# another incarnation alive on this epoch.
HEARTBEAT = EPOCH_LUA + """
local mine = ARGV[1] .. '|' .. run_id
local current = redis.call('GET', KEYS[1])
if current and current ~= mine and ARGV[3] ~= '1' then
  local inc, epoch = string.match(current, '^(.*)|(%x+)$')
  if epoch == run_id then return {'other', inc, '0', run_id} end
end
redis.call('SET', KEYS[1], mine, 'PX', ARGV[2])
if current == mine then return {'ok', '', '0', run_id} end
return {'ok', '', '1', run_id}
"""

# KEYS: liveness. {incarnation or '', remaining ms, epoch}: who holds the worker id on this epoch.
LIVENESS = EPOCH_LUA + """
local current = redis.call('GET', KEYS[1])
if current then
  local inc, epoch = string.match(current, '^(.*)|(%x+)$')
  if epoch == run_id then return {inc, redis.call('PTTL', KEYS[1]), run_id} end
end
return {'', 0, run_id}
"""

# KEYS: claim, gate. ARGV: worker, incarnation, ttl s, identity, trust ("1"), window ms.
# {outcome, holder worker, holder incarnation, epoch}, outcome run | done | mine | other | unsure.
CLAIM = _GATE + """
local c = redis.call('HMGET', KEYS[1], 'worker', 'inc', 'state', 'rec')
if c[1] and c[4] ~= ARGV[4] then c = {false, false, false, false} end
if not c[1] then
  if ARGV[5] ~= '1' or not settled then return {'unsure', '', '', run_id} end
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'inc', ARGV[2], 'state', 'running', 'rec', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {'run', '', '', run_id}
end
if c[3] == 'done' then return {'done', c[1], c[2], run_id} end
if c[1] == ARGV[1] and c[2] == ARGV[2] then return {'mine', c[1], c[2], run_id} end
return {'other', c[1], c[2], run_id}
"""

# KEYS: claim, the holder's liveness, gate. ARGV: holder worker, holder incarnation, worker,
# incarnation, ttl s, identity, trust ("1"), window ms. {taken | held | done | changed | unsure, epoch}.
TAKE_OVER = _GATE + """
local c = redis.call('HMGET', KEYS[1], 'worker', 'inc', 'state', 'rec')
if c[1] ~= ARGV[1] or c[2] ~= ARGV[2] or c[4] ~= ARGV[6] then return {'changed', run_id} end
if c[3] == 'done' then return {'done', run_id} end
if redis.call('GET', KEYS[2]) == ARGV[2] .. '|' .. run_id then return {'held', run_id} end
if ARGV[7] ~= '1' or not settled then return {'unsure', run_id} end
redis.call('HSET', KEYS[1], 'worker', ARGV[3], 'inc', ARGV[4], 'state', 'running')
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {'taken', run_id}
"""

# KEYS: claim. ARGV: worker, incarnation, ttl s, identity, state (running | done). Writes this
# worker's claim as it knows it; a running claim never replaces a done one of the same record.
ASSERT = """
if ARGV[5] == 'running' and redis.call('HGET', KEYS[1], 'state') == 'done'
   and redis.call('HGET', KEYS[1], 'rec') == ARGV[4] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'inc', ARGV[2], 'state', ARGV[5], 'rec', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: claim. ARGV: worker, incarnation. Gives up a running claim of ours.
RELEASE = """
local c = redis.call('HMGET', KEYS[1], 'worker', 'inc', 'state')
if c[1] == ARGV[1] and c[2] == ARGV[2] and c[3] == 'running' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS: liveness. ARGV: incarnation. Deletes it when it is still ours (any epoch).
RETIRE = DELETE_IF_HELD
