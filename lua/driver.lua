-- The check library's driver: one request's rate-limit check (one or
-- more policies, each with its own algorithm, decided all-or-nothing in
-- one atomic call), a batch of them, peeks, refunds, settlements,
-- renewals and resets, and the `allow-oom` twins Redis runs when it is
-- out of memory. It comes last in the library (see `shared.lua`) and
-- calls the algorithms' files through the interface below.
--
-- ARGV[1]: the time in microseconds, or "" to read the server's TIME (the
--   empty form is the only one production uses).
-- ARGV, per policy (ARGS = 8 each, from ARGV[2]): algorithm ("log",
--   "counter", "fixed", "bucket", "lease", or a calendar period: "day",
--   "week", "month" or "year"), limit, window in microseconds (a lease's
--   time for "lease"; for a calendar, its offset from UTC in µs, east
--   positive), burst (a bucket's size; the limit otherwise), block in
--   microseconds (0: none), delay in microseconds (0: none), span (a
--   log's: the longest window in µs its policy's tiers count it under; 0
--   otherwise), and the request's cost (a lease's id for "lease"). A
--   denial the delay can hold (its retry time within it) is no denial for
--   the block, which only a request beyond the delay starts. A batch call
--   names each policy once (see `check_batch`).
-- KEYS, taken in policy order: the algorithm's own (two for a log, one
--   otherwise; each algorithm's file says what they hold), then, for a
--   policy that blocks, a string holding the time (µs) until which the
--   client is blocked: set when the policy's own count denies a request,
--   and read before it, so that every request meanwhile is denied.
--
-- Returns, per policy, five integers, packed in one string (DECISION: 8
-- bytes each, big-endian, signed), which the client reads far faster
-- than as many integer replies: admitted (1 or 0, the same for every
-- policy), remaining units, reset in microseconds, retry-after in
-- microseconds (-1 when the policy fits the request; for a request
-- admitted after a delay, the wait until it passes), and for an admitted
-- request the time in microseconds its units were recorded at (which a
-- refund names), for a denied one how long (µs) the policy's block still
-- lasts (-1 when nothing was recorded, or the client is not blocked).
--
-- The same call peeks, refunds, settles, renews leases and resets when
-- ARGV[2] says so (see `main` at the end).
--
-- The algorithms' interface. Each algorithm's file defines a table of
-- eight functions, named in `algorithms` below. Each takes `s`, one
-- policy's state for one request, which the driver fills before
-- `prepare` (see `prepare` below): `key` (and a log's `store`), `limit`,
-- `window`, `burst`, `longest` (a log's span), `block`, `delay`,
-- `period` (a calendar's), `cost` (a number) and `id` (the cost as sent:
-- a lease's id), `block_key` and `blocked`; the algorithm keeps its own
-- fields in `s` beside them.
--   prepare(s)         reads the key and brings its state up to `now`;
--                      returns whether the policy's own count fits
--                      `s.cost` now. Writes nothing a request that then
--                      fails must not leave (at most expired leases
--                      removed, a log's lost chunk recovered). A counter, fixed
--                      window or bucket that cannot decide under this
--                      window length sets `s.held_elsewhere` (see
--                      `retry_of`) and returns false.
--   fits_at(s, time)   whether the request fits at `time` (µs, after
--                      `now`) if nothing else is admitted meanwhile.
--                      Reads and writes nothing.
--   retry(s)           µs until the request fits, for one that does not
--                      fit now. Reads at most a few fields; writes
--                      nothing.
--   record(s)          counts `s.cost` units at `s.pass` (`now`, or the
--                      time a delayed request passes), sets `s.recorded`
--                      to the time a refund will name, and writes the key
--                      (a log's header waits for `log_flush`).
--   save(s)            for a request that records nothing: writes what
--                      `prepare` changed that must be kept (counts
--                      carried across a clock step, pruned records).
--   refund(s, at, cost) takes back `cost` units recorded at `at`, if they
--                      are still counted (not for a time before the key
--                      was made: units of a key since deleted), and
--                      writes the key; returns whether a settlement then
--                      counts its final units (a log's reserved units
--                      that have left its window are not counted again:
--                      it counts only those beyond them).
--   remember(s)        leaves what a later request of the same call
--                      may take instead of reading the key again in
--                      `known` (nothing, for leases and calendars);
--                      called once the writes are done.
--   report(s)          the units left and the µs until the window resets,
--                      as a reply's second and third integers.
-- The sliding log also has a fast path the driver tries first
-- (`log_common`), a write once a call (`log_flush`) and a reset
-- (`log_reset`).

-- The error of a request that Redis, out of memory, cannot admit without
-- new state (see "Under `maxmemory`" further down).
local NOT_HELD = 'OOM a new client is not tracked while Redis is out of memory'

local algorithms = {
  log = log, counter = counter, fixed = fixed, bucket = bucket, lease = lease,
  day = calendar, week = calendar, month = calendar, year = calendar,
}

-- Writes the headers (and rewritten tails and TTLs) of the logs this
-- call changed, once each.
local function write_logs()
  for _, entry in pairs(known) do
    if entry.algorithm == log then
      log_flush(entry)
    end
  end
end

-- Sets `now` from a time argument: microseconds, or "" for Redis's TIME.
local function set_now(time)
  known, work, header_key = {}, 0, nil
  if time ~= '' then
    now = tonumber(time)
    expiry_grace_ms = 60000
  else
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    expiry_grace_ms = 0
  end
end

-- Arguments per policy: algorithm, limit, window, burst, block, delay,
-- span, and the request's cost.
local ARGS = 8

-- The number argument argv[i], named `what` in an error: a whole number
-- from `least` up. A call whose arguments are malformed fails before it
-- reads or writes a key, and a refund, settlement or reset checks every
-- policy's arguments before its first write (see `policies_of`).
local function whole(value, least, what)
  local n = type(value) == 'string' and string.find(value, '^%-?%d+$') and tonumber(value)
  if not n or n < least or n == math.huge or n == -math.huge then
    error('invalid ' .. what .. ' ' .. tostring(value))
  end
  return n
end

-- The policy described by the seven arguments from argv[a], its numbers
-- parsed and checked (a window of at least 1 µs); its span no shorter
-- than its window.
local function describe(argv, a)
  local algorithm = algorithms[argv[a]]
  if algorithm == nil then
    error('unknown algorithm ' .. tostring(argv[a]))
  end
  -- A calendar's offset from UTC, which may be 0 or west of it.
  local window = whole(argv[a + 2], algorithm == calendar and -math.huge or 1, 'window')
  return {
    algorithm = algorithm,
    period = argv[a],
    limit = whole(argv[a + 1], 0, 'limit'),
    window = window,
    burst = whole(argv[a + 3], 0, 'burst'),
    block = whole(argv[a + 4], 0, 'block'),
    delay = whole(argv[a + 5], 0, 'delay'),
    span = math.max(whole(argv[a + 6], 0, 'span'), window),
  }
end

-- The cost argument `value` of `policy`: a whole number of units from 0
-- up, or, for a lease, its id as sent.
local function cost_of(value, policy)
  if policy.algorithm == lease then
    if value == nil then
      error('missing lease id')
    end
    return value
  end
  return whole(value, 0, 'cost')
end

-- The keys of `policy`: two for a log, one otherwise, and one more for a
-- policy that blocks.
local function key_count(policy)
  local count = policy.algorithm == log and 2 or 1
  if policy.block > 0 then
    count = count + 1
  end
  return count
end

-- A policy's state, sized for the fields `prepare` sets.
local function new_state(algorithm, key)
  return {
    algorithm = algorithm, key = key, limit = 0, window = 0, cost = 0, id = 0, burst = 0,
    block = 0, delay = 0, period = nil, moved = nil, longest = 0,
  }
end

-- The state of `policy` for a request of `cost` (as sent), whose keys
-- start at keys[k], brought up to `now` (reading only); and the index of
-- the next key. `s.fits` says whether its own count fits the request,
-- `s.blocked` until when a denial blocks the client (µs).
local function prepare(keys, k, policy, cost)
  local algorithm = policy.algorithm
  local key = keys[k]
  local s = known[key]
  if algorithm == log and s ~= nil and s.algorithm == log then
    -- The log as the call's last request of the key left it, taken over;
    -- a copy if preparing it will change it, so that a request that
    -- fails leaves the call's state as it was.
    if log_changes(s, policy) then
      local copy = {}
      for field, value in pairs(s) do
        copy[field] = value
      end
      s = copy
    end
    -- What that request alone was told is cleared.
    s.blocked, s.block_key, s.recorded, s.window_oldest = nil, nil, nil, nil
  else
    s = (algorithm == log and new_log or new_state)(algorithm, key)
  end
  s.limit, s.window, s.burst, s.longest = policy.limit, policy.window, policy.burst, policy.span
  s.block, s.delay, s.period = policy.block, policy.delay, policy.period
  s.cost = tonumber(cost)
  -- A lease's id is its cost argument, kept as sent.
  s.id = cost
  k = k + 1
  if algorithm == log then
    s.store = keys[k]
    k = k + 1
  end
  if s.block > 0 then
    s.block_key = keys[k]
    k = k + 1
    local until_time = tonumber(redis.call('GET', s.block_key))
    if until_time ~= nil and until_time > now then
      s.blocked = until_time
    end
  end
  s.fits = algorithm.prepare(s)
  return s, k
end

-- A counter, fixed window or bucket that holds units of requests held
-- for their delay, counted now under another window length (a tier with
-- a window of its own, or a reload): the new length could not keep those
-- units counted until their requests pass, so the key decides nothing
-- and is left as it is: every request is denied, until `held_elsewhere`
-- (µs), when the last of them has passed. Its `prepare` sets it, and
-- returns false.
local function retry_of(s)
  if s.held_elsewhere ~= nil then
    return s.held_elsewhere - now
  end
  return s.algorithm.retry(s)
end

local function report_of(s)
  if s.held_elsewhere ~= nil then
    return 0, s.held_elsewhere - now
  end
  return s.algorithm.report(s)
end

local function fits_at(s, time)
  return s.held_elsewhere == nil and s.algorithm.fits_at(s, time)
end

-- Blocks the client of `s`, denied by its own count, for the policy's
-- block time from now.
local function block(s)
  local until_time = now + s.block
  redis.call('SET', s.block_key, int(until_time), 'PX', int(idiv(s.block, 1000) + 1 + expiry_grace_ms))
  s.blocked = until_time
end

-- Decides one request of `count` policies (`policies[i]`, see
-- `describe`, at cost `costs[i]` as sent), whose keys start at
-- keys[first_key], at `now`; a peek records nothing. Everything that reads comes first, so that a
-- request that fails has written nothing. With `held_only` (Redis is out
-- of memory, see `NOT_HELD`), a request to admit whose state does not
-- all exist yet raises NOT_HELD before writing anything. Returns the
-- decisions, packed (see DECISION), and the index of the next key. In a
-- batch, `shared` counts the requests that use each key (see
-- `check_batch`).
--
-- A request that some policies do not fit now, each within its delay,
-- and that no block holds, is decided once: admitted at `pass`, the time
-- every policy fits it (the latest of their retry times), with its units
-- recorded at that time under every policy, so no request admitted
-- meanwhile can take its place; its retry integer is then the wait.
local function decide(keys, first_key, count, policies, costs, peek, held_only, shared)
  for i = 1, count do
    costs[i] = cost_of(costs[i], policies[i])
  end
  if count == 1 and not peek and not held_only
    and (shared == nil or shared[keys[first_key]] == 1 or known[keys[first_key]] ~= nil) then
    local result = log_common(keys, first_key, policies[1], costs[1])
    if result ~= nil then
      return result, first_key + 2
    end
  end
  local state = {}
  local all_fit = true
  local next_key = first_key

  for i = 1, count do
    state[i], next_key = prepare(keys, next_key, policies[i], costs[i])
    all_fit = all_fit and state[i].fits and state[i].blocked == nil
  end
  policies = count
  local retry = {}
  local pass = now
  local holdable = not all_fit and not peek
  for i = 1, policies do
    local s = state[i]
    retry[i] = -1
    if not all_fit and not s.fits then
      retry[i] = retry_of(s)
      if s.blocked ~= nil or s.delay == 0 or retry[i] > s.delay then
        holdable = false
      elseif now + retry[i] > pass then
        pass = now + retry[i]
      end
    elseif s.blocked ~= nil then
      holdable = false
    end
  end
  if holdable then
    for i = 1, policies do
      if not fits_at(state[i], pass) then
        holdable = false
      end
    end
  end
  local admitted = all_fit or holdable
  local record = admitted and not peek
  -- Before the request's first write: the pages its logs will write to.
  for i = 1, policies do
    if state[i].algorithm == log then
      log_check_writes(state[i], record and pass or nil, false)
    end
  end
  if record and held_only then
    for i = 1, policies do
      if redis.call('EXISTS', state[i].key) == 0 then
        error({ err = NOT_HELD })
      end
    end
  end
  for i = 1, policies do
    local s = state[i]
    if holdable then
      retry[i] = pass - now
    elseif not all_fit then
      if not s.fits then
        local beyond_delay = s.delay == 0 or retry[i] > s.delay
        -- Out of memory, a block is set only for a client whose state
        -- exists (a few bytes beside it), never for a new one.
        if s.block_key ~= nil and s.blocked == nil and not peek and beyond_delay
          and not (held_only and redis.call('EXISTS', s.key) == 0) then
          block(s)
        end
      end
      if s.blocked ~= nil then
        retry[i] = math.max(retry[i], s.blocked - now)
      end
    end
  end

  local decisions = {}
  for i = 1, policies do
    local s = state[i]
    if record then
      s.pass = pass
      s.algorithm.record(s)
    else
      s.algorithm.save(s)
    end
    s.algorithm.remember(s)
    local remaining, reset = report_of(s)
    if s.blocked ~= nil then
      remaining = 0
    end
    local last = s.recorded or -1
    if s.blocked ~= nil then
      last = s.blocked - now
    end
    decisions[i] = struct.pack(DECISION, admitted and 1 or 0, remaining, reset, retry[i], last)
  end
  return table.concat(decisions), next_key
end

-- Decides one request: `keys` and `argv` as described at the top. A peek
-- (`peek` true: ARGV[2] is "peek", and the policies' arguments follow it)
-- answers as the check would, and records nothing.
local function check(keys, argv, peek, held_only)
  set_now(argv[1])
  local policies, costs = {}, {}
  for a = peek and 3 or 2, #argv, ARGS do
    policies[#policies + 1] = describe(argv, a)
    costs[#costs + 1] = argv[a + ARGS - 1]
  end
  local result = decide(keys, 1, #policies, policies, costs, peek, held_only)
  write_logs()
  return result
end

-- Counts `units` more at `now` under `s`, past the limit if need be:
-- what a request settled after its response cost (see `refund`). A log,
-- a fixed window and a calendar take at most the burst (their limit):
-- a record of the whole limit already denies every request until it
-- leaves, so more would change no decision. A sliding counter takes at
-- most its limit, and its current count goes no higher than twice its
-- limit; a bucket's debt no higher than 2^52: their arithmetic stays
-- exact.
local function charge(s, units)
  local algorithm = s.algorithm
  if algorithm == lease then
    return
  elseif algorithm == bucket then
    units = math.min(units, 4294967295, idiv(math.max(0, HOLD_PRODUCT - s.d), s.window))
  elseif algorithm == counter then
    units = math.min(units, s.burst, 2 * s.limit - s.c)
  else
    units = math.min(units, s.burst)
  end
  if units > 0 then
    s.cost, s.pass = units, now
    algorithm.record(s)
  end
end

-- The policies a refund, settlement, renewal or reset names, each
-- followed in ARGV by its arguments as for `check` and `extra` whole
-- numbers more (a refund: the time its units were recorded at; a
-- settlement: that, its final units and its id), all checked before the call
-- writes anything, so that a malformed policy leaves the others as they
-- were; and KEYS must hold exactly their keys (with `marked`, as a
-- settlement's do, one more after each policy's: see `mark_settled`).
-- Each entry holds the policy (see `describe`), its cost (checked when
-- `costed`), its extra numbers, the index of its first key and its
-- marks' key.
local function policies_of(keys, argv, extra, costed, marked)
  local parsed = {}
  local k = 1
  for a = 3, #argv, ARGS + extra do
    local policy = describe(argv, a)
    local p = { policy = policy, first_key = k, extra = {} }
    if costed then
      p.cost = cost_of(argv[a + ARGS - 1], policy)
    end
    for e = 1, math.min(extra, 2) do
      p.extra[e] = whole(argv[a + ARGS - 1 + e], e == 1 and -math.huge or 0, 'refund argument')
    end
    if extra == 3 then
      -- A settlement's id, kept as sent: a u64 past a double's precision.
      local id = argv[a + ARGS + 2]
      if id == nil or not string.find(id, '^%d+$') then
        error('invalid settlement id ' .. tostring(id))
      end
      p.id = id ~= '0' and id or nil
    end
    parsed[#parsed + 1] = p
    k = k + key_count(policy)
    if marked then
      p.marks = keys[k]
      k = k + 1
    end
  end
  if k - 1 ~= #keys then
    error('the policies name ' .. (k - 1) .. ' keys, the call has ' .. #keys)
  end
  return parsed
end

-- A settlement's marks: a sorted set per policy and client (`:s`, after
-- the policy's keys in a settlement's KEYS) of the ids of the
-- reservations settled (each request's own: two requests may share a
-- time), each scored with the time until which it is kept: SETTLED_MARKS
-- from when it landed, longer than the layer goes on sending a
-- settlement that failed. A settlement whose id is marked (sent twice: a
-- retry after a timeout) does nothing, before a reset or after it; one
-- that names no id (0), or no time (a charge alone), is not marked.
local SETTLED_MARKS = 300000000

-- Marks the settlement `id` in `key`, and forgets marks whose time is
-- past.
local function mark_settled(key, id)
  redis.call('ZADD', key, int(now + SETTLED_MARKS), id)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
  expire(key, idiv(SETTLED_MARKS, 1000))
end

-- Refunds and settlements: ARGV[1] the time, ARGV[2] "refund" or
-- "settle", then per policy its arguments as for `check`, the time (µs)
-- its units were recorded at, and for a settlement the units the request
-- cost in the end and the reservation's id (see `mark_settled`; in KEYS,
-- the policy's marks follow its keys). Each policy's units are taken
-- back on their own (a lease is released); a settlement then counts its
-- final units at `now` (see `charge`); for a log's units that have left
-- its window, only those beyond the reservation. Counts held elsewhere
-- (see `retry_of`) are left as they are. Returns an empty string.
local function refund(keys, argv)
  set_now(argv[1])
  local settle = argv[2] == 'settle'
  local parsed = policies_of(keys, argv, settle and 3 or 1, true, settle)
  if settle then
    -- Before any write: which settlements were made already.
    for _, p in ipairs(parsed) do
      if p.id ~= nil and p.extra[1] ~= 0 then
        local until_time = tonumber(redis.call('ZSCORE', p.marks, p.id))
        p.done = until_time ~= nil and until_time > now
      end
    end
  end
  for _, p in ipairs(parsed) do
    if not p.done then
      local s = prepare(keys, p.first_key, p.policy, p.cost)
      if s.algorithm == log then
        log_check_writes(s, nil, true)
      end
      if s.held_elsewhere == nil then
        local at = p.extra[1]
        local named = s.algorithm.refund(s, at, s.cost)
        if settle then
          -- Reserved units that have left a log's window are not counted
          -- again: only what the request cost beyond them, which no
          -- record ever counted. A time of 0 names none, and the cost is
          -- charged alone.
          local units = p.extra[2]
          if not named and at ~= 0 then
            units = units - s.cost
          end
          charge(s, units)
        end
        if p.id ~= nil and at ~= 0 then
          mark_settled(p.marks, p.id)
        end
      end
      s.algorithm.remember(s)
    end
  end
  write_logs()
  return ''
end

-- Resets: ARGV[1] the time, ARGV[2] "reset", then per policy its
-- arguments as for `check`: every key of the policy is deleted (a log's
-- chunks of pages with its header, unlinked: Redis frees a large hash of
-- the one-hash version in the background), but its settlement marks,
-- which a settlement sent again after the reset still finds. Returns an
-- empty string.
local function reset(keys, argv)
  set_now(argv[1])
  for _, p in ipairs(policies_of(keys, argv, 0, false)) do
    local k = p.first_key
    if p.policy.algorithm == log then
      log_reset(keys[k], keys[k + 1])
    end
    for j = k, k + key_count(p.policy) - 1 do
      redis.call('UNLINK', keys[j])
    end
  end
  return ''
end

-- Renewals: ARGV[1] the time, ARGV[2] "renew", then per policy its
-- arguments as for `check` (a lease's id as its cost): each lease still
-- held is kept a lease time from now. One that is gone (it expired while
-- the store could not be reached, or the store lost it in a restart or a
-- failover) is taken again only within the limit, as a new request's
-- would be: the connection that holds it still lives and counts, but
-- never past the limit. One that was released (a tombstone) is left so.
-- Other policies are left as they are. Returns one byte per policy: "1"
-- where the lease is held (or nothing is to be held), "0" where it is
-- gone and could not be taken again within the limit.
local function renew(keys, argv)
  set_now(argv[1])
  local held = {}
  for _, p in ipairs(policies_of(keys, argv, 0, true)) do
    local policy = p.policy
    local kept = '1'
    if policy.algorithm == lease then
      local s = { key = keys[p.first_key], window = policy.window, limit = policy.limit }
      local id = p.cost
      local score = tonumber(redis.call('ZSCORE', s.key, id))
      if score ~= nil and score < 0 then
        kept = '1'
      elseif (score ~= nil and score > now - s.window) or lease.prepare(s) then
        redis.call('ZADD', s.key, int(now), id)
        lease_keep(s)
      else
        kept = '0'
      end
    end
    held[#held + 1] = kept
  end
  return table.concat(held)
end

-- Under `maxmemory` with nothing left to evict, Redis refuses the
-- functions above before they start (they write), and every client would
-- meet its policy's fail mode. Their `allow-oom` twins, tried after such a
-- refusal, decide from the state that exists: a request that any existing
-- state denies (a live block, a full window under any one policy) is
-- denied, and blocked as its policy says (a block's key is a few bytes,
-- set only for a tracked client at its limit); one that fits is admitted
-- only when every one of its policies' state exists already, and
-- otherwise refused with NOT_HELD (its state would need new memory), for
-- its policies' fail modes to decide. A tracked client's state grows by
-- its admitted requests, as it would anyway, and pruning shrinks it: it
-- never holds more than its limit's records.

-- Whether the first key of each policy of a refund or settlement (its
-- arguments as `refund` takes them) exists.
local function refund_held(keys, argv)
  local settle = argv[2] == 'settle'
  for _, p in ipairs(policies_of(keys, argv, settle and 3 or 1, true, settle)) do
    if redis.call('EXISTS', keys[p.first_key]) == 0 then
      return false
    end
  end
  return true
end

-- The message of an error `pcall` caught: a Redis command's error, or
-- one raised with `error({ err = ... })`, arrives as a table.
local function error_message(caught)
  return type(caught) == 'table' and caught.err or tostring(caught)
end

-- The work (see `work`) after which a batch call decides no more of its
-- requests: the rest are answered DEFERRED, having read and written
-- nothing, and the store sends them in a call of their own. Each policy
-- of a request decided counts REQUEST_WORK besides its work in pages, so
-- a call holds Redis briefly whatever it holds: many requests on deep
-- logs, or a full batch on one hot log (about 20 of its requests), take
-- a few calls. The first request of a call is always decided.
local BATCH_WORK = 64
local REQUEST_WORK = 2
local DEFERRED = 'DEFERRED the call did its share of work: send this request again'

-- Decides several requests, in order, each all-or-nothing on its own, at
-- one time. ARGV[1] is the time as for `check`; ARGV[2] the number of
-- policies the call names, then each one's arguments as for `check`
-- without the cost (ARGS - 1 each); then, per request, its number of
-- policies, and per policy its place among those named (from 1) and the
-- request's cost. KEYS are the requests' keys in the same order. Returns
-- one entry per request: its integers as `check` returns them, or an
-- error of its own, which leaves the other requests' decisions standing
-- and writes nothing of its own.
local function check_batch(keys, argv, held_only)
  set_now(argv[1])
  local named = {}
  local next_arg = 3
  for i = 1, whole(argv[2], 0, 'count of policies') do
    named[i] = describe(argv, next_arg)
    next_arg = next_arg + ARGS - 1
  end
  -- Before any request is decided: each names policies the call named,
  -- and the keys are theirs.
  local key_total = 0
  local a = next_arg
  while a <= #argv do
    local count = whole(argv[a], 1, 'count of policies')
    for i = 1, count do
      local policy = named[whole(argv[a + 2 * i - 1], 1, 'policy')]
      if policy == nil then
        error('invalid policy ' .. tostring(argv[a + 2 * i - 1]))
      end
      key_total = key_total + key_count(policy)
    end
    a = a + 1 + 2 * count
  end
  if key_total ~= #keys then
    error('the requests name ' .. key_total .. ' keys, the call has ' .. #keys)
  end
  -- How many requests of the batch use each key: a log used again
  -- takes the general path first, whose state the next request takes
  -- (see `known`), rather than the fast path, which leaves none.
  local uses = {}
  for _, key in ipairs(keys) do
    uses[key] = (uses[key] or 0) + 1
  end
  -- One request's policies and costs, refilled for each.
  local policies, costs = {}, {}
  local replies = {}
  local next_key = 1
  while next_arg <= #argv do
    local count = tonumber(argv[next_arg])
    for i = 1, count do
      policies[i] = named[tonumber(argv[next_arg + 2 * i - 1])]
      costs[i] = argv[next_arg + 2 * i]
    end
    local ok, result, after = false, { err = DEFERRED }
    if #replies == 0 or work < BATCH_WORK then
      ok, result, after = pcall(decide, keys, next_key, count, policies, costs, false, held_only, uses)
    end
    if ok then
      replies[#replies + 1] = result
      next_key = after
      work = work + REQUEST_WORK * count
    else
      replies[#replies + 1] = redis.error_reply(error_message(result))
      -- Skip the failed request's keys.
      for i = 1, count do
        next_key = next_key + key_count(policies[i])
      end
    end
    next_arg = next_arg + 1 + 2 * count
  end
  write_logs()
  return replies
end

-- One call: a check, or a peek, refund, settlement or reset as ARGV[2] says (for a
-- check it is the first policy's algorithm).
local function main(keys, argv)
  if argv[2] == 'refund' or argv[2] == 'settle' then
    return refund(keys, argv)
  elseif argv[2] == 'reset' then
    return reset(keys, argv)
  elseif argv[2] == 'renew' then
    return renew(keys, argv)
  end
  return check(keys, argv, argv[2] == 'peek')
end

-- `main` when Redis is out of memory (see `NOT_HELD`): a check admits
-- only where its state exists, a refund runs only where every policy's
-- state does (it has nothing to give back otherwise), and a reset, which
-- only deletes, and a renewal, which rewrites a lease's time, always run.
local function held_main(keys, argv)
  if argv[2] == 'refund' or argv[2] == 'settle' then
    if not refund_held(keys, argv) then
      return redis.error_reply(NOT_HELD)
    end
  elseif argv[2] ~= 'reset' and argv[2] ~= 'renew' then
    local ok, result = pcall(check, keys, argv, argv[2] == 'peek', true)
    if ok then
      return result
    end
    return redis.error_reply(error_message(result))
  end
  return main(keys, argv)
end

-- `check_batch` when Redis is out of memory (see `NOT_HELD`).
local function held_batch(keys, argv)
  return check_batch(keys, argv, true)
end

return main(KEYS, ARGV)
