-- Heartbeat mirror of one node inside one namespace (so lookups stay single-slot).
-- KEYS: alive.  ARGV: node, epoch, ttl_ms (0 removes the node if the epoch matches).
local v = redis.call('HGET', KEYS[1], ARGV[1])
if tonumber(ARGV[3]) == 0 then
  if v and string.match(v, '^(%d+):') == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) end
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. (now_ms() + tonumber(ARGV[3])))
return 1
