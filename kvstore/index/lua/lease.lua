-- The read lease of segments a lookup read with plain GET and PTTL (a shard that holds
-- one segment of it, kvstore/index/lookups.py), held by lookup.lua's rule (hold_lease),
-- which checks the lease again: another reader may have renewed it since.
-- ARGV: lease_ms, renew_below_ms, ttl_ms, key prefix, the segments' anchors (hex, see
-- common.lua). Returns how many leases it renewed.
local lease_ms, renew_below_ms, ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local prefix, anchors = ARGV[4], ARGV[5]
local renewed = 0
for i = 1, #anchors, 32 do
  renewed = renewed + hold_lease(prefix, string.sub(anchors, i, i + 31), lease_ms, renew_below_ms, ttl_ms)
end
return renewed
