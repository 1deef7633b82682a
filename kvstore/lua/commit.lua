-- Make verified pages visible (a put's only index write). Idempotent per (page, node,
-- incarnation). Fenced: fails when the namespace's liveness mirror already holds a
-- newer incarnation of this node id (incarnations order as strings, see register.lua).
-- KEYS: meta, alive.  ARGV: prefix, node, incarnation, node_ttl_ms, hex hashes, then one
-- "slot|size|checksum" per page. Returns the number of entries added.
local prefix, node, inc, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local hexes = ARGV[5]
local now = now_ms()
local cur = parse_alive(redis.call('HGET', KEYS[2], node))
if cur and cur > inc then
  return redis.error_reply('FENCED incarnation ' .. inc .. ' of node ' .. node .. ' is superseded by ' .. cur)
end
local count = read_count(KEYS[1], node, inc)
local added = 0
for i = 0, #hexes / 32 - 1 do
  local key = prefix .. 'p:' .. string.sub(hexes, i * 32 + 1, i * 32 + 32)
  local v = redis.call('HGET', key, node)
  if not v or parse_entry(v) ~= inc then added = added + 1 end
  redis.call('HSET', key, node, inc .. '|' .. ARGV[6 + i])
end
redis.call('HSET', KEYS[1], 'c:' .. node, inc .. '|' .. (count + added))
redis.call('HSET', KEYS[2], node, inc .. ':' .. (now + ttl))
return added
