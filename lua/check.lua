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
--   log:     a string holding the packed log (see "sliding log" below);
--            then the sorted set an earlier version of this script kept
--            the log in, read once when the string is new.
--   counter: a hash with the current window id `w`, its count `c`, the
--            previous window's count `p`, the window length `l` (windows
--            in milliseconds) and `t`, the latest time (µs) a request was
--            counted at.
--   fixed:   a hash with the window id `w`, its count `c`, `t` and the
--            window length `l` in µs.
--
-- The counters place `now` no earlier than `t`: a clock that steps back
-- (NTP, a failover to a skewed node) never takes a key back to an earlier
-- window, which would forget its count. A step back of more than a window
-- carries the counts into the window of the new time instead. Waits are
-- still measured from the real `now`. When a key's window length changes
-- (a tier with a window of its own), its counts are re-placed under the
-- new length, never dropped early; a log's TTL is moved to cover it.
--
-- Returns, per policy, five integers: admitted (1 or 0, the same for every
-- policy), remaining units, reset in microseconds, retry-after in
-- microseconds (-1 when the policy fits the request), and the time in
-- microseconds the request's units were recorded at (-1 when nothing was):
-- a refund names it.
--
-- The same script peeks and refunds when ARGV[2] says so (see `main` at
-- the end).
--
-- Windows of the counters are aligned to the Unix epoch: window n covers
-- [n*W, (n+1)*W). All arithmetic stays in integers below 2^53, so Lua's
-- doubles are exact; the crate's policy validation guarantees it.

-- The time of the call being decided, in µs; set by `check`.
local now
-- Redis expires keys on its own clock. When the time is given instead, that
-- clock and `now` drift apart (a test's fake clock may stand still while
-- real time passes), so keys are kept a minute longer than their windows
-- need: expiry only collects garbage, it must never forget a live count.
local expiry_grace_ms = 0
-- What this call has read or written per key, for a later request of the
-- same call (a batch) to take instead of reading it again; valid for the
-- window it was computed with. Each algorithm's `remember` fills it once a
-- request's writes are done, so an entry always equals what a read from
-- Redis would give.
local known = {}

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

---------------------------------------------------------------- sliding log
--
-- One string per client and policy: a header, then a ring of records, one
-- per admitted request, oldest first from slot `head`.
--
-- Header (big-endian, LOG_HEADER_SIZE bytes): format version (1), offset
-- width in bytes (4 or 6), cost width in bytes (0, 1, 2 or 4), then u32
-- `head`, `count`, `capacity` and `sum` (the records' total cost), then
-- u64 `base` (µs; records hold their time as an offset from it), u64
-- `newest` (µs; the newest record's time) and u64 `expires` (µs; when the
-- key's TTL, last set, runs out).
--
-- The TTL is set two windows past the newest record, and set again only
-- once a new record would outlive it: one PEXPIRE per window, not per
-- request.
--
-- A record is its offset, then its cost; with a cost width of 0 every cost
-- is 1. Widths grow when a request needs them (a cost above 255, a window
-- above LOG_SHORT_WINDOW) and the ring is rewritten then, when it is full
-- (capacity doubles, up to the limit), when it holds a quarter of its
-- capacity or less (it halves), and when an offset would outgrow its width
-- (records are rebased on the oldest). Rewrites copy the live records only,
-- so each costs O(live) and happens at most once per that many requests,
-- or once per LOG_SHORT_WINDOW of time.
--
-- Records are kept in time order: a request is recorded no earlier than
-- `newest`, so a clock that steps back never reorders the ring. If it
-- steps back by more than a window, every record is pulled back to `now`:
-- the count stays, and leaves within a window of the new time.

local LOG_VERSION = 1
local LOG_HEADER = '>BBBI4I4I4I4I8I8I8'
local LOG_HEADER_SIZE = 43
-- Windows up to 2^31 µs (about 36 minutes) keep 4-byte offsets.
local LOG_SHORT_WINDOW = 2147483648
local LOG_MIN_CAPACITY = 4

local log = {}

local function cost_width(cost)
  if cost == 1 then
    return 0
  elseif cost < 256 then
    return 1
  elseif cost < 65536 then
    return 2
  end
  return 4
end

local function record_format(offset_width, cost_width)
  if cost_width == 0 then
    return '>I' .. offset_width
  end
  return '>I' .. offset_width .. 'I' .. cost_width
end

-- Reads `n` records from the `from`-th live one (0-based, from `head`),
-- as one string.
local function log_read(s, from, n)
  local slot = (s.head + from) % s.capacity
  local run = math.min(n, s.capacity - slot)
  local start = LOG_HEADER_SIZE + slot * s.size
  local bytes = redis.call('GETRANGE', s.key, start, start + run * s.size - 1)
  if run < n then
    bytes = bytes
      .. redis.call('GETRANGE', s.key, LOG_HEADER_SIZE, LOG_HEADER_SIZE + (n - run) * s.size - 1)
  end
  return bytes
end

-- Decodes the record at byte `pos` of `bytes`: its time, cost and the
-- position of the next record.
local function log_decode(s, bytes, pos)
  if s.cost_width == 0 then
    local offset, next_pos = struct.unpack(s.format, bytes, pos)
    return s.base + offset, 1, next_pos
  end
  local offset, cost, next_pos = struct.unpack(s.format, bytes, pos)
  return s.base + offset, cost, next_pos
end

-- Encodes a record at `time` of `cost`, in the log's current widths.
local function log_encode(s, time, cost)
  if s.cost_width == 0 then
    return struct.pack(s.format, time - s.base)
  end
  return struct.pack(s.format, time - s.base, cost)
end

-- The header of a log in state `s`.
local function log_header(s)
  return struct.pack(
    LOG_HEADER,
    LOG_VERSION,
    s.offset_width,
    s.cost_width,
    s.head,
    s.count,
    s.capacity,
    s.sum,
    s.base,
    s.newest,
    s.expires
  )
end

-- Takes every live record into Lua lists (`times`, `costs`), so that the
-- log can be rewritten.
local function log_load(s)
  if s.times ~= nil then
    return
  end
  s.times, s.costs = {}, {}
  if s.count == 0 then
    return
  end
  local bytes = log_read(s, 0, s.count)
  local pos = 1
  for i = 1, s.count do
    s.times[i], s.costs[i], pos = log_decode(s, bytes, pos)
  end
end

-- A log written by the first version of this script: a sorted set of
-- members "<time>:<seq>:<cost>" scored by time, at `s.legacy`. Its live
-- requests become this log's, so that upgrading forgets no count.
local function log_import(s, cutoff)
  s.times, s.costs = {}, {}
  local entries = redis.call('ZRANGEBYSCORE', s.legacy, '(' .. string.format('%d', cutoff), '+inf', 'WITHSCORES')
  for j = 1, #entries, 2 do
    local cost = tonumber(string.match(entries[j], ':(%d+)$')) or 1
    table.insert(s.times, tonumber(entries[j + 1]))
    table.insert(s.costs, cost)
    s.sum = s.sum + cost
    s.cost_width = math.max(s.cost_width, cost_width(cost))
  end
  s.count = #s.times
  if s.count > 0 then
    s.oldest, s.newest = s.times[1], s.times[s.count]
    s.dirty = true
  end
end

function log.prepare(s)
  local entry = recall(s)
  if entry ~= nil then
    -- Pruned at this same `now` by the request that left it.
    s.head, s.count, s.capacity, s.sum = entry.head, entry.count, entry.capacity, entry.sum
    s.base, s.newest, s.expires, s.oldest = entry.base, entry.newest, entry.expires, entry.oldest
    s.offset_width, s.cost_width = entry.offset_width, entry.cost_width
    s.header_pending = entry.pending
    s.format = record_format(s.offset_width, s.cost_width)
    s.size = s.offset_width + s.cost_width
    return s.sum + s.cost <= s.limit
  end
  local cutoff = now - s.window
  local stale = known[s.key]
  if stale ~= nil and stale.pending then
    -- Left under another window (a tier changed): written before reading.
    redis.call('SETRANGE', s.key, 0, log_header(stale))
    stale.pending = false
  end
  local header = redis.call('GETRANGE', s.key, 0, LOG_HEADER_SIZE - 1)
  if header == '' then
    s.head, s.count, s.capacity, s.sum, s.base, s.newest, s.expires = 0, 0, 0, 0, 0, 0, 0
    s.offset_width, s.cost_width = 4, 0
    log_import(s, cutoff)
    return s.sum + s.cost <= s.limit
  end
  local version
  version, s.offset_width, s.cost_width, s.head, s.count, s.capacity, s.sum, s.base, s.newest, s.expires =
    struct.unpack(LOG_HEADER, header)
  if version ~= LOG_VERSION then
    error('unknown sliding log format ' .. tostring(version) .. ' at ' .. s.key)
  end
  s.format = record_format(s.offset_width, s.cost_width)
  s.size = s.offset_width + s.cost_width

  -- Prune from the oldest, reading a few records at a time, more each
  -- round: O(expired) records read.
  local chunk = 4
  while s.count > 0 and s.oldest == nil do
    local n = math.min(chunk, s.count)
    local bytes = log_read(s, 0, n)
    local pos, gone = 1, 0
    for _ = 1, n do
      local time, cost
      time, cost, pos = log_decode(s, bytes, pos)
      if time > cutoff then
        s.oldest = time
        break
      end
      gone = gone + 1
      s.sum = s.sum - cost
    end
    if gone > 0 then
      s.head = (s.head + gone) % s.capacity
      s.count = s.count - gone
      s.dirty = true
    end
    chunk = chunk * 4
  end

  if s.count > 0 and s.newest - now > s.window then
    -- The clock stepped back by more than a window: pull every record
    -- back to now.
    log_load(s)
    for i = 1, s.count do
      s.times[i] = math.min(s.times[i], now)
    end
    s.oldest, s.newest = s.times[1], now
    s.dirty = true
  end
  return s.sum + s.cost <= s.limit
end

-- Moves `expires` two windows past the newest record; returns the TTL in
-- milliseconds to set.
local function log_extend(s)
  s.expires = s.newest + 2 * s.window
  return math.floor((s.expires - now) / 1000) + 1 + expiry_grace_ms
end

-- Writes the loaded records afresh, from slot 0, based on the oldest, with
-- room for twice as many (at least LOG_MIN_CAPACITY, at most the limit).
local function log_rewrite(s)
  local n = s.count
  s.capacity = math.max(n, math.min(s.limit, math.max(LOG_MIN_CAPACITY, 2 * n)))
  s.head = 0
  if n == 0 then
    s.base = now
  else
    s.base = s.times[1]
  end
  if s.window > LOG_SHORT_WINDOW or s.newest - s.base >= 4294967296 then
    s.offset_width = 6
  else
    s.offset_width = 4
  end
  s.format = record_format(s.offset_width, s.cost_width)
  s.size = s.offset_width + s.cost_width
  local ttl = log_extend(s)
  local parts = { log_header(s) }
  for i = 1, n do
    parts[i + 1] = log_encode(s, s.times[i], s.costs[i])
  end
  parts[n + 2] = string.rep('\0', (s.capacity - n) * s.size)
  redis.call('SET', s.key, table.concat(parts), 'PX', ttl)
  s.header_pending = false
end

function log.record(s)
  local at = now
  if s.count > 0 and s.newest > at then
    at = s.newest
  end
  s.recorded = at
  if s.count == 0 then
    s.oldest = at
  end
  local width = cost_width(s.cost)
  if
    s.times ~= nil
    or s.count == 0
    or s.count == s.capacity
    or (s.capacity > LOG_MIN_CAPACITY and 4 * s.count <= s.capacity)
    or s.capacity > s.limit
    or width > s.cost_width
    or (s.window > LOG_SHORT_WINDOW and s.offset_width < 6)
    or at - s.base >= 2 ^ (8 * s.offset_width)
  then
    log_load(s)
    s.count = s.count + 1
    s.times[s.count], s.costs[s.count] = at, s.cost
    s.sum, s.newest = s.sum + s.cost, at
    s.cost_width = math.max(s.cost_width, width)
    log_rewrite(s)
  else
    local slot = (s.head + s.count) % s.capacity
    redis.call('SETRANGE', s.key, LOG_HEADER_SIZE + slot * s.size, log_encode(s, at, s.cost))
    s.count, s.sum, s.newest = s.count + 1, s.sum + s.cost, at
    local ttl
    if s.expires < at + s.window then
      ttl = log_extend(s)
    end
    -- The header is written once the call is done (see
    -- `write_headers`), once for every request of this key in the call.
    s.header_pending = true
    if ttl ~= nil then
      redis.call('PEXPIRE', s.key, ttl)
    end
  end
  s.dirty = false
end

-- Saves what pruning changed, for a request that records nothing. Under
-- a window longer than the one the TTL was set for (a tier changed), the
-- TTL is moved too, so the records are not dropped while they count.
function log.save(s)
  local outlived = s.count > 0 and s.expires < s.newest + s.window
  if not s.dirty and not outlived then
    return
  end
  if s.times ~= nil then
    log_rewrite(s)
    return
  end
  if outlived then
    redis.call('PEXPIRE', s.key, log_extend(s))
  end
  s.header_pending = true
end

-- Takes back `cost` units recorded at `at`: the newest record of that
-- cost recorded no later than `at` (records of one time and cost are
-- alike), rewriting the log without it. Nothing, if it has left the window.
function log.refund(s, at, cost)
  log_load(s)
  for i = s.count, 1, -1 do
    if s.times[i] <= at and s.costs[i] == cost then
      table.remove(s.times, i)
      table.remove(s.costs, i)
      s.count, s.sum = s.count - 1, s.sum - cost
      if s.count > 0 then
        s.oldest, s.newest = s.times[1], s.times[s.count]
      else
        s.oldest, s.newest = nil, now
      end
      log_rewrite(s)
      return
    end
  end
  log.save(s)
end

function log.retry(s)
  -- The oldest records, until enough cost has left the window: with unit
  -- costs, the need-th record itself.
  local need = s.sum + s.cost - s.limit
  if s.times ~= nil then
    local freed = 0
    for i = 1, s.count do
      freed = freed + s.costs[i]
      if freed >= need then
        return s.times[i] + s.window - now
      end
    end
    return 0
  end
  if s.cost_width == 0 then
    if need > s.count then
      return 0
    elseif need == 1 then
      -- The oldest record, which pruning has read.
      return s.oldest + s.window - now
    end
    local time = log_decode(s, log_read(s, need - 1, 1), 1)
    return time + s.window - now
  end
  local n = math.min(need, s.count)
  local bytes = log_read(s, 0, n)
  local pos, freed = 1, 0
  for _ = 1, n do
    local time, cost
    time, cost, pos = log_decode(s, bytes, pos)
    freed = freed + cost
    if freed >= need then
      return time + s.window - now
    end
  end
  return 0
end

function log.remember(s)
  known[s.key] = {
    window = s.window,
    pending = s.header_pending,
    head = s.head, count = s.count, capacity = s.capacity, sum = s.sum,
    base = s.base, newest = s.newest, expires = s.expires, oldest = s.oldest,
    offset_width = s.offset_width, cost_width = s.cost_width,
  }
end

function log.report(s)
  local remaining = s.limit - s.sum
  if remaining < 0 then
    remaining = 0
  end
  if s.count == 0 then
    return remaining, 0
  end
  return remaining, s.oldest + s.window - now
end

------------------------------------------------------------ sliding counter

local counter = {}

-- Counts left under another window length (a tier with a window of its
-- own), re-placed in `w`-millisecond windows as of `now_ms`: first brought
-- to `now_ms` under their own window `old`, then the current count placed
-- in the new window holding `t_ms`, the latest time a unit was counted at,
-- and the previous count in the one holding the end of its window. So no
-- count is forgotten early, and none is moved later than it was counted.
-- Returns the new window id and its current and previous counts.
local function counter_rewindow(id, c, p, old, w, now_ms, t_ms)
  local old_id = idiv(now_ms, old)
  if old_id == id + 1 then
    c, p = 0, c
  elseif old_id > id + 1 then
    c, p = 0, 0
  end
  if old_id < id then
    old_id = id
  end
  local new_id = idiv(now_ms, w)
  local current, previous = 0, 0
  local function place(units, at)
    local bucket = idiv(at, w)
    if bucket >= new_id then
      current = current + units
    elseif bucket + 1 == new_id then
      previous = previous + units
    end
  end
  place(c, t_ms)
  place(p, math.max(0, math.min(old_id * old - 1, t_ms)))
  return new_id, current, previous
end

function counter.prepare(s)
  local w = s.window / 1000
  local stored = hash_fields(s, 'w', 'c', 'p', 't', 'l')
  local carried
  s.at, carried = high_water(stored[4], w * 1000)
  s.t = stored[4]
  local now_ms = idiv(s.at, 1000)
  local id = idiv(now_ms, w)
  local stored_id = tonumber(stored[1])
  local c, p = tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
  local old = tonumber(stored[5])
  if stored_id ~= nil and old ~= nil and old ~= w then
    local t_ms = idiv(tonumber(s.t) or s.at, 1000)
    stored_id, c, p = counter_rewindow(stored_id, c, p, old, w, now_ms, t_ms)
    s.rewindowed = true
  end
  if carried and stored_id ~= nil and stored_id > id then
    stored_id, s.carried = id, true
    s.t = string.format('%d', s.at)
  end
  if stored_id == id - 1 then
    c, p = 0, c
  elseif stored_id ~= id then
    c, p = 0, 0
  end
  s.w, s.now_ms, s.id, s.elapsed, s.c, s.p = w, now_ms, id, now_ms - id * w, c, p
  return p * (w - s.elapsed) + (c + s.cost) * w <= s.limit * w
end

-- Writes the counts, with `t` the latest time a unit was counted at.
local function counter_write(s)
  redis.call('HSET', s.key, 'w', s.id, 'c', s.c, 'p', s.p, 't', s.t, 'l', s.w)
  s.stored = { s.id, s.c, s.p, s.t, s.w }
  -- The counts matter until the end of the next window (on Redis's own
  -- clock, which expires the key: the real `now`, not the high water).
  expire(s.key, (s.id + 2) * s.w - idiv(now, 1000) + 1)
end

function counter.record(s)
  s.c = s.c + s.cost
  s.t = string.format('%d', s.at)
  s.recorded = s.at
  counter_write(s)
end

-- Saves counts carried back to the window of a clock that stepped back,
-- or re-placed under a new window length, for a request that records
-- nothing.
function counter.save(s)
  if s.carried or s.rewindowed then
    counter_write(s)
  end
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

-- Takes back `cost` units counted at `at`, from the window that holds it
-- if that is the current or the previous one.
function counter.refund(s, at, cost)
  local bucket = idiv(idiv(at, 1000), s.w)
  if bucket == s.id and s.c > 0 then
    s.c = math.max(0, s.c - cost)
  elseif bucket == s.id - 1 and s.p > 0 then
    s.p = math.max(0, s.p - cost)
  else
    counter.save(s)
    return
  end
  counter_write(s)
end

function counter.retry(s)
  return micros_until(counter_fits_at(s, s.cost))
end

counter.remember = remember_fields

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
  local stored = hash_fields(s, 'w', 'c', 't', 'l')
  local carried
  s.at, carried = high_water(stored[3], s.window)
  s.t = stored[3]
  s.id = idiv(s.at, s.window)
  s.c = 0
  local stored_id = tonumber(stored[1])
  local old = tonumber(stored[4])
  if stored_id ~= nil and old ~= nil and old ~= s.window then
    -- Left under another window length: the count stays in the new window
    -- holding the latest time a unit was counted at, if that is now's.
    if idiv(s.at, old) > stored_id or idiv(tonumber(s.t) or s.at, s.window) < s.id then
      stored_id = nil
    else
      stored_id = s.id
    end
    s.rewindowed = true
  end
  if carried and stored_id ~= nil and stored_id > s.id then
    stored_id, s.carried = s.id, true
    s.t = string.format('%d', s.at)
  end
  if stored_id == s.id then
    s.c = tonumber(stored[2]) or 0
  end
  s.ends_in = (s.id + 1) * s.window - now
  return s.c + s.cost <= s.limit
end

-- Writes the count, with `t` the latest time a unit was counted at.
local function fixed_write(s)
  redis.call('HSET', s.key, 'w', s.id, 'c', s.c, 't', s.t, 'l', s.window)
  s.stored = { s.id, s.c, s.t, s.window }
  expire(s.key, math.floor(s.ends_in / 1000) + 1)
end

function fixed.record(s)
  s.c = s.c + s.cost
  s.t = string.format('%d', s.at)
  s.recorded = s.at
  fixed_write(s)
end

-- Takes back `cost` units counted at `at`, if that was in this window.
function fixed.refund(s, at, cost)
  if idiv(at, s.window) == s.id and s.c > 0 then
    s.c = math.max(0, s.c - cost)
    fixed_write(s)
  else
    fixed.save(s)
  end
end

function fixed.save(s)
  if s.carried or s.rewindowed then
    fixed_write(s)
  end
end

function fixed.retry(s)
  return s.ends_in
end

fixed.remember = remember_fields

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

-- Writes the headers of the logs this call recorded in or pruned.
local function write_headers()
  for key, entry in pairs(known) do
    if entry.pending then
      redis.call('SETRANGE', key, 0, log_header(entry))
      entry.pending = false
    end
  end
end

-- Sets `now` from a time argument: microseconds, or "" for Redis's TIME.
local function set_now(time)
  known = {}
  if time ~= '' then
    now = tonumber(time)
    expiry_grace_ms = 60000
  else
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    expiry_grace_ms = 0
  end
end

-- The state of the policy whose four arguments start at argv[a] and whose
-- key is keys[k], brought up to `now`; and the index of the next key.
local function prepare(keys, argv, k, a)
  local algorithm = algorithms[argv[a]]
  if algorithm == nil then
    error('unknown algorithm ' .. tostring(argv[a]))
  end
  local s = {
    algorithm = algorithm,
    key = keys[k],
    limit = tonumber(argv[a + 1]),
    window = tonumber(argv[a + 2]),
    cost = tonumber(argv[a + 3]),
  }
  k = k + 1
  if algorithm == log then
    s.legacy = keys[k]
    k = k + 1
  end
  s.fits = algorithm.prepare(s)
  return s, k
end

-- Decides one request's `policies` policies, whose keys start at
-- keys[first_key] and whose arguments start at argv[first_arg], at `now`;
-- a peek records nothing. Returns the five integers per policy, and the
-- index of the next key.
local function decide(keys, argv, first_key, first_arg, policies, peek)
  local state = {}
  local all_fit = true
  local next_key = first_key

  for i = 1, policies do
    state[i], next_key = prepare(keys, argv, next_key, first_arg + 4 * (i - 1))
    all_fit = all_fit and state[i].fits
  end

  local result = {}
  for i = 1, policies do
    local s = state[i]
    local retry = -1
    if all_fit and not peek then
      s.algorithm.record(s)
    else
      if not s.fits then
        retry = s.algorithm.retry(s)
      end
      if s.algorithm.save ~= nil then
        s.algorithm.save(s)
      end
    end
    s.algorithm.remember(s)
    local remaining, reset = s.algorithm.report(s)
    result[5 * i - 4] = all_fit and 1 or 0
    result[5 * i - 3] = remaining
    result[5 * i - 2] = reset
    result[5 * i - 1] = retry
    result[5 * i] = s.recorded or -1
  end
  return result, next_key
end

-- Decides one request: `keys` and `argv` as described at the top. A peek
-- (`peek` true: ARGV[2] is "peek", and the policies' arguments follow it)
-- answers as the check would, and records nothing.
local function check(keys, argv, peek)
  set_now(argv[1])
  local first = peek and 3 or 2
  local result = decide(keys, argv, 1, first, (#argv - first + 1) / 4, peek)
  write_headers()
  return result
end

-- Refunds: ARGV[1] the time, ARGV[2] "refund", then per policy its four
-- arguments as for `check` and the time (µs) its units were recorded at.
-- Each policy's units are taken back on their own. Returns an empty list.
local function refund(keys, argv)
  set_now(argv[1])
  local k = 1
  for a = 3, #argv, 5 do
    local s
    s, k = prepare(keys, argv, k, a)
    s.algorithm.refund(s, tonumber(argv[a + 4]), s.cost)
    s.algorithm.remember(s)
  end
  write_headers()
  return {}
end

-- Decides several requests, in order, each all-or-nothing on its own, at
-- one time. ARGV[1] is the time as for `check`; then, per request, its
-- number of policies and their four arguments each. KEYS are the
-- requests' keys in the same order. Returns one entry per request: its
-- integers as `check` returns them, or an error of its own, which leaves
-- the other requests' decisions standing.
local function check_batch(keys, argv)
  set_now(argv[1])
  local replies = {}
  local next_key, next_arg = 1, 2
  while next_arg <= #argv do
    local policies = tonumber(argv[next_arg])
    local ok, result, after = pcall(decide, keys, argv, next_key, next_arg + 1, policies, false)
    if ok then
      replies[#replies + 1] = result
      next_key = after
    else
      -- What the failed request read or wrote is not known for sure; what
      -- the requests before it decided is written.
      write_headers()
      known = {}
      -- A Redis command's error arrives as a table with its message.
      local message = type(result) == 'table' and result.err or tostring(result)
      replies[#replies + 1] = redis.error_reply(message)
      -- Skip the failed request's keys: one per policy, two per log.
      for i = 0, policies - 1 do
        next_key = next_key + (argv[next_arg + 1 + 4 * i] == 'log' and 2 or 1)
      end
    end
    next_arg = next_arg + 1 + 4 * policies
  end
  write_headers()
  return replies
end

-- One call: a check, or a peek or refund as ARGV[2] says (for a check it
-- is the first policy's algorithm).
local function main(keys, argv)
  if argv[2] == 'refund' then
    return refund(keys, argv)
  end
  return check(keys, argv, argv[2] == 'peek')
end

return main(KEYS, ARGV)
