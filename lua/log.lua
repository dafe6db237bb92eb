-- The sliding log: the algorithm's functions (see the interface at the
-- top of `driver.lua`) over the storage of `log_pages.lua`, then its fast
-- path (`log_common`, beside the general path it stands in for), and the
-- writes the driver makes once a call (`log_flush`) and on a reset
-- (`log_reset`).
--
-- Keys: a string holding the log's header and newest page, then the name
-- its chunks of other pages are keyed by (with ":" and the chunk's
-- number); see `log_pages.lua`.

local log = {}

-- A log's header that `log_common` read for a request it left to the
-- general path, for `log_read` to take: the key and its bytes.
local header_key, header_read

-- A log's state, sized at once for every field it will hold (a field
-- set to nil in a constructor is still given its slot).
local function new_log(algorithm, key)
  return {
    algorithm = algorithm, key = key, limit = 0, window = 0, cost = 0, id = 0, burst = 0,
    block = 0, delay = 0, longest = 0, store = nil, fits = nil, blocked = nil, block_key = nil, pass = nil,
    recorded = nil, exists = nil, ow = nil, cw = nil, levels = nil, tail_page = nil,
    head_page = nil, head_index = nil, clean = nil, tail_count = nil, tail_base = nil,
    tail_sum = nil, sum = nil, oldest = nil, newest = nil, expires = nil, span = nil,
    pages = nil, found = nil, unwritten = nil, tail = nil, tail_view = nil, rewrite = nil,
    dirty = nil, header_size = nil, unlink_store = nil, in_window = nil, first_page = nil,
    first_index = nil, window_oldest = nil, pending = nil, ttl = nil, timed = nil,
    flat = nil,
  }
end

-- Starts the log afresh: nothing live, no span, no newest time. Its
-- pages are numbered on from the tail's number (the old log's sealed
-- pages, all below it, are deleted as those a head has passed are), by
-- one per page of records sealed: at least 83 records a page, 2^53 pages
-- before a number would lose precision. A log of the one-hash version
-- unlinks its hash (Redis frees a large one in the background, so this
-- holds it no longer than a small one) and starts in chunks, from 0.
local function log_clear(s)
  if s.flat then
    if s.tail_page > 0 or s.clean > 0 then
      s.unlink_store = true
    end
    s.flat, s.tail_page, s.clean = false, 0, 0
  end
  s.levels, s.head_page, s.head_index, s.tail_count, s.ow, s.cw = 0, s.tail_page, 0, 0, 4, 0
  s.tail_base, s.tail_sum, s.sum, s.oldest, s.newest, s.span = 0, 0, 0, 0, 0, 0
  s.tail, s.unwritten, s.tail_view, s.found = '', '', nil, nil
  s.rewrite, s.dirty = s.exists, true
end

-- A log that has never been written (or whose string is gone).
local function log_new(s)
  s.exists, s.flat, s.tail_page, s.clean, s.levels, s.expires = false, false, 0, 0, 0, 0
  log_clear(s)
end

-- Keeps the units of a log whose sealed pages have gone (see
-- `log_check_pages`).
local log_recover

-- Makes sure none of the live pages' chunks is gone (see `log_recover`).
local function log_check_pages(s)
  if s.tail_page == s.head_page then
    return
  end
  local lost
  if s.flat then
    lost = redis.call('EXISTS', s.store) == 0
  else
    local live = chunk_keys(s, chunk_of(s, s.head_page), chunk_of(s, s.tail_page - 1))
    lost = redis.call('EXISTS', unpack(live)) < #live
  end
  if lost then
    log_recover(s)
  end
end

-- Reads the header into `s`, and checks that its pages are there.
local function log_read(s)
  s.pages, s.found, s.unwritten = {}, nil, ''
  local header = header_read
  if header_key ~= s.key then
    header = redis.call('GETRANGE', s.key, 0, LOG_HEADER_SIZE - 1)
  end
  header_key = nil
  if header == '' then
    -- A new log. What a log whose string was evicted left in its chunks
    -- is never read (see `log_pages.lua`), and expires.
    log_new(s)
    log_check_pages(s)
    return
  end
  local version = string.byte(header, 1)
  local format
  s.flat = version ~= LOG_VERSION
  if version == LOG_VERSION or version == LOG_VERSION_FLAT then
    format, s.header_size = LOG_HEADER, LOG_HEADER_SIZE
  elseif version == 1 then
    format, s.header_size = LOG_HEADER_V1, LOG_HEADER_V1_SIZE
  else
    error('unknown sliding log format ' .. tostring(version) .. ' at ' .. s.key)
  end
  s.exists = true
  local _
  _, s.ow, s.cw, s.levels, s.tail_page, s.head_page, s.head_index, s.clean, s.tail_count,
    s.tail_base, s.tail_sum, s.sum, s.oldest, s.newest, s.expires, s.span = struct.unpack(format, header)
  if version == 1 then
    -- Rewritten whole in version 2's header.
    s.tail = tail_bytes(s)
    s.header_size, s.rewrite, s.dirty = LOG_HEADER_SIZE, true, true
  end
  log_check_pages(s)
end

local function log_header(s)
  return struct.pack(
    LOG_HEADER, s.flat and LOG_VERSION_FLAT or LOG_VERSION, s.ow, s.cw, s.levels, s.tail_page, s.head_page, s.head_index,
    s.clean, s.tail_count, s.tail_base, s.tail_sum, s.sum, s.oldest, s.newest, s.expires, s.span
  )
end

-- Drops records that `span` has passed over; an empty log starts afresh.
local function log_prune(s)
  if s.sum == 0 or s.oldest > now - s.span then
    return
  end
  local m, i = live_from(s, seek(s, now - s.span))
  if m == nil then
    log_clear(s)
    return
  end
  s.sum = s.sum - sum_before(s, m, i)
  s.head_page, s.head_index = m, i
  s.oldest = time_at(s, m, i)
  s.dirty, s.found = true, nil
end

-- The clock has stepped back by more than a window since the newest
-- record: the live count is gathered into one record at `now`, so it is
-- kept, and leaves within a span of the new time.
local function log_gather(s)
  local sum, span = s.sum, s.span
  log_clear(s)
  s.span = span
  s.cw = sum == 1 and 0 or total_width(sum)
  s.tail, s.tail_count, s.tail_sum = encode(now, 4, s.cw, now, sum), 1, sum
  s.tail_base, s.sum, s.oldest, s.newest = now, sum, now, now
  s.rewrite, s.dirty = true, true
end

-- Whether `log.prepare` changes the log state `s` of this call for a
-- request of `policy`: records to prune, a clock step back to gather, or
-- a longer span.
local function log_changes(s, policy)
  return s.sum > 0
    and (s.oldest <= now - s.span or s.newest - now > policy.window + MAX_DELAY
      or policy.span > s.span)
end

-- Brings the log (as this call last left it, see `prepare` in
-- `driver.lua`, or else its
-- header) up to `now`, and finds the window's count.
function log.prepare(s)
  if s.pages == nil then
    log_read(s)
  end
  log_prune(s)
  -- Records of requests held for a delay (of any policy of theirs) lie
  -- ahead of `now`, by at most MAX_DELAY; only a newest record beyond
  -- those is a clock that stepped back.
  if s.sum > 0 and s.newest - now > s.window + MAX_DELAY then
    log_gather(s)
  end
  if s.sum > 0 and s.longest > s.span then
    s.span, s.dirty = s.longest, true
    -- Every live chunk is kept as long as the longer span asks.
    if s.tail_page > s.head_page and not s.flat then
      for _, key in ipairs(chunk_keys(s, chunk_of(s, s.head_page), chunk_of(s, s.tail_page - 1))) do
        log_time(s, key)
      end
      s.ttl = nil
    end
  end
  -- The window's share: from its first record on.
  s.in_window, s.first_page, s.first_index = s.sum, s.head_page, s.head_index
  if s.sum > 0 and s.window < s.span and s.oldest <= now - s.window then
    local m, i = live_from(s, seek(s, now - s.window))
    if m == nil then
      s.in_window = 0
    else
      s.first_page, s.first_index = m, i
      s.in_window = sum_from(s, m, i)
    end
  end
  if s.first_page == s.head_page and s.first_index == s.head_index then
    s.window_oldest = s.oldest
  elseif s.in_window > 0 then
    s.window_oldest = time_at(s, s.first_page, s.first_index)
  end
  return s.in_window + s.cost <= s.limit
end

-- When a log whose newest record is at `newest` expires, two spans past
-- it, and the TTL in milliseconds that gives its keys.
local function log_expiry(newest, span)
  local expires = newest + 2 * span
  return expires, math.floor((expires - now) / 1000) + 1 + expiry_grace_ms
end

-- Sets `expires` two spans past the newest record and returns the TTL in
-- milliseconds to set on both keys.
local function log_extend(s)
  local ttl
  s.expires, ttl = log_expiry(s.newest, s.span)
  return ttl
end

-- Writes what this request changed, except the header, which is written
-- once for the call (see `write_logs`).
local function log_write(s)
  if s.unlink_store then
    redis.call('UNLINK', s.store)
    s.unlink_store = false
  end
  if not s.exists then
    return
  end
  log_clean(s)
  if s.expires < s.newest + s.span or s.timed ~= nil and s.ttl == nil then
    s.ttl = log_extend(s)
  end
  s.pending = s.pending or s.dirty or s.rewrite
end

-- A chunk of the sealed pages of a log whose live records lie partly in
-- them has gone (Redis evicted it under a `maxmemory-policy` that may, or
-- something deleted it), while its header, which says how many units they
-- hold, stays: they are kept, gathered into one record at the latest time
-- any of them can have been recorded at (just before the tail's first
-- record, or the newest record when the tail is empty), so that none
-- leaves the window earlier than it would have and the client is never
-- admitted past its limit. The tail's records follow it, in a log
-- started afresh (the chunks left are deleted as a head's are). Bounded:
-- the tail is at most one page of records.
log_recover = function(s)
  local tail = page(s, s.tail_page)
  local records, before = {}, 0
  for i = 0, tail.count - 1 do
    local time, total = record_at(tail, i)
    records[i + 1] = { time, total - before }
    before = total
  end
  local sum, span, newest = s.sum, s.span, s.newest
  local gathered, at = sum - s.tail_sum, newest
  if #records > 0 then
    at = records[1][1] - 1
  end
  log_clear(s)
  -- A hash of the one-hash version is gone: nothing is left to unlink.
  s.unlink_store, s.span = false, span
  if gathered > 0 then
    log_append(s, at, gathered)
  end
  for _, record in ipairs(records) do
    log_append(s, record[1], record[2])
  end
  s.sum, s.newest = sum, newest
  s.oldest = #records > 0 and gathered == 0 and records[1][1] or at
end

-- The window only loses units as time passes: a request that fits it at
-- its retry time fits it at any later time (a cost above the limit never
-- does).
function log.fits_at(s, time)
  return s.cost <= s.limit
end

-- The time a request passing at `pass` is recorded at: then, or one
-- microsecond after the newest record, if that is later.
local function record_time(s, pass)
  if s.sum > 0 and s.newest >= pass then
    return s.newest + 1
  end
  return pass
end

-- Makes sure the keys of pages the request's writes on `s` go to are
-- hashes (or none), so that none fails after another policy of the
-- request has written: those a seal writes (see `seal_keys`), when
-- recording the request (passing at `pass`, nil for one not recorded)
-- seals the tail, and the head's chunk, when pages the head has left are
-- deleted (see `log_clean`). Reads nothing when the request writes no
-- page, as most do. A refund (`any`) checks the tail's, the next and the
-- head's chunks.
local function log_check_writes(s, pass, any)
  local writes = {}
  if any then
    writes[1] = page_key(s, s.tail_page)
    writes[2] = page_key(s, s.tail_page + 1)
  elseif pass ~= nil and s.cost > 0 and s.tail_count > 0
      and tail_fit(s, record_time(s, pass), s.cost) then
    writes = seal_keys(s)
  end
  if any or (s.exists and s.clean < s.head_page) then
    writes[#writes + 1] = page_key(s, s.head_page)
  end
  local checked = {}
  for _, key in ipairs(writes) do
    if not checked[key] then
      checked[key] = true
      local kind = redis.call('TYPE', key)['ok']
      if kind ~= 'hash' and kind ~= 'none' then
        error({ err = 'WRONGTYPE the pages of sliding log ' .. s.key .. ' are a ' .. kind })
      end
    end
  end
end

function log.record(s)
  if s.cost == 0 then
    log_write(s)
    return
  end
  local time = record_time(s, s.pass)
  if not s.exists then
    -- The string starts with its header.
    s.exists, s.tail, s.rewrite = true, '', true
  end
  log_append(s, time, s.cost)
  if s.sum == 0 then
    s.head_page, s.head_index, s.oldest, s.span = s.tail_page, s.tail_count - 1, time, s.longest
  end
  if s.in_window == 0 then
    s.window_oldest = time
  end
  s.sum, s.in_window, s.newest = s.sum + s.cost, s.in_window + s.cost, time
  s.recorded, s.dirty, s.found = time, true, nil
  log_write(s)
end

-- Removes record i of page m, of `cost`, and takes it out of the counts.
local function log_remove(s, m, i, cost)
  local v = page(s, m)
  local parts = { string.sub(v.bytes, v.start, v.start + i * v.size - 1) }
  if v.cw == 0 then
    parts[2] = string.sub(v.bytes, v.start + (i + 1) * v.size)
  else
    for r = i + 1, v.count - 1 do
      local time, total = record_at(v, r)
      parts[#parts + 1] = encode(v.base, v.ow, v.cw, time, total - cost)
    end
  end
  local bytes = table.concat(parts)
  if m == s.tail_page then
    s.tail, s.unwritten, s.tail_view, s.rewrite = bytes, '', nil, true
    s.tail_count, s.tail_sum = s.tail_count - 1, s.tail_sum - cost
  else
    local value = struct.pack(PAGE_HEADER, v.base, v.ow, v.cw) .. bytes
    pages_call(PAGE_WORK, 'HSET', page_key(s, m), int(m), value)
    s.pages[m] = view(v.base, v.ow, v.cw, value, PAGE_HEADER_SIZE + 1)
    tree_add(s, m, -cost)
  end
  s.sum, s.dirty, s.found = s.sum - cost, true, nil
  if s.sum == 0 then
    log_clear(s)
  elseif m == s.head_page and i == s.head_index then
    s.head_page, s.head_index = live_from(s, m, i)
    s.oldest = time_at(s, s.head_page, s.head_index)
  end
end

-- Takes back `cost` units recorded at `at`: the record of that time, if
-- it is still live and of that cost. Nothing otherwise (it has left the
-- window, or was taken back already, or the log was reset). Returns
-- whether a settlement counts its final units: where it found the
-- record, or where `at` is still in the window (a log reset or lost
-- since); not where the reserved units have left the window, which a
-- late settlement would count again (it counts only what the request
-- cost beyond them).
function log.refund(s, at, cost)
  local found = false
  if s.sum > 0 and at >= s.oldest and at <= s.newest then
    local m, i = live_from(s, seek(s, at - 1))
    if m ~= nil then
      local v = page(s, m)
      local time, total = record_at(v, i)
      if time == at and total - total_before(v, i) == cost then
        log_remove(s, m, i, cost)
        found = true
      end
    end
  end
  log_write(s)
  return found or at > now - s.window
end

-- When enough units leave the window for the request to fit: the record
-- at which the window's oldest units reach what it is short of. A cost
-- above the limit never fits: the window.
function log.retry(s)
  local need = s.in_window + s.cost - s.limit
  if need > s.in_window then
    return s.window
  end
  -- A flood of one client's requests in one call asks the same.
  local asked = int(s.first_page) .. ':' .. int(s.first_index) .. ':' .. int(need)
  local found = s.found
  if found == nil then
    found = {}
    s.found = found
  end
  local time = found[asked]
  if time == nil then
    time = time_at(s, find_units(s, s.first_page, s.first_index, need))
    found[asked] = time
  end
  return time + s.window - now
end

function log.save(s)
  log_write(s)
end

function log.remember(s)
  s.dirty = false
  known[s.key] = s
end

-- The units left under `limit` with `in_window` counted in `window`,
-- the oldest of them at `oldest`, and when the window resets (µs).
local function log_report(limit, in_window, oldest, window)
  local remaining = limit - in_window
  if remaining < 0 then
    remaining = 0
  end
  if in_window == 0 then
    return remaining, 0
  end
  return remaining, oldest + window - now
end

function log.report(s)
  return log_report(s.limit, s.in_window, s.window_oldest, s.window)
end

---------------------------------------------------------------- fast path
--
-- `log_common` and `log_again` stand in for the general path above (the
-- driver's `decide` with `log.prepare`, `log.record` and `log.report`)
-- in its most frequent case, with the same result and writes. They share
-- its format, its searches and its expiry (`view`, `search_time`,
-- `encode`, `log_expiry`, `log_report`) but hold the header in locals,
-- not in a state table: a change to what the general path records or
-- writes is a change here too, and `tests/it/equivalence.rs` holds both
-- paths to the memory store's model.

-- `log_common` for a log an earlier request of this call has prepared
-- (`s`, see `known`), which this one admits without changing it first
-- (nothing to prune, no clock step back, the same span) under a window
-- as long as its span: recorded as the general path records it.
local function log_again(s, policy, cost)
  local window = policy.window
  cost = tonumber(cost)
  if s.algorithm ~= log or cost == 0 or s.sum == 0 or window ~= s.span
    or log_changes(s, policy) or s.sum + cost > policy.limit then
    return nil
  end
  s.limit, s.window, s.cost, s.pass = policy.limit, window, cost, now
  s.in_window, s.window_oldest = s.sum, s.oldest
  log.record(s)
  log.remember(s)
  local remaining, reset = log.report(s)
  return struct.pack(DECISION, 1, remaining, reset, -1, s.recorded)
end

-- The common case, decided on its own, as the general path would decide
-- it but without its tables: a request of one sliding-log policy that
-- neither blocks nor delays, admitted by a log whose live records all lie
-- in its tail, which takes the record without being sealed or widened
-- (or by a log this call has prepared already, see `log_again`). Most
-- requests of a client below its limit are this case. Returns the five
-- integers of the admitted request, its record written; or nil, having
-- written nothing, for any other case, which the general path then
-- decides.
local function log_common(keys, k, policy, cost)
  local key = keys[k]
  if policy.algorithm ~= log or policy.block > 0 or policy.delay > 0 then
    return nil
  elseif known[key] ~= nil then
    return log_again(known[key], policy, cost)
  end
  local header = redis.call('GETRANGE', key, 0, LOG_HEADER_SIZE - 1)
  header_key, header_read = key, header
  local version = string.byte(header, 1)
  if version ~= LOG_VERSION and version ~= LOG_VERSION_FLAT then
    return nil
  end
  local _, ow, cw, levels, tail_page, head_page, head_index, clean, tail_count,
    tail_base, tail_sum, sum, oldest, newest, expires, span = struct.unpack(LOG_HEADER, header)
  local limit, window = policy.limit, policy.window
  cost = tonumber(cost)
  if tail_page ~= head_page or clean ~= head_page or sum == 0 or cost == 0
    or newest - now > window + MAX_DELAY or window < span or policy.span > window then
    return nil
  end
  local size = ow + cw
  if oldest <= now - span then
    -- Pruned within the tail: from the record before the head (whose
    -- running total is the head's total before it), to the last.
    local from = head_index
    if cw > 0 and from > 0 then
      from = from - 1
    end
    local records = view(tail_base, ow, cw, redis.call(
      'GETRANGE', key, LOG_HEADER_SIZE + from * size, LOG_HEADER_SIZE + tail_count * size - 1
    ), 1)
    local live = search_time(records, head_index - from, now - span)
    if live == records.count then
      return nil
    end
    sum = sum - (total_before(records, live) - total_before(records, head_index - from))
    head_index, oldest = from + live, (record_at(records, live))
  end
  if window > span then
    span = window
  end
  if sum + cost > limit then
    return nil
  end
  local time = now
  if newest >= time then
    time = newest + 1
  end
  local width = offset_width(time - tail_base)
  if width == nil or width > ow or (cw == 0 and cost ~= 1) or (cw > 0 and total_width(tail_sum + cost) > cw)
    or (tail_count + 1) * size > PAGE_BYTES then
    return nil
  end
  redis.call('APPEND', key, encode(tail_base, ow, cw, time, tail_sum + cost))
  tail_count, tail_sum, sum, newest = tail_count + 1, tail_sum + cost, sum + cost, time
  local ttl
  if expires < newest + span then
    expires, ttl = log_expiry(newest, span)
  end
  redis.call('SETRANGE', key, 0, struct.pack(
    LOG_HEADER, version, ow, cw, levels, tail_page, head_page, head_index,
    clean, tail_count, tail_base, tail_sum, sum, oldest, newest, expires, span
  ))
  if ttl ~= nil then
    -- Every page lies in the tail: what the pages' keys hold is no longer
    -- read, and expires as it was set to.
    redis.call('PEXPIRE', key, ttl)
  end
  header_key = nil
  local remaining, reset = log_report(limit, sum, oldest, window)
  return struct.pack(DECISION, 1, remaining, reset, -1, time)
end

-- Unlinks the chunks of the log at `key` whose pages key is `store`, from
-- the first the log has not deleted to its tail's.
local function log_reset(key, store)
  local header = redis.call('GETRANGE', key, 0, LOG_HEADER_SIZE - 1)
  if string.byte(header, 1) ~= LOG_VERSION then
    return
  end
  local s = { flat = false, store = store }
  local _, _, _, _, tail_page, _, _, clean = struct.unpack(LOG_HEADER, header)
  for _, chunk in ipairs(chunk_keys(s, chunk_of(s, clean), chunk_of(s, tail_page))) do
    redis.call('UNLINK', chunk)
  end
end

-- Writes a log's header (and its tail, if this call rewrote it) and its
-- TTL, once per call.
local function log_flush(s)
  if not s.pending then
    return
  end
  s.pending = false
  if not s.exists then
    return
  end
  if s.rewrite then
    redis.call('SET', s.key, log_header(s) .. s.tail, 'KEEPTTL')
    s.rewrite, s.tail = false, nil
  else
    if s.unwritten ~= '' then
      redis.call('APPEND', s.key, s.unwritten)
      s.unwritten = ''
    end
    redis.call('SETRANGE', s.key, 0, log_header(s))
  end
  if s.ttl ~= nil then
    redis.call('PEXPIRE', s.key, s.ttl)
    if s.flat then
      -- The one hash holds every page: it lives as long as the string.
      redis.call('PEXPIRE', s.store, s.ttl)
    else
      for key in pairs(s.timed or {}) do
        redis.call('PEXPIRE', key, s.ttl)
      end
    end
    s.ttl, s.timed = nil, nil
  end
end
