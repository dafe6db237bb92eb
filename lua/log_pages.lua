-- The sliding log's storage: its records, pages, chunks of pages and the
-- tree of page sums, read and written for `log.lua`, which counts with
-- them.
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

-- The keys that sealing the tail writes, and sealing the page after it
-- (a call seals at most two): the pages' chunks, the chunks of the
-- tree's blocks their sums are added to (see `tree_add`), and those of
-- the blocks of a level the tree may grow by (see `log_seal`).
local function seal_keys(s)
  local keys = {}
  for n = s.tail_page, s.tail_page + 1 do
    keys[#keys + 1] = page_key(s, n)
    for k = 0, s.levels do
      local j = math.floor(n / 2 ^ k)
      if j * 2 ^ k >= s.head_page then
        keys[#keys + 1] = node_key(s, k, j)
      end
    end
  end
  local k = s.levels + 1
  for j = math.ceil(s.head_page / 2 ^ k), math.floor((s.tail_page + 1) / 2 ^ k) do
    keys[#keys + 1] = node_key(s, k, j)
  end
  return keys
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
local function live_from(s, m, i)
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

-- Whether appending a record at `time` of `cost` to a tail that holds
-- records seals the tail first, and the widths the tail needs otherwise.
local function tail_fit(s, time, cost)
  local ow = offset_width(time - s.tail_base)
  local cw = s.cw
  if cw > 0 or cost ~= 1 then
    cw = math.max(cw, total_width(s.tail_sum + cost))
  end
  if ow ~= nil then
    ow = math.max(ow, s.ow)
  end
  return ow == nil or (s.tail_count + 1) * (ow + cw) > PAGE_BYTES, ow, cw
end

-- Appends a record at `time` of `cost` to the tail, sealing or widening
-- it first if it must.
local function log_append(s, time, cost)
  if s.tail_count > 0 then
    local seal, ow, cw = tail_fit(s, time, cost)
    if seal then
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
