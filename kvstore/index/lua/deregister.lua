-- Remove a node from the registry if it is still the given incarnation.
-- KEYS: nodes zset, node hash.  ARGV: node id, incarnation.
if redis.call('HGET', KEYS[2], 'inc') == ARGV[2] then
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0
