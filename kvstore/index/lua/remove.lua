-- Drop one node's entries of pages (eviction). With ARGV[1] = '1' a segment under a read
-- lease keeps them. ARGV: respect_lease, node number (4 bytes), key prefix, anchors
-- (hex, see common.lua), one byte per segment (its page count), page hashes (16 bytes
-- each, in segment order). Returns one character per page: '1' gone from the index (the
-- slot may be freed), '0' kept under a lease.
local respect, me, prefix, anchors, counts, hashes = ARGV[1] == '1', ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local out, done = {}, 0
for k = 1, #counts do
  local hex = string.sub(anchors, 32 * k - 31, 32 * k)
  local key = segment_key(prefix, hex)
  local m = string.byte(counts, k)
  if respect and redis.call('PTTL', lease_key(prefix, hex)) > 0 then
    out[#out + 1] = string.rep('0', m)
  else
    local drop = {}
    for j = 1, m do drop[string.sub(hashes, 16 * (done + j) - 15, 16 * (done + j)) .. me] = true end
    local value = redis.call('GET', key)
    if value then
      local keep = entries_except(value, drop)
      if #keep == 0 then
        redis.call('DEL', key)
      elseif #keep * ENTRY < #value then
        redis.call('SET', key, table.concat(keep), 'KEEPTTL')
      end
    end
    out[#out + 1] = string.rep('1', m)
  end
  done = done + m
end
return table.concat(out)
