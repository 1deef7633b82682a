-- Phase two of a publish: make verified pages visible. Idempotent per (page, node, epoch).
-- KEYS: meta, alive.  ARGV: prefix, node, epoch, node_ttl_ms, hex hashes, then one
-- "slot|size|checksum" per page. Returns per page: 1 committed now, 0 already committed.
local prefix, node, epoch, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local hexes = ARGV[5]
local now = now_ms()
local out, added = {}, 0
for i = 0, #hexes / 32 - 1 do
  local key = prefix .. 'p:' .. string.sub(hexes, i * 32 + 1, i * 32 + 32)
  local v = redis.call('HGET', key, node)
  local st, e
  if v then st, e = parse_entry(v) end
  if st == 'C' and e == epoch then
    out[#out + 1] = 0
  else
    redis.call('HSET', key, node, 'C|' .. epoch .. '|' .. ARGV[6 + i] .. '|0')
    redis.call('PERSIST', key)
    if st ~= 'C' then added = added + 1 end
    out[#out + 1] = 1
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[1], 'pages', added) end
redis.call('HSET', KEYS[2], node, epoch .. ':' .. (now + ttl))
return out
