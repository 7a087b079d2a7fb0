"""Lua scripts of the sharded Redis index (redis_shards.py): each runs in one hash tag.

Three kinds of tag: a shard (holdings, counters, its own event outbox), the membership tag
(leases, the live set, nodes being purged) and the events tag (the one event stream every
watcher reads, fed from the shards' outboxes). ARGV[1] is always the tag; KEYS[1] routes it.
"""

from kvstore.metadata.index.redis_scripts import _COMMON as _LEGACY

# Shard tag T: :seq / :ev (the outbox: one entry per script call, its events as netstrings),
# :h:<tenant>\0<key> (holder records; this shard is the key's home: counted, evented),
# :r:<tenant>\0<key> (a depth-0 key's copy kept on every other shard: neither counted nor
# evented), :held:<node> / :rep:<node> (sets of tier\0tenant\0key), :ncount:<node>, :tiers,
# :tenants, :epoch:<node> (the newest registration that wrote here), :gone:<node> (the lease
# whose holdings were purged here: refused from then on).
_SHARD_COMMON = (
    _LEGACY.split("local function forget", 1)[0]
    + r"""
local OUT = {}  -- this call's events, appended to the outbox as one entry by flush()
local function emit(maxlen, kind, tenant, key, node, tier)
  for _, field in ipairs({kind, tenant, key, node, tier}) do  -- netstrings: "<len>:<bytes>"
    OUT[#OUT + 1] = #field .. ":" .. field
  end
end
local function flush(maxlen)
  if #OUT == 0 then return end
  local seq = redis.call("INCR", P .. ":seq")
  redis.call("XADD", P .. ":ev", "MAXLEN", maxlen, string.format("0-%d", seq),
    "n", #OUT / 5, "e", table.concat(OUT))
end
local function forget(maxlen, node, tenant, key, tier, home)
  local hkey, kept = P .. (home and ":h:" or ":r:") .. tenant .. "\0" .. key, {}
  local r = records(redis.call("GET", hkey) or "")
  for i = 1, #r, 4 do
    if r[i] ~= node or r[i + 1] ~= tier then kept[#kept + 1] = table.concat(r, "\0", i, i + 3) end
  end
  if #kept == 0 then
    redis.call("DEL", hkey)
    if home then bump(P .. ":tenants", tenant, -1) end
  else
    redis.call("SET", hkey, table.concat(kept, "\0") .. "\0")
  end
  if home then
    bump(P .. ":tiers", tier, -1)
    bump(P .. ":ncount:" .. node, tier, -1)
    emit(maxlen, "removed", tenant, key, node, tier)
  end
end
local function forget_member(maxlen, node, m, home)
  local a = string.find(m, "\0", 1, true)
  local b = string.find(m, "\0", a + 1, true)
  forget(maxlen, node, string.sub(m, a + 1, b - 1), string.sub(m, b + 1), string.sub(m, 1, a - 1),
    home)
end
"""
)

# ARGV: T, maxlen, node, lease, epoch, tenant, then (key, tier, size, checksum, home 1|0)
_PUBLISH = r"""
local node, lease, tenant = ARGV[3], ARGV[4], ARGV[6]
if redis.call("GET", P .. ":gone:" .. node) == lease then return {"expired"} end
if tonumber(redis.call("GET", P .. ":epoch:" .. node) or "0") < tonumber(ARGV[5]) then
  redis.call("SET", P .. ":epoch:" .. node, ARGV[5])
end
local blobs, fresh, order, added = {}, {}, {}, 0
for i = 7, #ARGV, 5 do
  local key, tier, home = ARGV[i], ARGV[i + 1], ARGV[i + 4] == "1"
  local hkey = P .. (home and ":h:" or ":r:") .. tenant .. "\0" .. key
  if blobs[hkey] == nil then blobs[hkey], fresh[hkey] = redis.call("GET", hkey) or "", {} end
  if fresh[hkey][tier] == nil and not holds(blobs[hkey], node, tier) then
    order[#order + 1] = {hkey, key, tier, home}
  end
  fresh[hkey][tier] = ARGV[i + 2] .. "\0" .. ARGV[i + 3] .. "\0"
end
for _, item in ipairs(order) do
  local hkey, key, tier, home = unpack(item)
  if home and blobs[hkey] == "" then bump(P .. ":tenants", tenant, 1) end
  blobs[hkey] = blobs[hkey] .. node .. "\0" .. tier .. "\0" .. fresh[hkey][tier]
  redis.call("SET", hkey, blobs[hkey])
  local set = P .. (home and ":held:" or ":rep:") .. node
  redis.call("SADD", set, tier .. "\0" .. tenant .. "\0" .. key)
  if home then
    added = added + 1
    bump(P .. ":tiers", tier, 1)
    bump(P .. ":ncount:" .. node, tier, 1)
    emit(ARGV[2], "stored", tenant, key, node, tier)
  end
end
flush(ARGV[2])
return {"ok", added}
"""

# ARGV: T, tenant, then home keys. Read-only: (keys the tenant holds here, keys not yet held)
_NEW_KEYS = r"""
local P, stem, new = ARGV[1], ARGV[1] .. ":h:" .. ARGV[2] .. "\0", 0
for i = 3, #ARGV do if redis.call("EXISTS", stem .. ARGV[i]) == 0 then new = new + 1 end end
return {tonumber(redis.call("HGET", P .. ":tenants", ARGV[2]) or "0"), new}
"""

# ARGV: T, maxlen, node, tenant, then (key, tier, home 1|0) triples
_UNPUBLISH = r"""
local node, tenant, gone = ARGV[3], ARGV[4], 0
for i = 5, #ARGV, 3 do
  local home = ARGV[i + 2] == "1"
  local member = ARGV[i + 1] .. "\0" .. tenant .. "\0" .. ARGV[i]
  if redis.call("SREM", P .. (home and ":held:" or ":rep:") .. node, member) == 1 then
    forget(ARGV[2], node, tenant, ARGV[i], ARGV[i + 1], home)
    if home then gone = gone + 1 end
  end
end
flush(ARGV[2])
return gone
"""

# ARGV: T, maxlen, node, lease, epoch, batch. Purges up to `batch` holdings of the node's
# registration `epoch` (and older ones); once a newer registration wrote here the purge is done
# (the holdings are the new lease's). Returns {home holdings removed, holdings left}.
_PURGE = r"""
local node, lease, batch = ARGV[3], ARGV[4], tonumber(ARGV[6])
if tonumber(redis.call("GET", P .. ":epoch:" .. node) or "0") > tonumber(ARGV[5]) then
  return {0, 0}
end
redis.call("SET", P .. ":gone:" .. node, lease, "EX", 86400)
local held, rep, removed = P .. ":held:" .. node, P .. ":rep:" .. node, 0
for _, m in ipairs(redis.call("SPOP", held, batch)) do
  forget_member(ARGV[2], node, m, true)
  removed = removed + 1
end
if removed < batch then
  for _, m in ipairs(redis.call("SPOP", rep, batch - removed)) do
    forget_member(ARGV[2], node, m, false)
  end
end
flush(ARGV[2])
local left = redis.call("SCARD", held) + redis.call("SCARD", rep)
if left == 0 then redis.call("DEL", P .. ":ncount:" .. node) end
return {removed, left}
"""

# ARGV: T, then node ids. Read-only: {tiers, tenants, {ncount per node id}}
_SHARD_STATS = r"""
local P, counts = ARGV[1], {}
for i = 2, #ARGV do counts[#counts + 1] = redis.call("HGETALL", P .. ":ncount:" .. ARGV[i]) end
return {redis.call("HGETALL", P .. ":tiers"), redis.call("HGETALL", P .. ":tenants"), counts}
"""

# Membership tag M: :exp (zset node -> expires_at), :node:<id> (hash lease, ttl, info, epoch:
# the registration's number, from :epoch), :purging (hash node -> "lease epoch" whose holdings
# are being purged), :unanchored (a flag: some entry was published without its chain's anchor;
# lookups then also read keys' own shards).
_MEMBER_COMMON = r"""
local P = ARGV[1]
local function same_layout(shards)  -- false: the index moved to another shard count
  return redis.call("GET", P .. ":layout") == shards
end
local function retire(node)  -- the node's "lease epoch", now being purged
  local nkey = P .. ":node:" .. node
  local lease, epoch = unpack(redis.call("HMGET", nkey, "lease", "epoch"))
  local purging = lease .. " " .. (epoch or "0")
  redis.call("ZREM", P .. ":exp", node)
  redis.call("DEL", nkey)
  redis.call("HSET", P .. ":purging", node, purging)
  return purging
end
"""

# ARGV: M, node, expires_at, ttl, info, lease, S. The registration's epoch ({"layout"}: the
# index has another shard count than this replica's).
_REGISTER = r"""
local node = ARGV[2]
if not same_layout(ARGV[7]) then return {"layout"} end
local epoch = redis.call("INCR", P .. ":epoch")
redis.call("HSET", P .. ":node:" .. node, "lease", ARGV[6], "ttl", ARGV[4], "info", ARGV[5],
  "epoch", epoch)
redis.call("ZADD", P .. ":exp", ARGV[3], node)
return epoch
"""

# ARGV: M, now, node, lease, extend 1|0, S. {"ok", ttl, info, expires_at, epoch} or a status
# ({"expired", "lease epoch"} once the expired node is marked for its purge).
_LEASE = r"""
local now, node, lease = tonumber(ARGV[2]), ARGV[3], ARGV[4]
if not same_layout(ARGV[6]) then return {"layout"} end
local nkey = P .. ":node:" .. node
local current, ttl, info, epoch = unpack(redis.call("HMGET", nkey, "lease", "ttl", "info", "epoch"))
if not current then return {"unknown"} end
if current ~= lease then return {"stale"} end
if tonumber(redis.call("ZSCORE", P .. ":exp", node)) <= now then
  return {"expired", retire(node)}
end
if ARGV[5] == "1" then redis.call("ZADD", P .. ":exp", now + tonumber(ttl) / 1000, node) end
return {"ok", ttl, info, redis.call("ZSCORE", P .. ":exp", node), epoch or "0"}
"""

# ARGV: M, node, lease. Deregistration: "lease epoch" to purge, or false for another lease.
_RETIRE = r"""
if redis.call("HGET", P .. ":node:" .. ARGV[2], "lease") ~= ARGV[3] then return false end
return retire(ARGV[2])
"""

# ARGV: M, now, node. The node's "lease epoch" when it expired by `now`, else false.
_EXPIRE = r"""
local score = redis.call("ZSCORE", P .. ":exp", ARGV[3])
if not score or tonumber(score) > tonumber(ARGV[2]) then return false end
return retire(ARGV[3])
"""

# ARGV: M, S. Adopts shard count S; returns the one before (0: none). Moving to another S
# revokes every lease: agents register again and republish into the new layout.
_LAYOUT = r"""
local old = tonumber(redis.call("GET", P .. ":layout") or "0")
if old == tonumber(ARGV[2]) then return old end
if old ~= 0 then
  for _, id in ipairs(redis.call("ZRANGE", P .. ":exp", 0, -1)) do
    redis.call("DEL", P .. ":node:" .. id)
  end
  redis.call("DEL", P .. ":exp", P .. ":purging", P .. ":unanchored")
end
redis.call("SET", P .. ":layout", ARGV[2])
return old
"""

# ARGV: M, node, "lease epoch": the purge of that registration is complete on every shard.
_PURGED = r"""
if redis.call("HGET", ARGV[1] .. ":purging", ARGV[2]) == ARGV[3] then
  redis.call("HDEL", ARGV[1] .. ":purging", ARGV[2])
end
return 1
"""

# ARGV: M, min score. Read-only: {{id, expires_at, lease, ttl, info}...}, unanchored flag
_MEMBERS = r"""
local P, out = ARGV[1], {}
local ids = redis.call("ZRANGEBYSCORE", P .. ":exp", ARGV[2], "+inf", "WITHSCORES")
for i = 1, #ids, 2 do
  local fields = redis.call("HMGET", P .. ":node:" .. ids[i], "lease", "ttl", "info")
  out[#out + 1] = {ids[i], ids[i + 1], fields[1], fields[2], fields[3]}
end
return {out, redis.call("GET", P .. ":unanchored") or "0"}
"""

# Events tag E: :seq, :ev (the stream watchers read: an entry per relayed outbox entry, its id
# 0-<seq of its last event>, fields n (events) and e (their netstrings, as the shard wrote
# them)), :relayed (hash shard -> the newest outbox entry copied), :inc. ARGV: E, max events
# kept, shard, the shard's :seq now, its master's replication id, then (outbox seq, n, e)
# triples read from its outbox, oldest first. Copies each once, in order. An outbox that lost
# entries before they were copied, or a shard whose master changed (a failover may have lost
# its newest writes, whose seqs are then issued again) or whose :seq went back, empties the
# stream, so every reader finds a gap and resyncs (from a snapshot, which reads the shard as
# it is), and copies from the shard's seq now on. Returns the shard's cursor.
_RELAY = r"""
local E, keep, shard = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local cursor = tonumber(redis.call("HGET", E .. ":relayed", shard) or "0")
local function lost()  -- a seq no event takes: readers at the head find the gap too
  redis.call("DEL", E .. ":ev")
  redis.call("INCR", E .. ":seq")
end
local replid = redis.call("HGET", E .. ":replids", shard)
if tonumber(ARGV[4]) < cursor or (replid and replid ~= ARGV[5]) then
  lost()
  cursor = tonumber(ARGV[4])
end
redis.call("HSET", E .. ":replids", shard, ARGV[5])
for i = 6, #ARGV, 3 do
  local shard_seq = tonumber(ARGV[i])
  if shard_seq > cursor then
    if shard_seq > cursor + 1 then lost() end
    local seq = redis.call("INCRBY", E .. ":seq", ARGV[i + 1])
    redis.call("XADD", E .. ":ev", "MINID", string.format("0-%d", math.max(seq - keep, 0)),
      string.format("0-%d", seq), "n", ARGV[i + 1], "e", ARGV[i + 2])
    cursor = shard_seq
  end
end
redis.call("HSET", E .. ":relayed", shard, cursor)
return cursor
"""

_SHARD = {
    "publish": _PUBLISH,
    "unpublish": _UNPUBLISH,
    "purge": _PURGE,
}
SHARD_SCRIPTS = {name: _SHARD_COMMON + body for name, body in _SHARD.items()}
SHARD_SCRIPTS |= {
    "new_keys": _NEW_KEYS,
    "shard_stats": _SHARD_STATS,
    "register": _MEMBER_COMMON + _REGISTER,
    "lease": _MEMBER_COMMON + _LEASE,
    "retire": _MEMBER_COMMON + _RETIRE,
    "layout": _MEMBER_COMMON + _LAYOUT,
    "expire": _MEMBER_COMMON + _EXPIRE,
    "purged": _PURGED,
    "members": _MEMBERS,
    "relay": _RELAY,
}
SHARD_WRITES = {"publish", "unpublish", "purge", "register", "lease", "retire", "expire"}
SHARD_WRITES |= {"purged", "relay", "layout"}
