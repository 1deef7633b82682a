-- Make verified pages visible (a put's only index write): each page's entry replaces
-- the node's older one for that page (any incarnation). Idempotent.
-- KEYS: segment keys.  ARGV: ttl_ms, one byte per key (its entry count), the entries
-- (48 bytes each, in key order). Returns the entries written.
local ttl_ms, counts, entries = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local done = 0
for k = 1, #KEYS do
  local m = string.byte(counts, k)
  local fresh, drop = {}, {}
  for j = 1, m do
    local e = string.sub(entries, ENTRY * (done + j - 1) + 1, ENTRY * (done + j))
    fresh[j] = e
    drop[string.sub(e, 1, 20)] = true
  end
  local keep = entries_except(redis.call('GET', KEYS[k]) or '', drop)
  for j = 1, m do keep[#keep + 1] = fresh[j] end
  redis.call('SET', KEYS[k], table.concat(keep))
  if ttl_ms > 0 then redis.call('PEXPIRE', KEYS[k], ttl_ms) end
  done = done + m
end
return done
