#!lua
-- One request's rate-limit check: one or more policies, each with its own
-- algorithm, decided all-or-nothing in one atomic call.
--
-- The shebang above (Redis 7 and later) declares a script that writes and
-- may not run out of memory: under `maxmemory` Redis refuses the call
-- before it starts. As a function library, the script also has
-- `allow-oom` twins for clients Redis already holds (see `NOT_HELD`), so
-- that only new clients meet their policies' fail modes when Redis is
-- full; a held client's state grows only by its own admitted requests
-- (a log may open a chunk of pages), and shrinks as they leave its window.
--
-- ARGV[1]: the time in microseconds, or "" to read the server's TIME (the
--   empty form is the only one production uses).
-- ARGV, per policy (ARGS = 8 each, from ARGV[2]): algorithm ("log",
--   "counter", "fixed", "bucket", "lease", or a calendar period: "day",
--   "week", "month" or "year"), limit, window in microseconds (a lease's
--   time for "lease"; for a calendar, its offset from UTC in µs, east
--   positive), burst (a bucket's size;
--   the limit otherwise), block in microseconds (0: none), delay in
--   microseconds (0: none), span (a log's: the longest window in µs its
--   policy's tiers count it under; 0 otherwise), and the request's cost
--   (a lease's id for "lease"). A denial the delay can hold (its retry time within it) is
--   no denial for the block, which only a request beyond the delay
--   starts. A batch call names each policy once (see `check_batch`).
-- KEYS, taken in policy order:
--   log:     a string holding the log's header and newest page, then the
--            name its chunks of other pages are keyed by (with ":" and
--            the chunk's number; see "sliding log" below).
--   counter: a hash with the current window id `w`, its count `c`, the
--            previous window's count `p`, the window length `l` (windows
--            in milliseconds), `t`, the latest time (µs) a request was
--            counted at, and `n`, the units of requests held for their
--            delay into the next window.
--   fixed:   a hash with the window id `w`, its count `c`, `t`, the
--            window length `l` in µs, and `n` as for a counter.
--   bucket:  a 48-byte string (see "token bucket" below).
--   lease:   a sorted set of leases (see "leases" below).
--   day, week, month, year: a 16-byte string (see "calendar" below).
--   then, for a policy that blocks, a string holding the time (µs) until
--   which the client is blocked: set when the policy's own count denies
--   a request, and read before it, so that every request meanwhile is
--   denied.
--
-- The counters place `now` no earlier than `t`: a clock that steps back
-- (NTP, a failover to a skewed node) never takes a key back to an earlier
-- window, which would forget its count. A step back of more than a window
-- carries the counts into the window of the new time instead. Waits are
-- still measured from the real `now`. When a key's window length changes
-- (a tier with a window of its own), its counts are re-placed under the
-- new length, never dropped early. (The sliding log has rules of its own
-- for both; see "sliding log" below.)
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
-- The same script peeks, refunds and resets when ARGV[2] says so (see
-- `main` at the end).
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

---------------------------------------------------------------- sliding log
--
-- Every call does bounded work, whatever the limit, the costs, the window
-- or the time since the last call: the log is split into pages of at most
-- PAGE_BYTES of records, and the sums of whole pages are kept in a tree,
-- so that pruning, a window's count, the time enough units leave, and a
-- refund each read O(log pages) fields and rewrite at most one page.
--
-- Keys per client and policy:
-- * a string: the header (LOG_HEADER, below), then the records of the
--   newest page, the *tail*, which a request appends to;
-- * once the log outgrows one page, hashes of sealed pages, CHUNK_PAGES
--   pages to a hash (*chunk* c, the pages key's name then ":c", holds
--   pages c*CHUNK_PAGES to (c+1)*CHUNK_PAGES - 1): each full page sealed
--   under its number (a 10-byte page header, PAGE_HEADER, then its
--   records), and the tree of page sums: field "k:j" holds the sum of
--   pages j*2^k to (j+1)*2^k - 1, for k from 0 to the header's `levels`,
--   in the chunk of its first page. No key is large, so none holds Redis
--   long when it frees it, whatever `lazyfree-*` says (a hash of a
--   million-record log took 8 ms to free as it expired).
--
-- A block of the tree is read only while its first page is live (every
-- block read starts at or after the head's page), so a chunk is no
-- longer read once the head has left it: the pages in the head's chunk
-- are deleted as the head passes them, and the chunks below it whole.
-- Every field read was written by the log as it is now, since it last
-- started afresh (a page when it is sealed, a block when its first page
-- is, or when the tree grows a level), never by a log before it: pages
-- are numbered on from where an emptied log stopped, and a log whose
-- string Redis evicted numbers from 0 again but writes each field before
-- it reads it. A chunk expires two spans past the newest record of the
-- last page sealed in it (or when the span grows, past the log's newest
-- record), so it outlives every record it holds.
--
-- Format version 2 kept every sealed page and block in the one hash of
-- the pages key. Such a log is read and written as it is until it
-- empties, and starts afresh in the current version.
--
-- A record is its time as an offset from its page's base (4 or 6 bytes),
-- then the running total of cost in its page up to and including it (0,
-- 2, 4 or 6 bytes; with 0 bytes every cost is 1 and the total is the
-- record's position). Records are in time order and their times are
-- unique: a request is recorded at `now`, or one microsecond after the
-- newest record if that is later, so a refund names exactly one record.
-- The tail widens its fields in place when a record needs it (at most one
-- page rewritten); a page, once sealed, keeps its widths.
--
-- Header fields (big-endian): format version (3, as LOG_VERSION), the tail's offset and
-- total widths, `levels`; the tail's page number, the head's (the oldest
-- live record's) page and index in it, `clean` (pages below it have been
-- deleted); the tail's record count; then u64 the tail's
-- base time, the tail's sum, `sum` (every live record's cost), `oldest`
-- and `newest` (µs), `expires` (when the string's TTL, last set, runs out)
-- and `span`: the longest window the log has been counted under since it
-- was last empty. Records leave once `span` has passed over them, so
-- tiers with different windows each see every request their own window
-- covers; a log left empty starts afresh.
--
-- Pages below the head are deleted a few at a time (CLEAN_PAGES pages,
-- or CLEAN_CHUNKS whole chunks, per call), the pages of a log that has
-- emptied included; the string expires two spans past the newest record.

-- One policy's five integers in a reply.
local DECISION = '>i8i8i8i8i8'

local LOG_VERSION = 3
-- The version that kept every page in one hash (see above).
local LOG_VERSION_FLAT = 2
-- The longest delay a policy may have (policy validation holds it), µs.
local MAX_DELAY = 60000000
local LOG_HEADER = '>BBBBI8I8I2I8I2I8I8I8I8I8I8I8'
local LOG_HEADER_SIZE = 88
-- Version 1 numbered pages in 4 bytes, in one hash as version 2 does;
-- such a log is read, and rewritten in version 2 by the call that reads
-- it.
local LOG_HEADER_V1 = '>BBBBI4I4I2I4I2I8I8I8I8I8I8I8'
local LOG_HEADER_V1_SIZE = 76
local PAGE_HEADER = '>I8BB'
local PAGE_HEADER_SIZE = 10
-- Records per page: a sealed page (with its header) fits a 1 KiB
-- allocation in Redis.
local PAGE_BYTES = 1000
-- Pages below the head whose fields one call deletes, at most.
local CLEAN_PAGES = 8
-- Sealed pages to a chunk: a chunk of full pages holds 64 KiB of records
-- in 64 pages and 127 blocks of the tree (and one more per level above
-- the sixth), which Redis frees in well under a millisecond.
local CHUNK_PAGES = 64
-- Chunks wholly below the head that one call unlinks, at most.
local CLEAN_CHUNKS = 4

local log = {}

-- A log's header that `log_common` read for a request it left to the
-- general path, for `log_read` to take: the key and its bytes.
local header_key, header_read

local function int(n)
  return string.format('%d', n)
end

-- The number of the chunk that holds page n, and the blocks of the tree
-- that start at it (always 0 for a log of the one-hash version).
local function chunk_of(s, n)
  if s.flat then
    return 0
  end
  return math.floor(n / CHUNK_PAGES)
end

-- The key of chunk c.
local function chunk_key(s, c)
  if s.flat then
    return s.store
  end
  return s.store .. ':' .. int(c)
end

-- The key that holds page n.
local function page_key(s, n)
  return chunk_key(s, chunk_of(s, n))
end

-- Has the TTL of the chunk keyed `key` set with the string's, when the
-- call writes the log (see `log_flush`).
local function log_time(s, key)
  if s.timed == nil then
    s.timed = {}
  end
  s.timed[key] = true
end

-- The keys of chunks `from` to `to`.
local function chunk_keys(s, from, to)
  local keys = {}
  for c = from, to do
    keys[#keys + 1] = chunk_key(s, c)
  end
  return keys
end

-- The bytes a running total of `total` needs.
local function total_width(total)
  if total < 65536 then
    return 2
  elseif total < 4294967296 then
    return 4
  end
  return 6
end

-- The bytes an offset of `offset` needs, or nil past 6.
local function offset_width(offset)
  if offset < 4294967296 then
    return 4
  elseif offset < 281474976710656 then
    return 6
  end
  return nil
end

local function record_format(ow, cw)
  if cw == 0 then
    return '>I' .. ow
  end
  return '>I' .. ow .. 'I' .. cw
end

local function encode(base, ow, cw, time, total)
  if cw == 0 then
    return struct.pack(record_format(ow, cw), time - base)
  end
  return struct.pack(record_format(ow, cw), time - base, total)
end

-- A page as read: its records in `bytes` from position `start` (1-based).
local function view(base, ow, cw, bytes, start)
  local size = ow + cw
  return {
    base = base, ow = ow, cw = cw, size = size, bytes = bytes, start = start,
    count = math.floor((#bytes - start + 1) / size),
    format = record_format(ow, cw),
  }
end

-- Record i's (0-based) time and running total.
local function record_at(v, i)
  local offset, total = struct.unpack(v.format, v.bytes, v.start + i * v.size)
  if v.cw == 0 then
    total = i + 1
  end
  return v.base + offset, total
end

-- The page's total of cost before record i.
local function total_before(v, i)
  if i == 0 then
    return 0
  elseif v.cw == 0 then
    return i
  end
  local _, total = record_at(v, i - 1)
  return total
end

local function page_total(v)
  return total_before(v, v.count)
end

-- The first record from `from` whose running total reaches `target`.
local function search_total(v, from, target)
  local lo, hi = from, v.count - 1
  if v.cw == 0 then
    return math.max(from, target - 1)
  end
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local _, total = record_at(v, mid)
    if total >= target then
      hi = mid
    else
      lo = mid + 1
    end
  end
  return lo
end

-- The first record from `from` later than `x` (the page's count if none).
local function search_time(v, from, x)
  local lo, hi = from, v.count
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if record_at(v, mid) <= x then
      lo = mid + 1
    else
      hi = mid
    end
  end
  return lo
end

-- The tail's record bytes: kept in Lua once this call rewrites the
-- string, else read from it, followed by the records this call has
-- appended and not yet written (`unwritten`, see `log_flush`).
local function tail_bytes(s)
  if s.tail ~= nil then
    return s.tail
  end
  local written = s.tail_count * (s.ow + s.cw) - #s.unwritten
  if written == 0 then
    return s.unwritten
  end
  local first = s.header_size or LOG_HEADER_SIZE
  return redis.call('GETRANGE', s.key, first, first + written - 1) .. s.unwritten
end

-- Page `n` as a view; sealed pages are cached for the rest of the call.
local function page(s, n)
  if n == s.tail_page then
    if s.tail_view == nil then
      s.tail_view = view(s.tail_base, s.ow, s.cw, tail_bytes(s), 1)
    end
    return s.tail_view
  end
  local v = s.pages[n]
  if v == nil then
    local bytes = pages_call(PAGE_WORK, 'HGET', page_key(s, n), int(n))
    if not bytes then
      error('sliding log ' .. s.key .. ' has lost its page ' .. int(n))
    end
    local base, ow, cw = struct.unpack(PAGE_HEADER, bytes)
    v = view(base, ow, cw, bytes, PAGE_HEADER_SIZE + 1)
    s.pages[n] = v
  end
  return v
end

local function node(k, j)
  return int(k) .. ':' .. int(j)
end

-- The tree's blocks that make up sealed pages a..b, in order.
local function blocks(s, a, b)
  local list = {}
  local lo, hi = a, b + 1
  while lo < hi do
    local k = 0
    while k < s.levels and lo % 2 ^ (k + 1) == 0 and lo + 2 ^ (k + 1) <= hi do
      k = k + 1
    end
    list[#list + 1] = { k, lo / 2 ^ k }
    lo = lo + 2 ^ k
  end
  return list
end

-- The key that holds block (k, j): the chunk of its first page.
local function node_key(s, k, j)
  return page_key(s, j * 2 ^ k)
end

-- The sums of the blocks in `list`, read a chunk at a time (the blocks
-- are in order, so a chunk's are side by side).
local function block_sums(s, list)
  local sums = {}
  local i = 1
  while i <= #list do
    local key = node_key(s, list[i][1], list[i][2])
    local fields = {}
    while i + #fields <= #list and node_key(s, list[i + #fields][1], list[i + #fields][2]) == key do
      local block = list[i + #fields]
      fields[#fields + 1] = node(block[1], block[2])
    end
    local read = pages_call(#fields, 'HMGET', key, unpack(fields))
    for n = 1, #read do
      sums[i] = tonumber(read[n]) or 0
      i = i + 1
    end
  end
  return sums
end

-- The total cost in sealed pages a..b.
local function tree_sum(s, a, b)
  if a > b then
    return 0
  end
  local total = 0
  for _, sum in ipairs(block_sums(s, blocks(s, a, b))) do
    total = total + sum
  end
  return total
end

-- The first sealed page in a..b at which the running total from a
-- reaches `need`, and the total before it; or nil and the whole total.
local function tree_find(s, a, b, need)
  if a > b then
    return nil, 0
  end
  local list = blocks(s, a, b)
  local sums = block_sums(s, list)
  local before = 0
  for i, block in ipairs(list) do
    if before + sums[i] >= need then
      local k, j = block[1], block[2]
      while k > 0 do
        k = k - 1
        local left = tonumber(pages_call(1, 'HGET', node_key(s, k, 2 * j), node(k, 2 * j))) or 0
        if before + left >= need then
          j = 2 * j
        else
          before, j = before + left, 2 * j + 1
        end
      end
      return j, before
    end
    before = before + sums[i]
  end
  return nil, before
end

-- Adds `delta` to sealed page n's sum, at every level of the tree, in
-- the blocks that may still be read (those that start at the head's page
-- or later). A block that starts at page n is set, not added to, when the
-- page is sealed (`sealed`): it may hold a sum that a log before this one
-- left in its chunk.
local function tree_add(s, n, delta, sealed)
  for k = 0, s.levels do
    local j = math.floor(n / 2 ^ k)
    local first = j * 2 ^ k
    if first >= s.head_page then
      local command = (sealed and first == n) and 'HSET' or 'HINCRBY'
      pages_call(1, command, node_key(s, k, j), node(k, j), int(delta))
    end
  end
end

-- The position of the first live record later than `x`: a page and an
-- index in it, which may be the page's count (the next page's start).
local function seek(s, x)
  if s.oldest > x then
    return s.head_page, s.head_index
  end
  -- Pruning moves the head a few records at a time: the head's page, or
  -- the next one, most often holds the position.
  local head = page(s, s.head_page)
  if s.head_page == s.tail_page or record_at(head, head.count - 1) > x then
    return s.head_page, search_time(head, s.head_index, x)
  end
  local lo, hi = s.head_page + 1, s.tail_page
  -- An empty tail's base is stale: it holds nothing earlier than x.
  if lo == hi and s.tail_count == 0 or page(s, lo).base > x then
    return s.head_page, head.count
  end
  while lo < hi do
    local mid = lo + math.ceil((hi - lo) / 2)
    -- An empty tail's base is stale: it holds nothing earlier than x.
    if (mid ~= s.tail_page or s.tail_count > 0) and page(s, mid).base <= x then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo, search_time(page(s, lo), 0, x)
end

-- The live record at or after position (m, i), or nil if there is none.
local function settle(s, m, i)
  if m ~= s.tail_page then
    if i < page(s, m).count then
      return m, i
    end
    local q = tree_find(s, m + 1, s.tail_page - 1, 1)
    if q ~= nil then
      return q, 0
    end
    i = 0
  end
  if i < s.tail_count then
    return s.tail_page, i
  end
  return nil
end

-- The cost of live records from position (m, i) on.
local function sum_from(s, m, i)
  local v = page(s, m)
  local part = page_total(v) - total_before(v, i)
  if m == s.tail_page then
    return part
  end
  return part + tree_sum(s, m + 1, s.tail_page - 1) + s.tail_sum
end

-- The record at which the cost of live records from position (m, i)
-- reaches `need`: its page and index; nil if they hold less.
local function find_units(s, m, i, need)
  if m ~= s.tail_page then
    local v = page(s, m)
    local before = total_before(v, i)
    local part = page_total(v) - before
    if part >= need then
      return m, search_total(v, i, before + need)
    end
    need = need - part
    local q, sealed = tree_find(s, m + 1, s.tail_page - 1, need)
    if q ~= nil then
      return q, search_total(page(s, q), 0, need - sealed)
    end
    need, i = need - sealed, 0
  end
  local v = page(s, s.tail_page)
  local target = total_before(v, i) + need
  if page_total(v) < target then
    return nil
  end
  return s.tail_page, search_total(v, i, target)
end

-- The cost of live records from the head up to position (m, i), at or
-- after it: what leaves when the head moves there.
local function sum_before(s, m, i)
  local head = page(s, s.head_page)
  local before = total_before(head, s.head_index)
  if m == s.head_page then
    return total_before(head, i) - before
  end
  return page_total(head) - before + tree_sum(s, s.head_page + 1, m - 1) + total_before(page(s, m), i)
end

local function time_at(s, m, i)
  return (record_at(page(s, m), i))
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

-- Keeps the units of a log whose sealed pages have gone (see `log_read`).
local log_recover

-- Makes sure the keys a log's pages go in are hashes (or none), so that
-- no later write of the call fails on one after another key was written,
-- and that none of the live pages' chunks is gone.
local function log_check_pages(s)
  local writes = { page_key(s, s.tail_page) }
  if page_key(s, s.tail_page + 1) ~= writes[1] then
    -- A call seals at most two pages: the next may start a chunk.
    writes[2] = page_key(s, s.tail_page + 1)
  end
  local kinds = {}
  for i, key in ipairs(writes) do
    kinds[i] = redis.call('TYPE', key)['ok']
    if kinds[i] ~= 'hash' and kinds[i] ~= 'none' then
      error({ err = 'WRONGTYPE the pages of sliding log ' .. s.key .. ' are a ' .. kinds[i] })
    end
  end
  if s.tail_page == s.head_page then
    return
  end
  local lost = kinds[1] == 'none'
  if not s.flat then
    local live = chunk_keys(s, chunk_of(s, s.head_page), chunk_of(s, s.tail_page - 1))
    lost = redis.call('EXISTS', unpack(live)) < #live
  end
  if lost then
    log_recover(s)
  end
end

-- Reads the header into `s`, and checks the keys of its pages.
local function log_read(s)
  s.pages, s.found, s.unwritten = {}, nil, ''
  local header = header_read
  if header_key ~= s.key then
    header = redis.call('GETRANGE', s.key, 0, LOG_HEADER_SIZE - 1)
  end
  header_key = nil
  if header == '' then
    -- A new log. What a log whose string was evicted left in its chunks
    -- is never read (see above), and expires.
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
  local m, i = settle(s, seek(s, now - s.span))
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

-- Brings the log (as this call last left it, see `prepare`, or else its
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
    local m, i = settle(s, seek(s, now - s.window))
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

-- Deletes a few of the pages the head has left behind: whole the chunks
-- that hold no live page (those below the head's, and the head's while
-- no page from the head on is sealed), then pages of the head's chunk,
-- with the tree's blocks that end in them (a block that ends in a later
-- chunk starts in an earlier one, which goes whole).
local function log_clean(s)
  local head_chunk = chunk_of(s, s.head_page)
  local dead = head_chunk - 1
  if s.tail_page == s.head_page and not s.flat then
    dead = head_chunk
  end
  local chunks = 0
  while s.clean < s.head_page and chunk_of(s, s.clean) <= dead and chunks < CLEAN_CHUNKS do
    local c = chunk_of(s, s.clean)
    pages_call(PAGE_WORK, 'UNLINK', chunk_key(s, c))
    s.clean, s.dirty, chunks = math.min((c + 1) * CHUNK_PAGES, s.head_page), true, chunks + 1
  end
  local stop = math.min(s.head_page, s.clean + CLEAN_PAGES)
  if stop <= s.clean or chunk_of(s, s.clean) < head_chunk then
    return
  end
  local fields = {}
  for n = s.clean, stop - 1 do
    fields[#fields + 1] = int(n)
    for k = 0, s.levels do
      if (n + 1) % 2 ^ k == 0 and (s.flat or 2 ^ k <= CHUNK_PAGES) then
        fields[#fields + 1] = node(k, (n + 1) / 2 ^ k - 1)
      end
    end
    s.pages[n] = nil
  end
  pages_call(#fields, 'HDEL', chunk_key(s, head_chunk), unpack(fields))
  s.clean, s.dirty = stop, true
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

-- Writes the tail to its own page in its chunk, and adds its sum to the
-- tree; a new, empty tail follows it.
local function log_seal(s)
  local n = s.tail_page
  local bytes = tail_bytes(s)
  local key = page_key(s, n)
  pages_call(PAGE_WORK, 'HSET', key, int(n), struct.pack(PAGE_HEADER, s.tail_base, s.ow, s.cw) .. bytes)
  s.pages[n] = nil
  tree_add(s, n, s.tail_sum, true)
  -- The chunk may be new, and now holds a later record.
  log_time(s, key)
  s.ttl = nil
  s.tail_page, s.tail_count, s.tail_sum = n + 1, 0, 0
  s.tail, s.unwritten, s.tail_view, s.rewrite = '', '', nil, true
  -- The tree covers every live page in O(levels) blocks.
  while s.tail_page - s.head_page > 2 ^ s.levels do
    local k = s.levels + 1
    for j = math.ceil(s.head_page / 2 ^ k), math.floor((s.tail_page - 1) / 2 ^ k) do
      local sums = block_sums(s, { { k - 1, 2 * j }, { k - 1, 2 * j + 1 } })
      pages_call(1, 'HSET', node_key(s, k, j), node(k, j), int(sums[1] + sums[2]))
    end
    s.levels = k
  end
end

-- Rewrites the tail's records in wider fields.
local function log_widen(s, ow, cw)
  local old = page(s, s.tail_page)
  local parts = {}
  for i = 0, old.count - 1 do
    local time, total = record_at(old, i)
    parts[i + 1] = encode(s.tail_base, ow, cw, time, total)
  end
  s.ow, s.cw = ow, cw
  s.tail, s.unwritten, s.tail_view, s.rewrite = table.concat(parts), '', nil, true
end

-- Appends a record at `time` of `cost` to the tail, sealing or widening
-- it first if it must.
local function log_append(s, time, cost)
  if s.tail_count > 0 then
    local ow = offset_width(time - s.tail_base)
    local cw = s.cw
    if cw > 0 or cost ~= 1 then
      cw = math.max(cw, total_width(s.tail_sum + cost))
    end
    if ow ~= nil then
      ow = math.max(ow, s.ow)
    end
    if ow == nil or (s.tail_count + 1) * (ow + cw) > PAGE_BYTES then
      log_seal(s)
    elseif ow ~= s.ow or cw ~= s.cw then
      log_widen(s, ow, cw)
    end
  end
  if s.tail_count == 0 then
    s.tail_base, s.ow, s.cw = time, 4, 0
    if cost ~= 1 then
      s.cw = total_width(cost)
    end
  end
  local record = encode(s.tail_base, s.ow, s.cw, time, s.tail_sum + cost)
  if s.rewrite then
    s.tail = tail_bytes(s) .. record
  else
    s.unwritten = s.unwritten .. record
  end
  s.tail_count, s.tail_sum, s.tail_view = s.tail_count + 1, s.tail_sum + cost, nil
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

function log.record(s)
  if s.cost == 0 then
    log_write(s)
    return
  end
  local time = s.pass
  if s.sum > 0 and s.newest >= time then
    time = s.newest + 1
  end
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
    s.head_page, s.head_index = settle(s, m, i)
    s.oldest = time_at(s, s.head_page, s.head_index)
  end
end

-- Takes back `cost` units recorded at `at`: the record of that time, if
-- it is still live and of that cost. Nothing otherwise (it has left the
-- window, or was taken back already).
function log.refund(s, at, cost)
  if s.sum > 0 and at >= s.oldest and at <= s.newest then
    local m, i = settle(s, seek(s, at - 1))
    if m ~= nil then
      local v = page(s, m)
      local time, total = record_at(v, i)
      if time == at and total - total_before(v, i) == cost then
        log_remove(s, m, i, cost)
      end
    end
  end
  log_write(s)
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

------------------------------------------------------------ sliding counter

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
  local stored = hash_fields(s, 'w', 'c', 'p', 't', 'l', 'n')
  local carried
  s.at, carried = high_water(stored[4], w * 1000)
  s.t = stored[4]
  local now_ms = idiv(s.at, 1000)
  local id = idiv(now_ms, w)
  local stored_id = tonumber(stored[1])
  local c, p = tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
  local n = tonumber(stored[6]) or 0
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
  redis.call('HSET', s.key, 'w', s.id, 'c', s.c, 'p', s.p, 't', s.t, 'l', s.w, 'n', s.n)
  s.stored = { s.id, s.c, s.p, s.t, s.w, s.n }
  -- The counts matter until the end of the next window (on Redis's own
  -- clock, which expires the key: the real `now`, not the high water),
  -- units held into the next window until the end of the one after.
  local windows = s.n > 0 and 3 or 2
  expire(s.key, (s.id + windows) * s.w - idiv(now, 1000) + 1)
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
-- if that is the current or the previous one.
function counter.refund(s, at, cost)
  local bucket = idiv(idiv(at, 1000), s.w)
  if bucket == s.id + 1 and s.n > 0 then
    s.n = math.max(0, s.n - cost)
  elseif bucket == s.id and s.c > 0 then
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
  if s.n > 0 then
    remaining = math.max(0, math.min(remaining, s.limit - s.c - s.n))
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
  local stored = hash_fields(s, 'w', 'c', 't', 'l', 'n')
  local carried
  s.at, carried = high_water(stored[3], s.window)
  s.t = stored[3]
  s.id = idiv(s.at, s.window)
  s.c, s.n = 0, 0
  local stored_id = tonumber(stored[1])
  local c, n = tonumber(stored[2]) or 0, tonumber(stored[5]) or 0
  local old = tonumber(stored[4])
  if n > 0 and stored_id ~= nil and old ~= nil and old ~= s.window and s.at < (stored_id + 2) * old then
    s.held_elsewhere = (stored_id + 2) * old
    return false
  end
  if stored_id ~= nil and old ~= nil and old ~= s.window then
    -- Left under another window length: the count stays in the new window
    -- holding the latest time a unit was counted at, if that is now's.
    -- Units held into the next window have passed, and their window
    -- ended, by now (see `held_elsewhere` above).
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
  redis.call('HSET', s.key, 'w', s.id, 'c', s.c, 't', s.t, 'l', s.window, 'n', s.n)
  s.stored = { s.id, s.c, s.t, s.window, s.n }
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
-- or held into the next.
function fixed.refund(s, at, cost)
  local id = idiv(at, s.window)
  if id == s.id + 1 and s.n > 0 then
    s.n = math.max(0, s.n - cost)
    fixed_write(s)
  elseif id == s.id and s.c > 0 then
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

------------------------------------------------------------- token bucket
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
  local t, d = now, 0
  s.h, s.f, s.z = 0, s.limit, 0
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
    return
  end
  s.d = s.d - unrepaid
  bucket_write(s)
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

---------------------------------------------------------------- leases
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

----------------------------------------------------------------- calendar
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

---------------------------------------------------------------- the batch

-- The error of a request that Redis, out of memory, cannot admit without
-- new state (see "Under `maxmemory`" below).
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

-- The policy described by the seven arguments from argv[a], its numbers
-- parsed; its span no shorter than its window.
local function describe(argv, a)
  local algorithm = algorithms[argv[a]]
  if algorithm == nil then
    error('unknown algorithm ' .. tostring(argv[a]))
  end
  return {
    algorithm = algorithm,
    period = argv[a],
    limit = tonumber(argv[a + 1]),
    window = tonumber(argv[a + 2]),
    burst = tonumber(argv[a + 3]),
    block = tonumber(argv[a + 4]),
    delay = tonumber(argv[a + 5]),
    span = math.max(tonumber(argv[a + 6]), tonumber(argv[a + 2])),
  }
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
-- decisions, packed (see DECISION), and the index of the next key.
--
-- A request that some policies do not fit now, each within its delay,
-- and that no block holds, is decided once: admitted at `pass`, the time
-- every policy fits it (the latest of their retry times), with its units
-- recorded at that time under every policy, so no request admitted
-- meanwhile can take its place; its retry integer is then the wait.
local function decide(keys, first_key, count, policies, costs, peek, held_only)
  if count == 1 and not peek and not held_only then
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

-- Refunds and settlements: ARGV[1] the time, ARGV[2] "refund" or
-- "settle", then per policy its arguments as for `check`, the time (µs)
-- its units were recorded at, and for a settlement the units the request
-- cost in the end. Each policy's units are taken back on their own (a
-- lease is released); a settlement then counts its final units at `now`
-- (see `charge`). Counts held elsewhere (see `retry_of`) are left as
-- they are. Returns an empty string.
local function refund(keys, argv)
  set_now(argv[1])
  local settle = argv[2] == 'settle'
  local stride = settle and ARGS + 2 or ARGS + 1
  local k = 1
  for a = 3, #argv, stride do
    local s
    s, k = prepare(keys, k, describe(argv, a), argv[a + ARGS - 1])
    if s.held_elsewhere == nil then
      s.algorithm.refund(s, tonumber(argv[a + ARGS]), s.cost)
      if settle then
        charge(s, tonumber(argv[a + ARGS + 1]))
      end
    end
    s.algorithm.remember(s)
  end
  write_logs()
  return ''
end

-- Resets: ARGV[1] the time, ARGV[2] "reset", then per policy its
-- arguments as for `check`: every key of the policy is deleted (a log's
-- chunks of pages with its header, unlinked: Redis frees a large hash of
-- the one-hash version in the background). Returns an empty string.
local function reset(keys, argv)
  set_now(argv[1])
  local k = 1
  for a = 3, #argv, ARGS do
    local policy = describe(argv, a)
    local count = key_count(policy)
    if policy.algorithm == log then
      log_reset(keys[k], keys[k + 1])
    end
    for j = k, k + count - 1 do
      redis.call('UNLINK', keys[j])
    end
    k = k + count
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
  local k = 1
  local held = {}
  for a = 3, #argv, ARGS do
    local policy = describe(argv, a)
    local kept = '1'
    if policy.algorithm == lease then
      local s = { key = keys[k], window = policy.window, limit = policy.limit }
      local id = argv[a + ARGS - 1]
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
    k = k + key_count(policy)
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
  local k = 1
  local stride = argv[2] == 'settle' and ARGS + 2 or ARGS + 1
  for a = 3, #argv, stride do
    if redis.call('EXISTS', keys[k]) == 0 then
      return false
    end
    k = k + key_count(describe(argv, a))
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
  for i = 1, tonumber(argv[2]) do
    named[i] = describe(argv, next_arg)
    next_arg = next_arg + ARGS - 1
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
      ok, result, after = pcall(decide, keys, next_key, count, policies, costs, false, held_only)
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
