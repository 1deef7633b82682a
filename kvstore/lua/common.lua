-- Shared helpers, prepended to every script by kvstore/index.py.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- A page entry (field = node id) is "<incarnation>|<slot>|<size>|<checksum>";
-- it exists only once the node has verified the bytes (phase two of a put).
local function parse_entry(v)
  return string.match(v, '^(%x+)|(%d+)|(%d+)|(%w+)$')
end
-- A liveness mirror value (alive hash, field = node id) is "<incarnation>:<deadline_ms>".
local function parse_alive(v)
  local inc, deadline = string.match(v or '', '^(%x+):(%d+)$')
  return inc, tonumber(deadline or '0')
end
-- A node's page count in a namespace (meta field "c:<node>") is "<incarnation>|<count>":
-- counts of an older incarnation are void.
local function read_count(meta, node, inc)
  local v = redis.call('HGET', meta, 'c:' .. node)
  if not v then return 0 end
  local ci, cn = string.match(v, '^(%x+)|(%-?%d+)$')
  if ci ~= inc then return 0 end
  return tonumber(cn)
end
local function node_fields_left(key)
  local n = redis.call('HLEN', key)
  if redis.call('HEXISTS', key, '_lease') == 1 then n = n - 1 end
  return n
end
