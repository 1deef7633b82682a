-- The segments of one lookup on this shard, with a read lease. A shard that holds just
-- one segment of a lookup is read with plain GET and PTTL instead (kvstore/index.py).
-- ARGV: lease_ms, ttl_ms, key prefix, the segments' anchors (hex, see common.lua), in
-- chain order.
-- Returns the values of the segments read, in chain order. Reading stops at the first
-- missing segment (the prefix ends there). A segment read gets a read lease (renewed only
-- when less than half of it is left, so repeated lookups stay read-only) and its expiry
-- pushed back.
local lease_ms, ttl_ms, prefix, anchors = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
local out = {}
for i = 1, #anchors, 32 do
  local hex = string.sub(anchors, i, i + 31)
  local key = segment_key(prefix, hex)
  local value = redis.call('GET', key)
  if not value then break end
  out[#out + 1] = value
  if lease_ms > 0 then
    local held = lease_key(prefix, hex)
    if redis.call('PTTL', held) < lease_ms / 2 then
      redis.call('SET', held, '1', 'PX', lease_ms)
      if ttl_ms > 0 then redis.call('PEXPIRE', key, ttl_ms) end
    end
  end
end
return out
