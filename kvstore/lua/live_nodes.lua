-- Live nodes: drop expired registry entries, return {id, field, value, ..., '', ...}.
-- KEYS: nodes zset.  ARGV: node key prefix.
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local f = redis.call('HGETALL', ARGV[1] .. id)
  if #f > 0 then
    out[#out + 1] = id
    for j = 1, #f do out[#out + 1] = f[j] end
    out[#out + 1] = ''
  end
end
return out
