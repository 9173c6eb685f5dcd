-- Add a tenant to a lane's ring once: KEYS[1] list (the ring), KEYS[2] set (membership).
-- The ring is served from the head and a pick moves the tenant to the tail, so the tail is the
-- tenant served last (or still being served). A newcomer goes just before it: it waits for everyone
-- else once, not also for another turn of the tenant that was just served. O(1).
if redis.call('SADD', KEYS[2], ARGV[1]) == 1 then
  local last = redis.call('RPOP', KEYS[1])
  redis.call('RPUSH', KEYS[1], ARGV[1])
  if last then
    redis.call('RPUSH', KEYS[1], last)
  end
  return 1
end
return 0
