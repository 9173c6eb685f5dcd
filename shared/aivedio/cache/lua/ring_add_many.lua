-- ring_add.lua for each of ARGV in turn, in one call (a lane's rebuild): KEYS[1] list, KEYS[2] set.
-- One script rather than a pipeline of ring_add calls, which a cluster client does not pipeline.
-- Returns how many were added (the others were on the ring already).
local added = 0
for _, tenant in ipairs(ARGV) do
  if redis.call('SADD', KEYS[2], tenant) == 1 then
    local last = redis.call('RPOP', KEYS[1])
    redis.call('RPUSH', KEYS[1], tenant)
    if last then
      redis.call('RPUSH', KEYS[1], last)
    end
    added = added + 1
  end
end
return added
