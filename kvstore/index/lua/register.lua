-- Register a new incarnation of a storage node (ARGV[2] = '') or heartbeat one (its id).
-- KEYS: nodes zset, node hash, incarnation record, node numbers hash, number counter.
-- ARGV: node id, incarnation or '', ttl_ms, random hex suffix, replaces (the caller's
-- own previous incarnation, or ''), "address", address, field, value, ...
-- A new incarnation is "<Redis time in ms, 12 hex digits><random suffix>", its time
-- part strictly after the node id's recorded one: fixed width, so comparing two of one
-- node id as strings orders them by registration, and it never repeats,
-- not even after the index lost its data. The record (no TTL) names the node id's
-- current incarnation, so a stale one is told apart even after its registry entry
-- expired. A new incarnation at the holder's own address takes over at once: the caller
-- bound that address, so the holder is gone (a pod restarted on its port).
-- Each node id gets a number once (a counter), kept across incarnations: page records
-- name the node by it. Returns {1, incarnation, number}, or {0, reason, holder address}
-- when refused: 'in_use' (another incarnation of this node id is alive) or 'fenced'
-- (this incarnation was superseded or the index lost it).
local inc, ttl, replaces = ARGV[2], tonumber(ARGV[3]), ARGV[5]
local record = redis.call('GET', KEYS[3])
local now = now_ms()
if inc == '' then
  local holder = redis.call('HGET', KEYS[2], 'address')
  if record and record ~= replaces and holder and holder ~= ARGV[7] then
    return {0, 'in_use', holder}
  end
  -- strictly after the recorded incarnation, even within one millisecond
  local ts = now
  if record then ts = math.max(ts, (tonumber(string.sub(record, 1, 12), 16) or 0) + 1) end
  inc = string.format('%012x', ts) .. ARGV[4]
  redis.call('SET', KEYS[3], inc)
elseif record ~= inc then
  return {0, 'fenced', ''}
end
local number = redis.call('HGET', KEYS[4], ARGV[1])
if not number then
  number = redis.call('INCR', KEYS[5])
  redis.call('HSET', KEYS[4], ARGV[1], number)
end
local fields = {'inc', inc, 'no', number}
for i = 6, #ARGV, 2 do fields[#fields + 1] = ARGV[i]; fields[#fields + 1] = ARGV[i + 1] end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)  -- dead nodes' entries (live_nodes only reads)
return {1, inc, tonumber(number)}
