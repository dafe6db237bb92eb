-- The sliding counter: the current window's count and the previous
-- one's, the previous weighted by the share of its window the sliding
-- window still covers. One of the library's algorithms (see the interface
-- at the top of `driver.lua`).
--
-- Key: a hash with the current window id `w`, its count `c`, the previous
-- window's count `p`, the window length `l` (windows in milliseconds),
-- `t`, the latest time (µs) a request was counted at, `n`, the units
-- of requests held for their delay into the next window, and `b`, the
-- time (µs) the key was made at: a refund naming an earlier time names
-- units of a key since deleted (a reset, an eviction), and takes nothing
-- from this one (0 in a key from before births were kept).

local counter = {}

-- Counts left under another window length (a tier with a window of its
-- own), re-placed in `w`-millisecond windows as of `now_ms`: first brought
-- to `now_ms` under their own window `old`, then the current count placed
-- in the new window holding `t_ms`, the latest time a unit was counted at,
-- and the previous count in the one holding the end of its window. So no
-- count is forgotten early, and none is moved later than it was counted.
-- Returns the new window id and its current and previous counts.
local function counter_rewindow(id, c, p, n, old, w, now_ms, t_ms)
  local old_id = idiv(now_ms, old)
  if old_id == id + 1 then
    c, p = 0, c
  elseif old_id > id + 1 then
    c, p = 0, 0
  end
  -- Units held into the window after `id` count in `now_ms`'s window:
  -- never forgotten early (at worst, counted a little long).
  if old_id > id + 2 then
    n = 0
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
  place(n, now_ms)
  return new_id, current, previous
end

-- Whether `cost` more units fit in the current window: its estimate, and
-- with units held into the next window, their sum with the current count
-- (so the next window still fits what it holds).
local function counter_fits_now(s, cost)
  local w = s.w
  return s.p * (w - s.elapsed) + (s.c + cost) * w <= s.limit * w
    and (s.n == 0 or s.c + cost + s.n <= s.limit)
end

function counter.prepare(s)
  local w = s.window / 1000
  local stored = hash_fields(s, 'w', 'c', 'p', 't', 'l', 'n', 'b')
  local carried
  s.at, carried = high_water(stored[4], w * 1000)
  s.t = stored[4]
  local now_ms = idiv(s.at, 1000)
  local id = idiv(now_ms, w)
  local stored_id = tonumber(stored[1])
  local c, p = tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
  local n = tonumber(stored[6]) or 0
  s.b = stored_id == nil and s.at or tonumber(stored[7]) or 0
  local old = tonumber(stored[5])
  if n > 0 and stored_id ~= nil and old ~= nil and old ~= w and now_ms < (stored_id + 2) * old then
    s.held_elsewhere = (stored_id + 2) * old * 1000
    return false
  end
  if stored_id ~= nil and old ~= nil and old ~= w then
    local t_ms = idiv(tonumber(s.t) or s.at, 1000)
    stored_id, c, p = counter_rewindow(stored_id, c, p, n, old, w, now_ms, t_ms)
    n, s.rewindowed = 0, true
  end
  if carried and stored_id ~= nil and stored_id > id then
    stored_id, s.carried = id, true
    s.t = string.format('%d', s.at)
  end
  if stored_id == id - 1 then
    c, p, n = n, c, 0
  elseif stored_id == id - 2 then
    c, p, n = 0, n, 0
  elseif stored_id ~= id then
    c, p, n = 0, 0, 0
  end
  s.w, s.now_ms, s.id, s.elapsed, s.c, s.p, s.n = w, now_ms, id, now_ms - id * w, c, p, n
  return counter_fits_now(s, s.cost)
end

-- Writes the counts, with `t` the latest time a unit was counted at.
local function counter_write(s)
  redis.call('HSET', s.key, 'w', s.id, 'c', s.c, 'p', s.p, 't', s.t, 'l', s.w, 'n', s.n, 'b', int(s.b))
  s.stored = { s.id, s.c, s.p, s.t, s.w, s.n, s.b }
  -- The counts matter until the end of the next window (on Redis's own
  -- clock, which expires the key: the real `now`, not the high water),
  -- units held into the next window until the end of the one after.
  local windows = s.n > 0 and 3 or 2
  expire(s.key, (s.id + windows) * s.w - idiv(now, 1000) + 1)
end

function counter.record(s)
  count_request(s, idiv(idiv(s.pass, 1000), s.w) > s.id)
  counter_write(s)
end

-- Whether the request fits at `time`, in the current window or the next
-- (a delay holds a request no further).
function counter.fits_at(s, time)
  local at_ms = idiv(math.max(time, s.at), 1000)
  local w = s.w
  local id = idiv(at_ms, w)
  if id == s.id then
    local e = at_ms - id * w
    return s.p * (w - e) + (s.c + s.cost) * w <= s.limit * w
      and (s.n == 0 or s.c + s.cost + s.n <= s.limit)
  elseif id == s.id + 1 then
    local e = at_ms - id * w
    return s.c * (w - e) + (s.n + s.cost) * w <= s.limit * w
  end
  return false
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
  if room >= 0 and room >= s.n then
    if s.p * (w - s.elapsed) <= room * w then
      return s.now_ms
    end
    local elapsed = w - idiv(room * w, s.p)
    if elapsed < w then
      return s.id * w + elapsed
    end
  end
  -- In the next window, the current count becomes the previous one,
  -- beside what is held into it.
  local next_start = (s.id + 1) * w
  local next_room = s.limit - s.n - cost
  if s.n > 0 and next_room < 0 then
    return next_start + w
  end
  if s.c == 0 then
    return next_start
  end
  local elapsed = w - idiv(next_room * w, s.c)
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
-- if that is the current or the previous one, and the key was made by
-- then.
function counter.refund(s, at, cost)
  local bucket = idiv(idiv(at, 1000), s.w)
  if at < s.b then
    counter.save(s)
    return true
  elseif bucket == s.id + 1 and s.n > 0 then
    s.n = math.max(0, s.n - cost)
  elseif bucket == s.id and s.c > 0 then
    s.c = math.max(0, s.c - cost)
  elseif bucket == s.id - 1 and s.p > 0 then
    s.p = math.max(0, s.p - cost)
  else
    counter.save(s)
    return true
  end
  counter_write(s)
  return true
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
  if s.n > 0 then
    remaining = math.max(0, math.min(remaining, s.limit - s.c - s.n))
  end
  local reset = 0
  if remaining < s.limit then
    reset = micros_until(counter_fits_at(s, remaining + 1))
  end
  return remaining, reset
end
