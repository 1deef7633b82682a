-- Heartbeat mirror of one node inside one namespace (so lookups stay single-slot).
-- Called after the registry accepted the incarnation; an older one never overwrites a newer.
-- KEYS: alive.  ARGV: node, incarnation, ttl_ms (0 removes the node if it is this incarnation).
local v = redis.call('HGET', KEYS[1], ARGV[1])
if tonumber(ARGV[3]) == 0 then
  if v and parse_alive(v) == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) end
  return 0
end
local cur = parse_alive(v)
if cur and cur > ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. (now_ms() + tonumber(ARGV[3])))
return 1
