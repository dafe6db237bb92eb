#!lua
-- One request's rate-limit check: one or more policies, each with its own
-- algorithm, decided all-or-nothing in one atomic call.
--
-- The shebang above (Redis 7 and later) declares a script that writes and
-- may not run out of memory: under `maxmemory` Redis refuses the call
-- before it starts, so a full Redis answers an error (and the policy's
-- fail mode decides), never a write past its limit.
--
-- ARGV[1]: the time in microseconds, or "" to read the server's TIME (the
--   empty form is the only one production uses).
-- ARGV, per policy i (1-based): ARGV[4i-2] algorithm ("log", "counter" or
--   "fixed"), ARGV[4i-1] limit, ARGV[4i] window in microseconds,
--   ARGV[4i+1] cost.
-- KEYS, taken in policy order:
--   log:     a sorted set of admitted requests scored by their time in
--            microseconds, each member "<time>:<seq>:<cost>"; then a hash
--            with the log's running cost `sum` and member sequence `seq`.
--   counter: a hash with the current window id `w`, its count `c`, the
--            previous window's count `p` (windows in milliseconds) and `t`,
--            the latest time (µs) a request was counted at.
--   fixed:   a hash with the window id `w`, its count `c` and `t`.
--
-- The counters place `now` no earlier than `t`: a clock that steps back
-- (NTP, a failover to a skewed node) never takes a key back to an earlier
-- window, which would forget its count. Waits are still measured from the
-- real `now`.
--
-- Returns, per policy, four integers: admitted (1 or 0, the same for every
-- policy), remaining units, reset in microseconds, and retry-after in
-- microseconds (-1 when the policy fits the request).
--
-- Windows of the counters are aligned to the Unix epoch: window n covers
-- [n*W, (n+1)*W). All arithmetic stays in integers below 2^53, so Lua's
-- doubles are exact; the crate's policy validation guarantees it.

local now
-- Redis expires keys on its own clock. When the time is given instead, that
-- clock and `now` drift apart (a test's fake clock may stand still while
-- real time passes), so keys are kept a minute longer than their windows
-- need: expiry only collects garbage, it must never forget a live count.
local expiry_grace_ms = 0
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
  expiry_grace_ms = 60000
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end

local function expire(key, ms)
  redis.call('PEXPIRE', key, ms + expiry_grace_ms)
end

-- The time a key's window is placed at: `now`, or the key's latest counted
-- time `t` if the clock has stepped back since.
local function high_water(t)
  t = tonumber(t)
  if t ~= nil and t > now then
    return t
  end
  return now
end

-- floor(a / b) for a >= 0 and b > 0, exact where a / b in doubles may not be.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

---------------------------------------------------------------- sliding log

local function member_cost(member)
  return tonumber(string.match(member, ':(%d+)$'))
end

local log = {}

function log.prepare(s)
  local cutoff = string.format('%d', now - s.window)
  local sum = tonumber(redis.call('HGET', s.meta, 'sum'))
  if sum == nil then
    -- No running sum (first use, or the hash was lost): rebuild it.
    redis.call('ZREMRANGEBYSCORE', s.key, '-inf', cutoff)
    sum = 0
    for _, member in ipairs(redis.call('ZRANGE', s.key, 0, -1)) do
      sum = sum + member_cost(member)
    end
  else
    local expired = redis.call('ZRANGEBYSCORE', s.key, '-inf', cutoff)
    if #expired > 0 then
      for _, member in ipairs(expired) do
        sum = sum - member_cost(member)
      end
      redis.call('ZREMRANGEBYSCORE', s.key, '-inf', cutoff)
      redis.call('HSET', s.meta, 'sum', sum)
    end
  end
  s.sum = sum
  return sum + s.cost <= s.limit
end

function log.record(s)
  local seq = redis.call('HINCRBY', s.meta, 'seq', 1)
  local member = string.format('%d:%d:%d', now, seq, s.cost)
  redis.call('ZADD', s.key, string.format('%d', now), member)
  s.sum = s.sum + s.cost
  redis.call('HSET', s.meta, 'sum', s.sum)
  local ttl = math.floor(s.window / 1000) + 1
  expire(s.key, ttl)
  expire(s.meta, ttl)
end

function log.retry(s)
  -- Walk the oldest entries until enough cost has left the window.
  local need = s.sum + s.cost - s.limit
  local entries = redis.call('ZRANGE', s.key, 0, need - 1, 'WITHSCORES')
  local freed = 0
  for j = 1, #entries, 2 do
    freed = freed + member_cost(entries[j])
    if freed >= need then
      return tonumber(entries[j + 1]) + s.window - now
    end
  end
  return 0
end

function log.report(s)
  local remaining = s.limit - s.sum
  if remaining < 0 then
    remaining = 0
  end
  local reset = 0
  local oldest = redis.call('ZRANGE', s.key, 0, 0, 'WITHSCORES')
  if #oldest > 0 then
    reset = tonumber(oldest[2]) + s.window - now
  end
  return remaining, reset
end

------------------------------------------------------------ sliding counter

local counter = {}

function counter.prepare(s)
  local w = s.window / 1000
  local stored = redis.call('HMGET', s.key, 'w', 'c', 'p', 't')
  s.at = high_water(stored[4])
  local now_ms = idiv(s.at, 1000)
  local id = idiv(now_ms, w)
  local stored_id = tonumber(stored[1])
  local c, p = 0, 0
  if stored_id == id then
    c, p = tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
  elseif stored_id == id - 1 then
    p = tonumber(stored[2]) or 0
  end
  s.w, s.now_ms, s.id, s.elapsed, s.c, s.p = w, now_ms, id, now_ms - id * w, c, p
  return p * (w - s.elapsed) + (c + s.cost) * w <= s.limit * w
end

function counter.record(s)
  s.c = s.c + s.cost
  redis.call('HSET', s.key, 'w', s.id, 'c', s.c, 'p', s.p, 't', string.format('%d', s.at))
  -- The counts matter until the end of the next window (on Redis's own
  -- clock, which expires the key: the real `now`, not the high water).
  expire(s.key, (s.id + 2) * s.w - idiv(now, 1000) + 1)
end

-- The first millisecond at which `cost` units fit, if nothing more is
-- admitted meanwhile.
local function counter_fits_at(s, cost)
  local w = s.w
  local room = s.limit - s.c - cost
  if room >= 0 then
    if s.p * (w - s.elapsed) <= room * w then
      return s.now_ms
    end
    local elapsed = w - idiv(room * w, s.p)
    if elapsed < w then
      return s.id * w + elapsed
    end
  end
  -- In the next window, the current count becomes the previous one.
  local next_start = (s.id + 1) * w
  if s.c == 0 then
    return next_start
  end
  local elapsed = w - idiv((s.limit - cost) * w, s.c)
  if elapsed < 0 then
    elapsed = 0
  end
  if elapsed < w then
    return next_start + elapsed
  end
  return next_start + w
end

local function micros_until(at_ms)
  local micros = at_ms * 1000 - now
  if micros < 0 then
    return 0
  end
  return micros
end

function counter.retry(s)
  return micros_until(counter_fits_at(s, s.cost))
end

function counter.report(s)
  local w = s.w
  local room = s.limit * w - s.p * (w - s.elapsed) - s.c * w
  local remaining = 0
  if room > 0 then
    remaining = idiv(room, w)
  end
  if remaining > s.limit then
    remaining = s.limit
  end
  local reset = 0
  if remaining < s.limit then
    reset = micros_until(counter_fits_at(s, remaining + 1))
  end
  return remaining, reset
end

--------------------------------------------------------------- fixed window

local fixed = {}

function fixed.prepare(s)
  local stored = redis.call('HMGET', s.key, 'w', 'c', 't')
  s.at = high_water(stored[3])
  s.id = idiv(s.at, s.window)
  s.c = 0
  if tonumber(stored[1]) == s.id then
    s.c = tonumber(stored[2]) or 0
  end
  s.ends_in = (s.id + 1) * s.window - now
  return s.c + s.cost <= s.limit
end

function fixed.record(s)
  s.c = s.c + s.cost
  redis.call('HSET', s.key, 'w', s.id, 'c', s.c, 't', string.format('%d', s.at))
  expire(s.key, math.floor(s.ends_in / 1000) + 1)
end

function fixed.retry(s)
  return s.ends_in
end

function fixed.report(s)
  local remaining = s.limit - s.c
  if remaining < 0 then
    remaining = 0
  end
  if s.c > 0 then
    return remaining, s.ends_in
  end
  return remaining, 0
end

---------------------------------------------------------------- the batch

local algorithms = { log = log, counter = counter, fixed = fixed }
local policies = (#ARGV - 1) / 4
local state = {}
local all_fit = true
local next_key = 1

for i = 1, policies do
  local algorithm = algorithms[ARGV[4 * i - 2]]
  if algorithm == nil then
    return redis.error_reply('unknown algorithm ' .. tostring(ARGV[4 * i - 2]))
  end
  local s = {
    algorithm = algorithm,
    key = KEYS[next_key],
    limit = tonumber(ARGV[4 * i - 1]),
    window = tonumber(ARGV[4 * i]),
    cost = tonumber(ARGV[4 * i + 1]),
  }
  next_key = next_key + 1
  if algorithm == log then
    s.meta = KEYS[next_key]
    next_key = next_key + 1
  end
  s.fits = algorithm.prepare(s)
  all_fit = all_fit and s.fits
  state[i] = s
end

local result = {}
for i = 1, policies do
  local s = state[i]
  local retry = -1
  if all_fit then
    s.algorithm.record(s)
  elseif not s.fits then
    retry = s.algorithm.retry(s)
  end
  local remaining, reset = s.algorithm.report(s)
  result[4 * i - 3] = all_fit and 1 or 0
  result[4 * i - 2] = remaining
  result[4 * i - 1] = reset
  result[4 * i] = retry
end
return result
