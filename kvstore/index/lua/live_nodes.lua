-- Live nodes: those whose heartbeat deadline has not passed (nodes prune the expired
-- ones when they heartbeat, register.lua), as {id, field, value, ..., '', ...}.
-- Read-only, so clients and operators, whose users may only read the registry, run it
-- with EVALSHA_RO. KEYS: nodes zset.  ARGV: node key prefix.
local now = now_ms()
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  local f = redis.call('HGETALL', ARGV[1] .. id)
  if #f > 0 then
    out[#out + 1] = id
    for j = 1, #f do out[#out + 1] = f[j] end
    out[#out + 1] = ''
  end
end
return out
