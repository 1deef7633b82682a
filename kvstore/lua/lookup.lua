-- The segments of one lookup on this shard, with a read lease.
-- KEYS: per segment, in chain order, its key then its lease key.  ARGV: lease_ms, ttl_ms.
-- Returns the segment values up to the first missing segment (the prefix ends there;
-- later segments are not read). The reader picks its pages' entries out of them.
-- A segment read gets a read lease (renewed only when less than half of it is left, so
-- repeated lookups stay read-only) and its expiry pushed back.
local lease_ms, ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for k = 1, #KEYS, 2 do
  local value = redis.call('GET', KEYS[k])
  if not value then break end
  out[#out + 1] = value
  if lease_ms > 0 and redis.call('PTTL', KEYS[k + 1]) < lease_ms / 2 then
    redis.call('SET', KEYS[k + 1], '1', 'PX', lease_ms)
    if ttl_ms > 0 then redis.call('PEXPIRE', KEYS[k], ttl_ms) end
  end
end
return out
