-- Exact sliding-window log for one or more policies, all-or-nothing.
--
-- KEYS, per policy i (1-based): KEYS[2i-1] is the log, a sorted set of
--   admitted requests scored by their time in microseconds, each member
--   "<time>:<seq>:<cost>"; KEYS[2i] is a hash with the running cost `sum`
--   of the log and the member sequence `seq`.
-- ARGV[1]: the time in microseconds, or "" to read the server's TIME
--   (the empty form is the only one production uses).
-- ARGV, per policy i: ARGV[3i-1] limit, ARGV[3i] window in microseconds,
--   ARGV[3i+1] cost.
--
-- Returns, per policy, four integers: admitted (1 or 0, the same for every
-- policy), remaining units, reset in microseconds, and retry-after in
-- microseconds (-1 when the policy fits the request).
--
-- A request is counted while now - window < time; it leaves the window at
-- time + window. All arithmetic stays in integers below 2^53.

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end

local function member_cost(member)
  return tonumber(string.match(member, ':(%d+)$'))
end

local policies = #KEYS / 2
local state = {}
local all_fit = true

for i = 1, policies do
  local log, meta = KEYS[2 * i - 1], KEYS[2 * i]
  local limit = tonumber(ARGV[3 * i - 1])
  local window = tonumber(ARGV[3 * i])
  local cost = tonumber(ARGV[3 * i + 1])
  local cutoff = string.format('%d', now - window)

  local sum = tonumber(redis.call('HGET', meta, 'sum'))
  if sum == nil then
    -- No running sum (first use, or the hash was lost): rebuild it.
    redis.call('ZREMRANGEBYSCORE', log, '-inf', cutoff)
    sum = 0
    for _, member in ipairs(redis.call('ZRANGE', log, 0, -1)) do
      sum = sum + member_cost(member)
    end
  else
    local expired = redis.call('ZRANGEBYSCORE', log, '-inf', cutoff)
    if #expired > 0 then
      for _, member in ipairs(expired) do
        sum = sum - member_cost(member)
      end
      redis.call('ZREMRANGEBYSCORE', log, '-inf', cutoff)
      redis.call('HSET', meta, 'sum', sum)
    end
  end

  local fits = sum + cost <= limit
  all_fit = all_fit and fits
  state[i] = { log = log, meta = meta, limit = limit, window = window, cost = cost, sum = sum, fits = fits }
end

local function oldest_reset(s)
  local oldest = redis.call('ZRANGE', s.log, 0, 0, 'WITHSCORES')
  if #oldest == 0 then
    return 0
  end
  return tonumber(oldest[2]) + s.window - now
end

local result = {}
for i = 1, policies do
  local s = state[i]
  local retry = -1
  if all_fit then
    local seq = redis.call('HINCRBY', s.meta, 'seq', 1)
    local member = string.format('%d:%d:%d', now, seq, s.cost)
    redis.call('ZADD', s.log, string.format('%d', now), member)
    s.sum = s.sum + s.cost
    redis.call('HSET', s.meta, 'sum', s.sum)
    local ttl = math.floor(s.window / 1000) + 1
    redis.call('PEXPIRE', s.log, ttl)
    redis.call('PEXPIRE', s.meta, ttl)
  elseif not s.fits then
    -- Walk the oldest entries until enough cost has left the window.
    local need = s.sum + s.cost - s.limit
    local entries = redis.call('ZRANGE', s.log, 0, need - 1, 'WITHSCORES')
    local freed = 0
    for j = 1, #entries, 2 do
      freed = freed + member_cost(entries[j])
      if freed >= need then
        retry = tonumber(entries[j + 1]) + s.window - now
        break
      end
    end
  end
  local remaining = s.limit - s.sum
  if remaining < 0 then
    remaining = 0
  end
  result[4 * i - 3] = all_fit and 1 or 0
  result[4 * i - 2] = remaining
  result[4 * i - 1] = oldest_reset(s)
  result[4 * i] = retry
end
return result
