-- Drop one node's copy of pages (eviction). A page under a read lease is kept when
-- ARGV[4] is 1. KEYS: meta.  ARGV: prefix, node, epoch, respect_lease, hex hashes.
-- Returns per page: 1 gone from the index (the slot may be freed), 0 kept (leased).
local prefix, node, epoch, respect = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1'
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
    local st, e = parse_entry(v)
    if e == epoch or st ~= 'C' then
      redis.call('HDEL', key, node)
      if st == 'C' then dropped = dropped + 1 end
      if node_fields_left(key) == 0 then redis.call('DEL', key) end
    end
    out[#out + 1] = 1
  end
end
if dropped > 0 then redis.call('HINCRBY', KEYS[1], 'pages', -dropped) end
return out
