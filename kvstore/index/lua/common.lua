-- Shared helpers, prepended to every script by kvstore/index.py.
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
