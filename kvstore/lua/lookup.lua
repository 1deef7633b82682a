-- Longest run of committed pages, from the first hash on, that have a live replica.
-- KEYS: meta, alive.  ARGV: prefix, concatenated 32-char hex hashes, lease_ms, grace_ms.
-- Returns {-1} for an unknown namespace, else {matched, locations}: locations is one
-- string, a line per matched page, each line "node|incarnation|slot|size|checksum" per
-- replica joined by ";" (one bulk string parses far faster than thousands of array items).
local prefix, hexes = ARGV[1], ARGV[2]
local lease_ms, grace_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local now = now_ms()
local alive = {}
local raw = redis.call('HGETALL', KEYS[2])
for i = 1, #raw, 2 do
  local inc, deadline = parse_alive(raw[i + 1])
  alive[raw[i]] = {inc, deadline}
end
local out = {}
local matched = 0
for i = 0, #hexes / 32 - 1 do
  local key = prefix .. 'p:' .. string.sub(hexes, i * 32 + 1, i * 32 + 32)
  local f = redis.call('HGETALL', key)
  local locs = {}
  local lease = 0
  for j = 1, #f, 2 do
    local node = f[j]
    if node == '_lease' then
      lease = tonumber(f[j + 1])
    else
      local inc, slot, size, crc = parse_entry(f[j + 1])
      local a = alive[node]
      if a and a[1] == inc and a[2] > now then
        locs[#locs + 1] = node .. '|' .. inc .. '|' .. slot .. '|' .. size .. '|' .. crc
      elseif (not a) or a[1] ~= inc or a[2] + grace_ms < now then
        redis.call('HDEL', key, node)   -- the node is gone or restarted: clean up lazily
      end
    end
  end
  if #locs == 0 then
    if #f > 0 and node_fields_left(key) == 0 then redis.call('DEL', key) end
    break
  end
  -- renew only when less than half the lease is left: repeated lookups stay read-only
  if lease_ms > 0 and lease < now + lease_ms / 2 then redis.call('HSET', key, '_lease', now + lease_ms) end
  matched = matched + 1
  out[matched] = table.concat(locs, ';')
end
return {matched, table.concat(out, '\n')}
