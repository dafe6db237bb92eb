#!lua
-- The check library's first file: the state of a call and the helpers
-- every algorithm shares. The library is the files of `lua/` joined in
-- the order `lua/files.rs` lists them (this one first, the
-- driver last); `driver.lua` describes the call, its arguments and
-- replies, and the functions each algorithm's file provides.
--
-- The shebang above (Redis 7 and later) declares a script that writes and
-- may not run out of memory: under `maxmemory` Redis refuses the call
-- before it starts. As a function library, the script also has
-- `allow-oom` twins for clients Redis already holds (see `NOT_HELD` in
-- `driver.lua`), so that only new clients meet their policies' fail modes
-- when Redis is full; a held client's state grows only by its own
-- admitted requests (a log may open a chunk of pages), and shrinks as
-- they leave its window.
--
-- The counters place `now` no earlier than `t`, the latest time they
-- counted a request at (see `high_water`): a clock that steps back (NTP,
-- a failover to a skewed node) never takes a key back to an earlier
-- window, which would forget its count. A step back of more than a window
-- carries the counts into the window of the new time instead. Waits are
-- still measured from the real `now`. When a key's window length changes
-- (a tier with a window of its own), its counts are re-placed under the
-- new length, never dropped early. (The sliding log has rules of its own
-- for both; see `log.lua`.)
--
-- Windows of the counters are aligned to the Unix epoch: window n covers
-- [n*W, (n+1)*W). All arithmetic stays in integers below 2^53, so Lua's
-- doubles are exact; the crate's policy validation guarantees it.

-- The time of the call being decided, in µs; set by `set_now` in
-- `driver.lua`.
local now
-- Redis expires keys on its own clock. When the time is given instead, that
-- clock and `now` drift apart (a test's fake clock may stand still while
-- real time passes), so keys are kept a minute longer than their windows
-- need: expiry only collects garbage, it must never forget a live count.
local expiry_grace_ms = 0
-- What this call has read or written per key, for a later request of the
-- same call (a batch) to take instead of reading it again: a counter's
-- fields, valid for the window they were computed with, or a log's state
-- with what the call has yet to write (see `write_logs`). Each
-- algorithm's `remember` fills it once a request's writes are done, so a
-- request that fails leaves nothing in it. A log's entry is its state
-- itself, which the next request of the key takes over (see `prepare`),
-- on a copy when preparing it changes it.
local known = {}

-- The work this call has done: fields of logs' chunks of pages read or
-- written, a page counting as PAGE_WORK, and REQUEST_WORK per policy of
-- each request decided (see BATCH_WORK).
local work = 0
local PAGE_WORK = 4

-- `redis.call` on a log's chunk of pages, counted as `units` of work.
local function pages_call(units, ...)
  work = work + units
  return redis.call(...)
end

-- The entry `known` holds for `s`'s key and window, if any.
local function recall(s)
  local entry = known[s.key]
  if entry ~= nil and entry.window == s.window then
    return entry
  end
  return nil
end

-- The fields of a counter's or fixed window's hash: what this call left
-- for `s`'s key and window, or else read from Redis. Kept in `s.stored`,
-- which the writes update.
local function hash_fields(s, ...)
  local entry = recall(s)
  s.stored = entry and entry.stored or redis.call('HMGET', s.key, ...)
  return s.stored
end

-- `remember` for a hash: its fields as last read or written.
local function remember_fields(s)
  known[s.key] = { window = s.window, stored = s.stored }
end

local function expire(key, ms)
  redis.call('PEXPIRE', key, ms + expiry_grace_ms)
end

-- The time a key's window is placed at: `now`, or the key's latest counted
-- time `t` if the clock has stepped back since, by at most `window` µs.
-- A longer step back places it at `now` and returns true: the key's counts
-- are then carried into `now`'s window, so they are kept, and leave within
-- two windows of the new time.
local function high_water(t, window)
  t = tonumber(t)
  if t == nil or t <= now then
    return now, false
  elseif t - now <= window then
    return t, false
  end
  return now, true
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

-- One policy's five integers in a reply.
local DECISION = '>i8i8i8i8i8'

local function int(n)
  return string.format('%d', n)
end

-- Counts a counter's or fixed window's request: in the current window,
-- or, held for its delay into the next (`ahead`), there.
local function count_request(s, ahead)
  if ahead then
    s.n = s.n + s.cost
    s.recorded = s.pass
  else
    s.c = s.c + s.cost
    s.recorded = s.at
  end
  s.t = string.format('%d', s.at)
end
