-- Phase one of a publish: mark pages as being written by one node (invisible to lookups).
-- KEYS: meta.  ARGV: prefix, node, epoch, ttl_ms, concatenated hex hashes.
-- Returns per page: 0 reserved now, 1 already committed by this node, 2 reserved by a put in flight.
local prefix, node, epoch, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local hexes = ARGV[5]
local now = now_ms()
local out = {}
for i = 0, #hexes / 32 - 1 do
  local key = prefix .. 'p:' .. string.sub(hexes, i * 32 + 1, i * 32 + 32)
  local v = redis.call('HGET', key, node)
  local st, e, _, _, _, deadline
  if v then st, e, _, _, _, deadline = parse_entry(v) end
  if st == 'C' and e == epoch then
    out[#out + 1] = 1
  elseif st == 'R' and e == epoch and tonumber(deadline) >= now then
    out[#out + 1] = 2
  else
    local fresh = redis.call('EXISTS', key) == 0
    redis.call('HSET', key, node, 'R|' .. epoch .. '|0|0|0|' .. (now + ttl))
    -- a key that only holds reservations disappears by itself if nobody commits
    if fresh then redis.call('PEXPIRE', key, ttl * 2) end
    out[#out + 1] = 0
  end
end
return out
