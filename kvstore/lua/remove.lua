-- Drop one node's copy of pages (eviction). A page under a read lease is kept when
-- ARGV[4] is 1. KEYS: meta.  ARGV: prefix, node, incarnation, respect_lease, hex hashes.
-- Returns per page: 1 gone from the index (the slot may be freed), 0 kept (leased).
local prefix, node, inc, respect = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1'
local hexes = ARGV[5]
local now = now_ms()
local out, dropped = {}, 0
for i = 0, #hexes / 32 - 1 do
  local key = prefix .. 'p:' .. string.sub(hexes, i * 32 + 1, i * 32 + 32)
  local v = redis.call('HGET', key, node)
  if not v then
    out[#out + 1] = 1
  elseif respect and tonumber(redis.call('HGET', key, '_lease') or '0') > now then
    out[#out + 1] = 0
  else
    -- an entry of an older incarnation of this node is stale anyway: drop it too
    if parse_entry(v) == inc then dropped = dropped + 1 end
    redis.call('HDEL', key, node)
    if node_fields_left(key) == 0 then redis.call('DEL', key) end
    out[#out + 1] = 1
  end
end
if dropped > 0 then
  redis.call('HSET', KEYS[1], 'c:' .. node, inc .. '|' .. (read_count(KEYS[1], node, inc) - dropped))
end
return out
