-- Several token buckets in one call, in order (admission's user bucket, then its tenant's): each
-- refilled by elapsed time like token_bucket.lua, then `cost` tokens taken if there are enough. The
-- first bucket that refuses ends the call, and the buckets after it are not touched; the buckets
-- before it stay taken, as separate calls would leave them.
-- KEYS[i] bucket i; ARGV: cost (negative: tokens given back), then capacity_i and refill tokens per ms of bucket i.
-- Returns {0, 0} when every bucket gave, else {i, retry_after_ms} of the bucket that refused.
local cost = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i, key in ipairs(KEYS) do
  local capacity = tonumber(ARGV[2 * i])
  local rate = tonumber(ARGV[2 * i + 1])
  local b = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(b[1]) or capacity
  local ts = tonumber(b[2]) or now
  tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
  local allowed = tokens >= cost
  if allowed then
    tokens = math.min(capacity, tokens - cost)  -- a negative cost gives tokens back, up to the capacity
  end
  redis.call('HSET', key, 'tokens', tokens, 'ts', now)
  redis.call('PEXPIRE', key, math.ceil(capacity / rate) + 1000)
  if not allowed then
    return {i, math.ceil((cost - tokens) / rate)}
  end
end
return {0, 0}
