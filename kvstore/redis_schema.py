"""How the cluster index lives in Redis: the key layout and the Lua scripts that change it.

Keys of one model share the hash tag `{model}` (so a Redis Cluster keeps them in one slot):

    pdmesh:{model}:members        SET   instance ids registered (live, or dead and not yet swept)
    pdmesh:{model}:inst:<id>      HASH  the instance's registration; its TTL *is* the liveness
    pdmesh:{model}:blk:<hex>      SET   instance ids holding the block in their paged cache
    pdmesh:{model}:blkh:<hex>     SET   ... in their host offload tier
    pdmesh:{model}:blkd:<hex>     SET   ... in their disk offload tier
    pdmesh:{model}:held:<id>      SET   what the instance holds: `<hex>` (paged), `h:<hex>`
                                        (host), `d:<hex>` (disk): removal in one go
    pdmesh:{model}:seq:<id>       STR   last applied event-batch sequence number
    pdmesh:{model}:republish:<id> STR   a router's ask that the instance re-publish its
                                        slice (TTL); its heartbeat reads it, its next
                                        snapshot (an applied `C`) clears it

One block may sit in several media of one instance at once (the offload tiers keep a copy of
what they restored); the lookup counts each block at the fastest medium holding it.

Everything that must not interleave with another writer runs as one Lua script: applying an
event batch (checks liveness and the sequence number, then edits both directions of the
block <-> instance map), registering (scheme check across live instances), purging dead
instances, and the prefix lookup (one round trip that stops at the first miss on the server).
Scripts build keys from the namespace prefix passed as ARGV[1], mirroring `KeySpace`, so the
two must change together. No script uses SCAN or KEYS: their work is bounded by the
arguments, the model's member count, and the purged instances' block counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.engine.block_hash import BlockHash


@dataclass(frozen=True)
class KeySpace:
    """Key names for one model's index; `prefix` is what the Lua scripts receive."""

    model: str
    namespace: str = "pdmesh"

    @property
    def prefix(self) -> str:
        return f"{self.namespace}:{{{self.model}}}:"

    @property
    def members(self) -> str:
        return self.prefix + "members"

    def instance(self, instance_id: str) -> str:
        return self.prefix + "inst:" + instance_id

    def block(self, block_hash: BlockHash, medium: str = "paged") -> str:
        return self.prefix + MEDIUM_KEY[medium] + block_hash.hex()

    def held(self, instance_id: str) -> str:
        return self.prefix + "held:" + instance_id

    def seq(self, instance_id: str) -> str:
        return self.prefix + "seq:" + instance_id

    def republish(self, instance_id: str) -> str:
        return self.prefix + "republish:" + instance_id


MEDIUM_KEY = {"paged": "blk:", "host": "blkh:", "disk": "blkd:"}
"""Each medium's block-key stem (engine/kv_events.py names the media)."""
MEDIUM_OP = {"paged": "", "host": "h", "disk": "d"}
"""The medium's letter after an event op (S, R) and before a `held` member's `:`."""

# Shared Lua helpers, prepended to the scripts that need them.
_LUA_HELPERS = """
local STEMS = {[''] = 'blk:', h = 'blkh:', d = 'blkd:'}

-- A `held` member: '<hex>' (paged) or '<m>:<hex>' (m = h | d): its block key.
local function held_block_key(prefix, member)
  if string.sub(member, 2, 2) == ':' then
    return prefix .. STEMS[string.sub(member, 1, 1)] .. string.sub(member, 3)
  end
  return prefix .. 'blk:' .. member
end

local function clear_blocks(prefix, id)
  local held = prefix .. 'held:' .. id
  local hashes = redis.call('SMEMBERS', held)
  for _, h in ipairs(hashes) do
    redis.call('SREM', held_block_key(prefix, h), id)
  end
  redis.call('DEL', held)
  return #hashes
end

local function purge_instance(prefix, id)
  clear_blocks(prefix, id)
  redis.call('DEL', prefix .. 'seq:' .. id, prefix .. 'republish:' .. id)
end
"""

# ARGV: prefix, instance_id, seq, then ops: 'S'[m] n hash*n | 'R'[m] n hash*n | 'C', where
# the optional medium letter m is h (host tier) or d (disk tier); none = the paged cache.
# Returns {status, previous_seq}; previous_seq is -1 when there was none.
APPLY_EVENTS = (
    _LUA_HELPERS
    + """
local prefix, id, seq = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('EXISTS', prefix .. 'inst:' .. id) == 0 then
  return {'unknown_instance', -1}
end
local seq_key = prefix .. 'seq:' .. id
local last = redis.call('GET', seq_key)
local status = 'applied'
if last then
  last = tonumber(last)
  if seq <= last then
    return {'duplicate', last}
  end
  if seq > last + 1 then
    status = 'gap'
  end
else
  last = -1
end
redis.call('SET', seq_key, ARGV[3])
local held = prefix .. 'held:' .. id
local i = 4
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    clear_blocks(prefix, id)
    redis.call('DEL', prefix .. 'republish:' .. id)  -- a snapshot answers any ask
    i = i + 1
  else
    local n = tonumber(ARGV[i + 1])
    local m = string.sub(op, 2, 2)
    local stem, mark = STEMS[m], ''
    if m ~= '' then
      mark = m .. ':'
    end
    for j = i + 2, i + 1 + n do
      if string.sub(op, 1, 1) == 'S' then
        redis.call('SADD', prefix .. stem .. ARGV[j], id)
        redis.call('SADD', held, mark .. ARGV[j])
      else
        redis.call('SREM', prefix .. stem .. ARGV[j], id)
        redis.call('SREM', held, mark .. ARGV[j])
      end
    end
    i = i + 2 + n
  end
end
return {status, last}
"""
)

# KEYS: the prompt's paged block keys, in order. ARGV: prefix, then the same hashes as hex.
# Returns {{id, n_leading_blocks, n_paged, n_host, n_disk, ...}, {dead_id, ...}}: live holders
# of the first block (in any medium) with how far each one's run of hits reaches and how many
# of those blocks its fastest medium holding them is the paged cache, the host or the disk
# tier; and holders of the first block whose TTL expired.
LONGEST_PREFIX = """
local prefix = ARGV[1]
local function holders(i)
  local hex = ARGV[i + 1]
  return {KEYS[i], prefix .. 'blkh:' .. hex, prefix .. 'blkd:' .. hex}
end
local active, dead, result, counts, seen = {}, {}, {}, {}, {}
for m, key in ipairs(holders(1)) do
  for _, id in ipairs(redis.call('SMEMBERS', key)) do
    if not seen[id] then
      seen[id] = true
      if redis.call('EXISTS', prefix .. 'inst:' .. id) == 1 then
        table.insert(active, id)
        counts[id] = {0, 0, 0}
        counts[id][m] = 1  -- the first medium listing it is the fastest
      else
        table.insert(dead, id)
      end
    end
  end
end
local function finish(id, n)
  table.insert(result, id)
  table.insert(result, n)
  for m = 1, 3 do
    table.insert(result, counts[id][m])
  end
end
for i = 2, #KEYS do
  if #active == 0 then
    break
  end
  local media = {}
  for m, key in ipairs(holders(i)) do
    media[m] = redis.call('SMISMEMBER', key, unpack(active))
  end
  local still = {}
  for j, id in ipairs(active) do
    local best = nil
    for m = 1, 3 do
      if best == nil and media[m][j] == 1 then
        best = m
      end
    end
    if best then
      counts[id][best] = counts[id][best] + 1
      table.insert(still, id)
    else
      finish(id, i - 1)
    end
  end
  active = still
end
for _, id in ipairs(active) do
  finish(id, #KEYS)
end
return {result, dead}
"""

# ARGV: prefix, instance_id, fingerprint, address, ttl_ms, then field/value pairs of the
# registration hash. Returns {'ok', replaced_id, ...} or
# {'mismatch', other_id, other_fingerprint, other_scheme}; a mismatch writes nothing.
REGISTER = (
    _LUA_HELPERS
    + """
local prefix, id, fingerprint, address, ttl_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local members_key = prefix .. 'members'
local replaced = {}
for _, other in ipairs(redis.call('SMEMBERS', members_key)) do
  if other ~= id then
    local f = redis.call('HMGET', prefix .. 'inst:' .. other, 'fingerprint', 'scheme', 'address')
    if f[3] == address then
      -- A new process behind the same address: the old one is gone, and so is its cache.
      table.insert(replaced, other)
    elseif f[1] and f[1] ~= fingerprint then
      return {'mismatch', other, f[1], f[2]}
    end
  end
end
for _, other in ipairs(replaced) do
  redis.call('DEL', prefix .. 'inst:' .. other)
  purge_instance(prefix, other)
  redis.call('SREM', members_key, other)
end
local key = prefix .. 'inst:' .. id
-- A (re-)registration starts with an empty index slice; the engine then sends a snapshot.
purge_instance(prefix, id)
redis.call('DEL', key)
local fields = {}
for i = 6, #ARGV do
  table.insert(fields, ARGV[i])
end
redis.call('HSET', key, unpack(fields))
redis.call('PEXPIRE', key, ttl_ms)
redis.call('SADD', members_key, id)
local reply = {'ok'}
for _, r in ipairs(replaced) do
  table.insert(reply, r)
end
return reply
"""
)

# ARGV: prefix, instance_id, load_json, heartbeat_at. Returns 0 if not registered, 2 if a
# router asked the instance to re-publish its slice of the index (key `republish:<id>`), else 1.
HEARTBEAT = """
local key = ARGV[1] .. 'inst:' .. ARGV[2]
local ttl_ms = redis.call('HGET', key, 'ttl_ms')
if not ttl_ms then
  return 0
end
redis.call('HSET', key, 'load', ARGV[3], 'heartbeat_at', ARGV[4])
redis.call('PEXPIRE', key, ttl_ms)
if redis.call('EXISTS', ARGV[1] .. 'republish:' .. ARGV[2]) == 1 then
  return 2
end
return 1
"""

# ARGV: prefix, instance_id. Returns 1 if the instance was a member, else 0.
DEREGISTER = (
    _LUA_HELPERS
    + """
local prefix, id = ARGV[1], ARGV[2]
redis.call('DEL', prefix .. 'inst:' .. id)
purge_instance(prefix, id)
return redis.call('SREM', prefix .. 'members', id)
"""
)

# ARGV: prefix, then candidate ids (none: every member). Purges candidates whose
# registration expired, re-checking liveness here so a concurrent re-register is never undone.
# Returns the purged ids.
PURGE_DEAD = (
    _LUA_HELPERS
    + """
local prefix = ARGV[1]
local members_key = prefix .. 'members'
local candidates = {}
if #ARGV > 1 then
  for i = 2, #ARGV do
    table.insert(candidates, ARGV[i])
  end
else
  candidates = redis.call('SMEMBERS', members_key)
end
local purged = {}
for _, id in ipairs(candidates) do
  if redis.call('EXISTS', prefix .. 'inst:' .. id) == 0 then
    purge_instance(prefix, id)
    redis.call('SREM', members_key, id)
    table.insert(purged, id)
  end
end
return purged
"""
)

# ARGV: prefix. Returns {id, field, value, field, value, ...} per live member.
LIVE_INSTANCES = """
local prefix = ARGV[1]
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', prefix .. 'members')) do
  local fields = redis.call('HGETALL', prefix .. 'inst:' .. id)
  if #fields > 0 then
    table.insert(out, {id, fields})
  end
end
return out
"""
