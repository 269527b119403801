"""The staleness budget's Lua scripts (one slot each: every key carries the trial's hash tag).

The budget lives in one hash (``budget``): ``generation`` and ``epoch`` (the state's stamp),
the counters ``admitted``, ``dropped`` (groups the grouping tier dropped), ``trainer_dropped``
(groups the trainer dropped as stale, a cumulative count) and ``version_floor`` (a version the
trainer is known to have reached, from the topics), plus how it was rebuilt. Idempotency
markers (``admit:<task>``, ``drop:<task>``) hold the generation they were counted in, so a
marker of an earlier state never hides an admission from the current counters.

Every script that counts first checks the stamp against the process it runs on
(:data:`rollstream.state.epoch.EPOCH_LUA`): a state missing, or written on another process,
answers STATE_MISSING (-2) or STATE_STALE (-5) and counts nothing.
"""

from __future__ import annotations

from rollstream.state.epoch import DELETE_IF_HELD, EPOCH_LUA

# KEYS[1] must be the budget hash. Defines ``generation``; answers -2 / -5 when unusable.
_VALID_STATE = EPOCH_LUA + """
local stamp = redis.call('HMGET', KEYS[1], 'generation', 'epoch')
if not stamp[1] then return -2 end
if stamp[2] ~= run_id then return -5 end
local generation = stamp[1]
"""

# KEYS: budget, version, admit marker. ARGV: eta, groups per step, marker TTL, the caller's
# generation ('' = any). 1 admitted, 0 no room, -2, -5, {-4, current generation}, or
# {-3, key, value} for a counter that is not a number.
ADMIT = _VALID_STATE + """
if ARGV[4] ~= '' and generation ~= ARGV[4] then return {-4, generation} end
if redis.call('GET', KEYS[3]) == generation then return 1 end
local fields = {'admitted', 'dropped', 'trainer_dropped', 'version_floor'}
local raw = redis.call('HMGET', KEYS[1], unpack(fields))
local n = {}
for i = 1, 4 do
  n[i] = tonumber(raw[i] or '0')
  if n[i] == nil then return {-3, KEYS[1] .. '.' .. fields[i], raw[i]} end
end
local vraw = redis.call('GET', KEYS[2])
local v = tonumber(vraw or '0')
if v == nil then return {-3, KEYS[2], vraw} end
if n[4] > v then v = n[4] end
if n[1] - n[2] - n[3] < (tonumber(ARGV[1]) + v + 1) * tonumber(ARGV[2]) then
  redis.call('HINCRBY', KEYS[1], 'admitted', 1)
  redis.call('SET', KEYS[3], generation, 'EX', ARGV[3])
  return 1
end
return 0
"""

# KEYS: budget, drops_by_reason, drop marker, admit marker. ARGV: reason, marker TTL.
# 1 counted, 0 counted before in this generation, -2, -5.
RELEASE = _VALID_STATE + """
if redis.call('GET', KEYS[3]) == generation then return 0 end
redis.call('SET', KEYS[3], generation, 'EX', ARGV[2])
if redis.call('GET', KEYS[4]) == generation then redis.call('HINCRBY', KEYS[1], 'dropped', 1) end
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
return 1
"""

# KEYS: budget. ARGV: the trainer's cumulative count of groups it dropped as stale. Raises the
# count (never lowers it: the value is cumulative, so a repeat is harmless). 1, -2, -5.
TRAINER_DROPS = _VALID_STATE + """
local current = tonumber(redis.call('HGET', KEYS[1], 'trainer_dropped') or '0') or 0
if tonumber(ARGV[1]) > current then redis.call('HSET', KEYS[1], 'trainer_dropped', ARGV[1]) end
return 1
"""

# KEYS: budget. The generation, -2 or -5.
GENERATION = _VALID_STATE + "return generation\n"

# KEYS: budget, version. {admitted, dropped, trainer_dropped, version_floor, version, state}
# with state 1 valid, -2 missing, -5 stale (raw values: the caller parses them).
USAGE = EPOCH_LUA + """
local h = redis.call('HMGET', KEYS[1], 'admitted', 'dropped', 'trainer_dropped', 'version_floor', 'generation', 'epoch')
local state = 1
if not h[5] then state = -2 elseif h[6] ~= run_id then state = -5 end
return {h[1] or '0', h[2] or '0', h[3] or '0', h[4] or '0', redis.call('GET', KEYS[2]) or '0', state}
"""

# KEYS: lock. ARGV: holder, ttl ms. Takes (or renews) the rebuild lock when it is free, ours,
# or was taken on another epoch (a lock from an earlier moment's state binds no one): the
# epoch it holds it on; nil when another holder holds it on this epoch. The lock's value is
# "<holder>|<epoch>".
LOCK = EPOCH_LUA + """
local mine = ARGV[1] .. '|' .. run_id
local current = redis.call('GET', KEYS[1])
if current and current ~= mine and string.match(current, '|(%x+)$') == run_id then return false end
redis.call('SET', KEYS[1], mine, 'PX', ARGV[2])
return run_id
"""

# KEYS: lock. ARGV: holder, ttl ms. 1 renewed; 0 lost (expired, taken, or another epoch).
RENEW_LOCK = EPOCH_LUA + """
if redis.call('GET', KEYS[1]) == ARGV[1] .. '|' .. run_id then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lock. ARGV: lock holder.
UNLOCK = DELETE_IF_HELD

# KEYS: budget, drops_by_reason, lock. ARGV: lock holder ('' = no lock), admitted, dropped,
# generation, version floor, trainer dropped, restored at, note, then reason/count pairs.
# 1 written; 0 a valid state exists already; -6 the lock is not the holder's on this epoch (the
# rebuild must start again: its markers may have been written on another process).
RESTORE = EPOCH_LUA + """
if ARGV[1] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[1] .. '|' .. run_id then return -6 end
local stamp = redis.call('HMGET', KEYS[1], 'generation', 'epoch')
if stamp[1] and stamp[2] == run_id then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], 'admitted', ARGV[2], 'dropped', ARGV[3], 'version_floor', ARGV[5],
           'trainer_dropped', ARGV[6], 'restored_at', ARGV[7], 'note', ARGV[8])
for i = 9, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], 'generation', ARGV[4], 'epoch', run_id)
return 1
"""
LOCK_LOST = -6
