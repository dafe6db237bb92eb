-- The fixed window: one count per window. One of the library's algorithms
-- (see the interface at the top of `driver.lua`).
--
-- Key: a hash with the window id `w`, its count `c`, `t`, the latest time
-- (µs) a request was counted at, the window length `l` in µs, `n`, the
-- units of requests held for their delay into the next window, and `b`,
-- the time the key was made at (see `counter.lua`).

local fixed = {}

function fixed.prepare(s)
  local stored = hash_fields(s, 'w', 'c', 't', 'l', 'n', 'b')
  local carried
  s.at, carried = high_water(stored[3], s.window)
  s.t = stored[3]
  s.id = idiv(s.at, s.window)
  s.c, s.n = 0, 0
  local stored_id = tonumber(stored[1])
  local c, n = tonumber(stored[2]) or 0, tonumber(stored[5]) or 0
  s.b = stored_id == nil and s.at or tonumber(stored[6]) or 0
  local old = tonumber(stored[4])
  if n > 0 and stored_id ~= nil and old ~= nil and old ~= s.window and s.at < (stored_id + 2) * old then
    s.held_elsewhere = (stored_id + 2) * old
    return false
  end
  if stored_id ~= nil and old ~= nil and old ~= s.window then
    -- Left under another window length: the count stays in the new window
    -- holding the latest time a unit was counted at, if that is now's.
    -- Units held into the next window have passed, and their window
    -- ended, by now (see `held_elsewhere` just above).
    if idiv(s.at, old) > stored_id or idiv(tonumber(s.t) or s.at, s.window) < s.id then
      c = 0
    end
    stored_id, n = s.id, 0
    s.rewindowed = true
  end
  if carried and stored_id ~= nil and stored_id > s.id then
    stored_id, s.carried = s.id, true
    s.t = string.format('%d', s.at)
  end
  if stored_id == s.id then
    s.c, s.n = c, n
  elseif stored_id == s.id - 1 then
    s.c = n
  end
  s.ends_in = (s.id + 1) * s.window - now
  return s.c + s.cost <= s.limit
end

-- Writes the count, with `t` the latest time a unit was counted at.
local function fixed_write(s)
  redis.call('HSET', s.key, 'w', s.id, 'c', s.c, 't', s.t, 'l', s.window, 'n', s.n, 'b', int(s.b))
  s.stored = { s.id, s.c, s.t, s.window, s.n, s.b }
  local ends_in = s.ends_in
  if s.n > 0 then
    ends_in = ends_in + s.window
  end
  expire(s.key, math.floor(ends_in / 1000) + 1)
end

function fixed.record(s)
  count_request(s, idiv(s.pass, s.window) > s.id)
  fixed_write(s)
end

-- Whether the request fits at `time`, in this window or the next (a
-- delay holds a request no further).
function fixed.fits_at(s, time)
  local id = idiv(math.max(time, s.at), s.window)
  if id == s.id then
    return s.c + s.cost <= s.limit
  elseif id == s.id + 1 then
    return s.n + s.cost <= s.limit
  end
  return false
end

-- Takes back `cost` units counted at `at`, if that was in this window
-- or held into the next, and the key was made by then.
function fixed.refund(s, at, cost)
  local id = idiv(at, s.window)
  if at < s.b then
    fixed.save(s)
  elseif id == s.id + 1 and s.n > 0 then
    s.n = math.max(0, s.n - cost)
    fixed_write(s)
  elseif id == s.id and s.c > 0 then
    s.c = math.max(0, s.c - cost)
    fixed_write(s)
  else
    fixed.save(s)
  end
  return true
end

function fixed.save(s)
  if s.carried or s.rewindowed then
    fixed_write(s)
  end
end

-- The next window, unless what is held into it leaves no room: then the
-- one after.
function fixed.retry(s)
  if s.n > 0 and s.n + s.cost > s.limit then
    return s.ends_in + s.window
  end
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
