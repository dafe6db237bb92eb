-- The token bucket, one of the library's algorithms (see the interface at
-- the top of `driver.lua`).
--
-- GCRA in one key: a 48-byte string of six u64 (big-endian): `t`, the
-- time (µs) the bucket was last placed at; `d`, its debt at `t`; `w`,
-- the window (µs) the debt is measured in; `h`, the latest time a
-- request held for its delay passes at; `f`, the fastest limit it has
-- refilled at (as a limit of `w`, whose rate it is); and `z`, the time at or before which a refund names
-- nothing it can give back (see `bucket.refund`). A 32-byte string (from
-- before refunds were bounded so) has no `f` or `z`, a 24-byte one (from
-- before held requests were recorded) no `h` either. Time is scaled by the limit
-- L: a unit costs W scaled µs (W the window) and each µs refills L of
-- them, so the debt is units × W whatever the limit, and a tier with a
-- limit of its own reads the same debt. A request of cost c fits when
-- d + c·W ≤ B·W, B the burst. Policy validation keeps B·W below 2^52, so
-- every sum here is exact in Lua's doubles.

local bucket = {}
local BUCKET = '>I8I8I8I8I8I8'
local BUCKET_V2 = '>I8I8I8I8'
local BUCKET_V1 = '>I8I8I8'

-- `n / d` rounded up, for n >= 0 and d > 0.
local function ceil_div(n, d)
  local q = idiv(n, d)
  if q * d < n then
    return q + 1
  end
  return q
end

function bucket.prepare(s)
  local entry = recall(s)
  local stored
  if entry ~= nil then
    stored = entry.stored
  else
    local packed = redis.call('GET', s.key)
    if packed and #packed >= 48 then
      stored = { struct.unpack(BUCKET, packed) }
    elseif packed then
      local t, d, w, h = struct.unpack(#packed >= 32 and BUCKET_V2 or BUCKET_V1, packed)
      h = h or 0
      -- Its refunds named when their units would be repaid: none of them
      -- is honoured, the latest it can name being the held requests' and
      -- a full bucket's repayment.
      local z = math.max(t, h) + ceil_div(s.burst * w, s.limit)
      stored = { t, d, w, h, s.limit, z }
    end
  end
  s.stored = stored
  s.full = s.burst * s.window
  if stored ~= nil and stored[3] ~= s.window and stored[4] > now then
    s.held_elsewhere = stored[4]
    return false
  end
  -- A new key names no units taken before it (those of a bucket since
  -- reset or evicted).
  local t, d = now, 0
  s.h, s.f, s.z = 0, s.limit, now - 1
  if stored ~= nil then
    t, d, s.h, s.f, s.z = stored[1], stored[2], stored[4], stored[5], stored[6]
    if stored[3] ~= s.window then
      -- Measured under another window: the same units, rounded up, and
      -- never more than this bucket holds.
      d = math.min(math.ceil(d / stored[3] * s.window), s.full)
      -- The fastest refill's rate as a limit of this window, never below.
      s.f = math.floor(s.f * s.window / stored[3]) + 1
      s.rewindowed = true
    end
  end
  local carried
  s.at, carried = high_water(t, s.window)
  if carried then
    -- What refunds name was measured on the clock before the step.
    s.carried, s.z = true, math.max(s.z, t, s.h)
  elseif s.at > t then
    local refilled = s.at - t
    if d > 0 and s.limit > s.f then
      s.f, s.faster = s.limit, true
    end
    if refilled >= ceil_div(d, s.limit) then
      d = 0
    else
      d = d - refilled * s.limit
    end
  end
  s.d = d
  return d + s.cost * s.window <= s.full
end

local function bucket_write(s)
  local ms = idiv(s.at - now + ceil_div(s.d, s.limit), 1000) + 1
  redis.call('SET', s.key, struct.pack(BUCKET, s.at, s.d, s.window, s.h, s.f, s.z), 'PX', int(ms + expiry_grace_ms))
  s.stored = { s.at, s.d, s.window, s.h, s.f, s.z }
end

-- The time a refund names is when the request's units were taken: since
-- then the bucket has repaid at most that time by `f`, the fastest limit
-- it refilled at, so a refund that counts from it never takes back a
-- repaid unit, nor another request's, whatever tier refilled it and
-- whatever is refunded ahead of it meanwhile.
--
-- A request held for its delay takes its units at `pass`: the debt it
-- adds starts no earlier than that, so the bucket refills nothing for
-- the time it waits.
function bucket.record(s)
  local start = math.max(s.at, s.pass)
  s.d = math.max(s.d, (start - s.at) * s.limit) + s.cost * s.window
  s.recorded = start
  if s.pass > now then
    s.h = math.max(s.h, s.pass)
  end
  bucket_write(s)
end

-- The debt only falls as time passes, so a request that fits at its
-- retry time fits later; but a request held so long (by another policy)
-- that the debt it would start from passes 2^52 is not held, so the
-- arithmetic stays exact.
local HOLD_PRODUCT = 2 ^ 52
function bucket.fits_at(s, time)
  return s.cost * s.window <= s.full and math.max(s.at, time) - s.at <= idiv(HOLD_PRODUCT, s.limit)
end

-- Gives back what `cost` units taken at `start` may still owe: their
-- cost less what the bucket may have repaid since at its fastest, at
-- most the debt, and nothing once that is all of it.
--
-- Nothing either for a time at or before `z`: one the clock stepped back
-- from (a new clock's times are not comparable to it until it catches
-- up), or a charge alone (time 0).
--
-- While a held request has yet to pass, nothing: it passes at a time
-- fixed when it was recorded, and debt taken back from ahead of it would
-- let a new request take a slot beside it.
function bucket.refund(s, start, cost)
  local unrepaid = math.min(cost * s.window - (s.at - start) * s.f, s.d)
  if s.h > s.at or start <= s.z or start > s.at then
    unrepaid = 0
  end
  if unrepaid <= 0 then
    bucket.save(s)
    return true
  end
  s.d = s.d - unrepaid
  bucket_write(s)
  return true
end

function bucket.save(s)
  if s.carried or s.rewindowed or s.faster then
    bucket_write(s)
  end
end

-- Until `units` more fit, in µs from the real `now`.
local function bucket_wait(s, units)
  local over = s.d + units * s.window - s.full
  if over <= 0 then
    return 0
  end
  return ceil_div(over, s.limit) + (s.at - now)
end

function bucket.retry(s)
  return bucket_wait(s, s.cost)
end

function bucket.remember(s)
  known[s.key] = { window = s.window, stored = s.stored }
end

-- A burst lowered below the debt (a tier's, or a client's own limit)
-- leaves nothing: remaining is never negative.
function bucket.report(s)
  local remaining = math.max(0, idiv(s.full - s.d, s.window))
  if remaining >= s.burst then
    return s.burst, 0
  end
  return remaining, bucket_wait(s, remaining + 1)
end
