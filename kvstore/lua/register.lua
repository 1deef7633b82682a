-- Register or heartbeat a storage node. ARGV[2] = 0 asks for a new incarnation (epoch).
-- KEYS: nodes zset, node hash, epoch counter.  ARGV: node id, epoch, ttl_ms, field, value, ...
local epoch = tonumber(ARGV[2])
if epoch == 0 then epoch = redis.call('INCR', KEYS[3]) end
local ttl = tonumber(ARGV[3])
local fields = {'epoch', epoch}
for i = 4, #ARGV, 2 do fields[#fields + 1] = ARGV[i]; fields[#fields + 1] = ARGV[i + 1] end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[1], now_ms() + ttl, ARGV[1])
return epoch
