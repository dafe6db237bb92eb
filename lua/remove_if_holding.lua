-- Removes a field of a hash only while it holds the value given: an
-- ended denial of the tables of changes, removed by the instance that
-- read it, stays when somebody set it again meanwhile.
-- KEYS[1]: the hash. ARGV[1]: the field. ARGV[2]: the value read.
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
