-- Make verified pages visible (a put's only index write): each page's entry replaces
-- the node's older one for that page (any incarnation). Idempotent.
-- ARGV: ttl_ms, key prefix, anchors (hex, see common.lua), one byte per segment (its
-- entry count), the entries (48 bytes each, in segment order). Returns the entries written.
local ttl_ms, prefix, anchors, counts, entries = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local done = 0
for k = 1, #counts do
  local key = segment_key(prefix, string.sub(anchors, 32 * k - 31, 32 * k))
  local m = string.byte(counts, k)
  local fresh, drop = {}, {}
  for j = 1, m do
    local e = string.sub(entries, ENTRY * (done + j - 1) + 1, ENTRY * (done + j))
    fresh[j] = e
    drop[string.sub(e, 1, 20)] = true
  end
  local keep = entries_except(redis.call('GET', key) or '', drop)
  for j = 1, m do keep[#keep + 1] = fresh[j] end
  redis.call('SET', key, table.concat(keep))
  if ttl_ms > 0 then redis.call('PEXPIRE', key, ttl_ms) end
  done = done + m
end
return done
