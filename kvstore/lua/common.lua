-- Shared helpers, prepended to every namespace script by kvstore/index_scripts.py.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- An entry is "<state>|<epoch>|<slot>|<size>|<checksum>|<deadline_ms>";
-- state C = committed (visible), R = reserved (invisible, expires at deadline).
local function parse_entry(v)
  return string.match(v, '^(%a)|(%d+)|(%d+)|(%d+)|(%w+)|(%d+)$')
end
local function node_fields_left(key)
  local n = redis.call('HLEN', key)
  if redis.call('HEXISTS', key, '_lease') == 1 then n = n - 1 end
  return n
end
