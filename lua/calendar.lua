-- Calendar quotas (a day, week, month or year), one of the library's
-- algorithms (see the interface at the top of `driver.lua`).
--
-- A count per calendar period, at a fixed offset from UTC: a 16-byte
-- string of two u64 (big-endian), the end (µs) of the period the count
-- is in, and the count. A count whose period has ended starts again at
-- 0 in the period that holds `now`. One whose period has not is kept
-- until the later of its end and the end of `now`'s period: a clock
-- that steps back into an earlier period, or a policy that now counts
-- shorter periods, never ends it early, and one that counts longer
-- periods keeps it to their end. Dates are proleptic Gregorian; weeks
-- start on Monday.

local calendar = {}
local QUOTA = '>I8I8'
local DAY = 86400000000

-- Days since 1970-01-01 of the 1st of month `m` of year `y`.
local function days_from_civil(y, m)
  if m <= 2 then
    y = y - 1
  end
  local era = idiv(y, 400)
  local yoe = y - era * 400
  local mp = m + 9
  if m > 2 then
    mp = m - 3
  end
  local doy = idiv(153 * mp + 2, 5)
  local doe = yoe * 365 + idiv(yoe, 4) - idiv(yoe, 100) + doy
  return era * 146097 + doe - 719468
end

-- The year and month of day `z` (days since 1970-01-01).
local function civil_from_days(z)
  z = z + 719468
  local era = idiv(z, 146097)
  local doe = z - era * 146097
  local yoe = idiv(doe - idiv(doe, 1460) + idiv(doe, 36524) - idiv(doe, 146096), 365)
  local doy = doe - (365 * yoe + idiv(yoe, 4) - idiv(yoe, 100))
  local mp = idiv(5 * doy + 2, 153)
  local y, m = yoe + era * 400, mp + 3
  if mp >= 10 then
    y, m = y + 1, mp - 9
  end
  return y, m
end

-- The end (µs) of the period of `s` that holds `t`: the next boundary.
local function period_end(s, t)
  local offset = s.window
  local day = idiv(math.max(0, t + offset), DAY)
  local next_day
  if s.period == 'day' then
    next_day = day + 1
  elseif s.period == 'week' then
    -- Day 0 was a Thursday: week w starts on day 7w - 3, a Monday.
    next_day = (idiv(day + 3, 7) + 1) * 7 - 3
  else
    local y, m = civil_from_days(day)
    if s.period == 'year' or m == 12 then
      y, m = y + 1, 1
    else
      m = m + 1
    end
    next_day = days_from_civil(y, m)
  end
  return next_day * DAY - offset
end

function calendar.prepare(s)
  local stored = redis.call('GET', s.key)
  local ends, count = 0, 0
  if stored and #stored == 16 then
    ends, count = struct.unpack(QUOTA, stored)
  end
  local period = period_end(s, now)
  if ends <= now then
    ends, count = period, 0
  elseif period > ends then
    -- Kept into a longer period (the policy now counts longer ones):
    -- written even if nothing is counted, so it is never dropped at the
    -- old period's end.
    ends, s.moved = period, true
  end
  s.ends, s.count = ends, count
  return count + s.cost <= s.limit
end

local function calendar_write(s)
  redis.call('SET', s.key, struct.pack(QUOTA, s.ends, s.count),
    'PX', int(idiv(s.ends - now, 1000) + 1 + expiry_grace_ms))
end

-- A calendar quota takes no delay.
function calendar.fits_at(s, time)
  return false
end

function calendar.record(s)
  s.count, s.recorded = s.count + s.cost, now
  calendar_write(s)
end

-- Takes back `cost` units counted at `at`, if that was in the count's
-- period.
function calendar.refund(s, at, cost)
  if s.count > 0 and period_end(s, at) == s.ends then
    s.count = math.max(0, s.count - cost)
    calendar_write(s)
  end
  return true
end

function calendar.save(s)
  if s.moved then
    calendar_write(s)
  end
end

function calendar.retry(s)
  return s.ends - now
end

function calendar.remember(s) end

function calendar.report(s)
  local remaining = math.max(0, s.limit - s.count)
  if s.count == 0 then
    return remaining, 0
  end
  return remaining, s.ends - now
end
