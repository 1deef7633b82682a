-- The segments of one lookup on this shard, with a read lease. A shard that holds just
-- one segment of a lookup is read with plain GET and PTTL instead, and lease.lua renews
-- its lease when due (kvstore/index/lookups.py).
-- ARGV: lease_ms, renew_below_ms, ttl_ms, key prefix, the segments' anchors (hex, see
-- common.lua), in chain order.
-- Returns the values of the segments read, in chain order. Reading stops at the first
-- missing segment (the prefix ends there). A segment read gets a read lease (hold_lease).
local lease_ms, renew_below_ms, ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local prefix, anchors = ARGV[4], ARGV[5]
local out = {}
for i = 1, #anchors, 32 do
  local hex = string.sub(anchors, i, i + 31)
  local value = redis.call('GET', segment_key(prefix, hex))
  if not value then break end
  out[#out + 1] = value
  if lease_ms > 0 then hold_lease(prefix, hex, lease_ms, renew_below_ms, ttl_ms) end
end
return out
