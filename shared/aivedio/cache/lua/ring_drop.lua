-- Take a tenant out of both the set and every place in the list, whether or not the set had it
-- (a repair): KEYS[1] list, KEYS[2] set.
redis.call('SREM', KEYS[2], ARGV[1])
return redis.call('LREM', KEYS[1], 0, ARGV[1])
