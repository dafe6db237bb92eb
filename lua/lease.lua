-- Leases: a concurrency limit, one of the library's algorithms (see the
-- interface at the top of `driver.lua`).
--
-- At most `limit` requests in flight: a sorted set of leases, each a
-- member named by the id its check carries (the policy's cost argument:
-- a lease costs 1), scored with the time (µs) it was taken at. A lease
-- taken more than a window (the lease time) ago has expired: the leases
-- of an instance that died are gone within it. Expired leases are
-- removed a few per call.
--
-- The id is known before the call, so a request whose check timed out
-- (or was dropped) releases its lease whatever became of the call. A
-- release that finds no lease leaves a tombstone, the id scored with
-- minus the time it expires at (a lease time on), in case its check has
-- yet to run: the take then finds it and takes nothing. Negative scores
-- are never counted as leases.

local lease = {}
-- Expired leases (and tombstones) one call removes, at most.
local CLEAN_LEASES = 8
-- The retry time of a full set: leases end when their requests do, which
-- no store knows in advance.
local LEASE_RETRY = 1000000

function lease.prepare(s)
  local cutoff = now - s.window
  local tombstones = redis.call('ZCOUNT', s.key, '-inf', '(0')
  if tombstones > 0 then
    -- Those whose time has passed: scores in (-now, 0).
    local stale = redis.call('ZRANGEBYSCORE', s.key, '(' .. int(-now), '(0', 'LIMIT', 0, CLEAN_LEASES)
    if #stale > 0 then
      redis.call('ZREM', s.key, unpack(stale))
      tombstones = tombstones - #stale
    end
  end
  local expired = redis.call('ZCOUNT', s.key, 0, int(cutoff))
  if expired > 0 then
    redis.call('ZREMRANGEBYRANK', s.key, tombstones, tombstones + math.min(expired, CLEAN_LEASES) - 1)
  end
  s.tombstones = tombstones
  s.held = redis.call('ZCOUNT', s.key, '(' .. int(cutoff), '+inf')
  return s.held + 1 <= s.limit
end

-- Keeps `s`'s key at least a lease time from now.
local function lease_keep(s)
  local ms = idiv(s.window, 1000) + 1 + expiry_grace_ms
  if redis.call('PTTL', s.key) < ms then
    redis.call('PEXPIRE', s.key, int(ms))
  end
end

-- A request under a concurrency limit is never held: its lease would
-- be taken now, and its time would run while the request waits.
function lease.fits_at(s, time)
  return false
end

function lease.record(s)
  s.recorded = now
  if s.tombstones > 0 and redis.call('ZSCORE', s.key, s.id) then
    -- Released before it was taken: its request is gone.
    redis.call('ZREM', s.key, s.id)
    return
  end
  redis.call('ZADD', s.key, int(now), s.id)
  redis.call('PEXPIRE', s.key, int(idiv(s.window, 1000) + 1 + expiry_grace_ms))
  s.held = s.held + 1
end

-- Releases the lease `s.id`, or leaves its tombstone.
function lease.refund(s, at, cost)
  if redis.call('ZREM', s.key, s.id) == 0 then
    redis.call('ZADD', s.key, int(-(now + s.window)), s.id)
    lease_keep(s)
  end
  return true
end

function lease.save(s) end

function lease.retry(s)
  return LEASE_RETRY
end

function lease.remember(s) end

function lease.report(s)
  local remaining = math.max(0, s.limit - s.held)
  if s.held == 0 then
    return remaining, 0
  end
  return remaining, LEASE_RETRY
end
