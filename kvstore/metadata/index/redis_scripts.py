"""Lua scripts of the Redis metadata index: each multi-key mutation runs atomically in Redis.

Loaded by `RedisIndex` (kvstore/metadata/index/redis_index.py) in each metadata-service replica.
ARGV[1] is always the key prefix and KEYS[1] is P:seq (routes the call on a cluster); scripts
that check a lease share `_COMMON`'s check_lease().
"""

_COMMON = r"""
local P = ARGV[1]
local function bump(hash, field, by)
  if redis.call("HINCRBY", hash, field, by) <= 0 then redis.call("HDEL", hash, field) end
end
local function emit(maxlen, kind, tenant, key, node, tier)
  local seq = redis.call("INCR", P .. ":seq")
  redis.call("XADD", P .. ":ev", "MAXLEN", maxlen, string.format("0-%d", seq),
    "k", kind, "t", tenant, "key", key, "n", node, "tier", tier)
end
local function records(blob)  -- flat: node, tier, size, checksum, node, ...
  local out, pos = {}, 1
  while pos <= #blob do
    local stop = string.find(blob, "\0", pos, true)
    out[#out + 1] = string.sub(blob, pos, stop - 1)
    pos = stop + 1
  end
  return out
end
local function holds(blob, node, tier)
  local r = records(blob)
  for i = 1, #r, 4 do if r[i] == node and r[i + 1] == tier then return true end end
  return false
end
local function forget(maxlen, node, tenant, key, tier)
  local hkey, kept = P .. ":h:" .. tenant .. "\0" .. key, {}
  local r = records(redis.call("GET", hkey) or "")
  for i = 1, #r, 4 do
    if r[i] ~= node or r[i + 1] ~= tier then kept[#kept + 1] = table.concat(r, "\0", i, i + 3) end
  end
  if #kept == 0 then
    redis.call("DEL", hkey)
    bump(P .. ":tenants", tenant, -1)
  else
    redis.call("SET", hkey, table.concat(kept, "\0") .. "\0")
  end
  bump(P .. ":tiers", tier, -1)
  bump(P .. ":ncount:" .. node, tier, -1)
  emit(maxlen, "removed", tenant, key, node, tier)
end
local function drop_node(maxlen, node)
  local held = P .. ":held:" .. node
  local members = redis.call("SMEMBERS", held)
  for _, m in ipairs(members) do
    local a = string.find(m, "\0", 1, true)
    local b = string.find(m, "\0", a + 1, true)
    forget(maxlen, node, string.sub(m, a + 1, b - 1), string.sub(m, b + 1), string.sub(m, 1, a - 1))
  end
  redis.call("DEL", held, P .. ":node:" .. node, P .. ":ncount:" .. node)
  redis.call("ZREM", P .. ":exp", node)
  return #members
end
-- ARGV: P, now, maxlen, node, lease; nil when the lease is live, else a status reply
local function check_lease()
  local node, now = ARGV[4], tonumber(ARGV[2])
  local current = redis.call("HGET", P .. ":node:" .. node, "lease")
  if not current then return {"unknown"} end
  if current ~= ARGV[5] then return {"stale"} end
  if tonumber(redis.call("ZSCORE", P .. ":exp", node)) <= now then
    drop_node(ARGV[3], node)
    return {"expired"}
  end
  return nil
end
"""

_REGISTER = r"""
local P, node, lease = ARGV[1], ARGV[2], ARGV[6]
redis.call("HSET", P .. ":node:" .. node, "lease", lease, "ttl", ARGV[4], "info", ARGV[5])
redis.call("ZADD", P .. ":exp", ARGV[3], node)
return 1
"""

_HEARTBEAT = r"""
local failed = check_lease()
if failed then return failed end
local nkey = P .. ":node:" .. ARGV[4]
local ttl, info = unpack(redis.call("HMGET", nkey, "ttl", "info"))
redis.call("ZADD", P .. ":exp", tonumber(ARGV[2]) + tonumber(ttl) / 1000, ARGV[4])
return {"ok", ttl, info, redis.call("ZSCORE", P .. ":exp", ARGV[4])}
"""

_DEREGISTER = r"""
local failed = check_lease()
if failed then return failed end
return {"ok", drop_node(ARGV[3], ARGV[4])}
"""

_EXPIRE = r"""
local score = redis.call("ZSCORE", P .. ":exp", ARGV[4])
if not score or tonumber(score) > tonumber(ARGV[2]) then return -1 end
return drop_node(ARGV[3], ARGV[4])
"""

# ARGV: P, now, maxlen, node, lease, tenant, quota, then (key, tier, size, checksum) quads
_PUBLISH = r"""
local failed = check_lease()
if failed then return failed end
local node, tenant, quota = ARGV[4], ARGV[6], tonumber(ARGV[7])
local blobs, fresh, order, new_keys = {}, {}, {}, 0
for i = 8, #ARGV, 4 do
  local key, tier = ARGV[i], ARGV[i + 1]
  local hkey = P .. ":h:" .. tenant .. "\0" .. key
  if blobs[hkey] == nil then
    blobs[hkey], fresh[hkey] = redis.call("GET", hkey) or "", {}
    if blobs[hkey] == "" then new_keys = new_keys + 1 end
  end
  if fresh[hkey][tier] == nil and not holds(blobs[hkey], node, tier) then
    order[#order + 1] = {hkey, key, tier}
  end
  fresh[hkey][tier] = ARGV[i + 2] .. "\0" .. ARGV[i + 3] .. "\0"
end
local held = tonumber(redis.call("HGET", P .. ":tenants", tenant) or "0")
if quota > 0 and held + new_keys > quota then return {"quota", held, new_keys} end
for _, item in ipairs(order) do
  local hkey, key, tier = unpack(item)
  if blobs[hkey] == "" then bump(P .. ":tenants", tenant, 1) end
  blobs[hkey] = blobs[hkey] .. node .. "\0" .. tier .. "\0" .. fresh[hkey][tier]
  redis.call("SET", hkey, blobs[hkey])
  redis.call("SADD", P .. ":held:" .. node, tier .. "\0" .. tenant .. "\0" .. key)
  bump(P .. ":tiers", tier, 1)
  bump(P .. ":ncount:" .. node, tier, 1)
  emit(ARGV[3], "stored", tenant, key, node, tier)
end
return {"ok", #order}
"""

# ARGV: P, now, maxlen, node, lease, tenant, then (key, tier) pairs
_UNPUBLISH = r"""
local failed = check_lease()
if failed then return failed end
local node, tenant, gone = ARGV[4], ARGV[6], 0
for i = 7, #ARGV, 2 do
  local member = ARGV[i + 1] .. "\0" .. tenant .. "\0" .. ARGV[i]
  if redis.call("SREM", P .. ":held:" .. node, member) == 1 then
    forget(ARGV[3], node, tenant, ARGV[i], ARGV[i + 1])
    gone = gone + 1
  end
end
return {"ok", gone}
"""

# ARGV: P, min score ("(now" for live nodes, "-inf" for all), "stats" for counters. Read-only.
_NODES = r"""
local P, out = ARGV[1], {}
local ids = redis.call("ZRANGEBYSCORE", P .. ":exp", ARGV[2], "+inf", "WITHSCORES")
for i = 1, #ids, 2 do
  local fields = redis.call("HMGET", P .. ":node:" .. ids[i], "lease", "ttl", "info")
  out[#out + 1] = {ids[i], ids[i + 1], fields[1], fields[2], fields[3],
    redis.call("HGETALL", P .. ":ncount:" .. ids[i])}
end
if ARGV[3] ~= "stats" then return {out, {}, "0"} end
return {out, redis.call("HGETALL", P .. ":tenants"), redis.call("GET", P .. ":seq") or "0"}
"""

# ARGV: P, cursor, MATCH pattern, COUNT. Read-only: one SCAN page with each key's holder records.
_SCAN = r"""
local page = redis.call("SCAN", ARGV[2], "MATCH", ARGV[3], "COUNT", ARGV[4])
local blobs = {}
if #page[2] > 0 then blobs = redis.call("MGET", unpack(page[2])) end
return {page[1], page[2], blobs}
"""

# ARGV: P, a fresh random incarnation, kept only when P:inc is missing (a new or emptied index)
_INCARNATION = r"""
local current = redis.call("GET", ARGV[1] .. ":inc")
if current then return current end
redis.call("SET", ARGV[1] .. ":inc", ARGV[2])
return ARGV[2]
"""

_BODIES = {
    "register": _REGISTER,
    "heartbeat": _HEARTBEAT,
    "deregister": _DEREGISTER,
    "expire": _EXPIRE,
    "publish": _PUBLISH,
    "unpublish": _UNPUBLISH,
    "nodes": _NODES,
    "scan": _SCAN,
    "incarnation": _INCARNATION,
}
WRITES = {"register", "heartbeat", "deregister", "expire", "publish", "unpublish"}
_CHECKS_LEASE = {"heartbeat", "deregister", "expire", "publish", "unpublish"}
SCRIPTS = {
    name: (_COMMON + body if name in _CHECKS_LEASE else body) for name, body in _BODIES.items()
}
