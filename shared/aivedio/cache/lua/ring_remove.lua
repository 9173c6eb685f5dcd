-- Take a tenant out of a lane's ring: KEYS[1] list, KEYS[2] set.
if redis.call('SREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('LREM', KEYS[1], 0, ARGV[1])
  return 1
end
return 0
