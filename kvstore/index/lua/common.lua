-- Shared helpers, prepended to every script by kvstore/index/scripts.py.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- A segment (docs/key-format.md) is a string of 48-byte entries; an entry starts with
-- the page hash (16 bytes) and the node number (4 bytes): that pair names it.
local ENTRY = 48
-- The entries of `value` whose name is not in `drop`.
local function entries_except(value, drop)
  local keep = {}
  for p = 1, #value, ENTRY do
    local e = string.sub(value, p, p + ENTRY - 1)
    if not drop[string.sub(e, 1, 20)] then keep[#keep + 1] = e end
  end
  return keep
end
-- Segment scripts name their segments by anchor: ARGV carries the namespace's key
-- prefix ("kvs:<ns>:") and the anchors in hex, 32 characters each; KEYS[1] (the first
-- segment's key) only routes the call. Naming them in the call cost the client more
-- than the script costs the server (a lookup of 8,192 pages names 128 segments).
local function segment_key(prefix, hex) return prefix .. 's:{' .. hex .. '}' end
local function lease_key(prefix, hex) return prefix .. 'l:{' .. hex .. '}' end
-- The read-lease rule, its one definition: lookup.lua and lease.lua call it, and
-- kvstore/index/lookups.py (renew_below) sends the threshold. A segment a lookup read is
-- held off eviction (remove.lua) for lease_ms. The lease is renewed only when less than
-- renew_below_ms of it is left, so repeated lookups stay read-only, and a renewal pushes
-- the segment's expiry back to ttl_ms (when set): a segment read stays in the index.
local function hold_lease(prefix, hex, lease_ms, renew_below_ms, ttl_ms)
  local held = lease_key(prefix, hex)
  if redis.call('PTTL', held) >= renew_below_ms then return 0 end
  redis.call('SET', held, '1', 'PX', lease_ms)
  if ttl_ms > 0 then redis.call('PEXPIRE', segment_key(prefix, hex), ttl_ms) end
  return 1
end
