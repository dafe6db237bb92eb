//! The exact sliding-window log kept by [`MemoryStore`](super::MemoryStore),
//! the in-process twin of the log in `lua/log.lua`, with the same rules
//! and the same bounds: every decision does O(log n) work, whatever the
//! limit, the costs or the time since the last one.
//!
//! Records are kept in pages of at most [`PAGE`] records, each with the
//! running total of cost in its page, and the sums of whole pages in a
//! [`Tree`] of aligned blocks, so a window's count, the time enough units
//! leave, pruning and a refund each look at O(log pages) sums and at most
//! two pages.
//!
//! The rules, on Redis and here alike:
//! * A record is made at `now`, or one microsecond after the newest record
//!   if that is later: times are unique and in order, so a refund names
//!   exactly one record, and a clock that steps back never reorders them.
//! * Records leave once the log's *span* has passed over them: the longest
//!   window it has been counted under since it was last empty. Each check
//!   counts the records of its own window, so tiers with different windows
//!   each see every request their window covers.
//! * A log left empty starts afresh (no span, no newest time).
//! * If the clock has stepped back by more than the check's window and
//!   the longest delay a policy may have ([`MAX_DELAY`]) since the newest
//!   record, the live count is gathered into one record at `now`: kept,
//!   and gone within a span of the new time. (Records of requests held
//!   for a delay lie ahead of `now`, by at most that.)
//!
//! [`MAX_DELAY`]: crate::policy::MAX_DELAY

use std::collections::VecDeque;
use std::time::Duration;

use crate::store::Decision;

/// Records per page.
const PAGE: usize = 64;
/// Pages below the head dropped per decision, at most.
const CLEAN_PAGES: usize = 8;

/// One admitted request: its time, and the running total of cost in its
/// page up to and including it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    time: u64,
    total: u64,
}

#[derive(Debug, Default)]
struct Page {
    /// The time of the page's first record when it was made: no later
    /// than any of its records, and no earlier than the page before's.
    base: u64,
    records: Vec<Record>,
}

impl Page {
    fn total(&self) -> u64 {
        self.records.last().map_or(0, |r| r.total)
    }

    fn total_before(&self, index: usize) -> u64 {
        index.checked_sub(1).map_or(0, |i| self.records[i].total)
    }

    /// The first record from `from` later than `x` (the page's length if
    /// none).
    fn first_after(&self, from: usize, x: i64) -> usize {
        from + self.records[from..].partition_point(|r| r.time as i64 <= x)
    }

    /// The first record from `from` whose running total reaches `target`.
    fn reaching(&self, from: usize, target: u64) -> usize {
        from + self.records[from..].partition_point(|r| r.total < target)
    }
}

/// Sums of sealed pages in aligned blocks: `levels[k]` holds the sum of
/// pages `j·2^k ..= (j+1)·2^k − 1` for `j` from its `start`.
#[derive(Debug, Default)]
struct Tree {
    levels: Vec<Level>,
}

#[derive(Debug, Default)]
struct Level {
    start: u64,
    sums: VecDeque<u64>,
}

impl Level {
    fn get(&self, j: u64) -> u64 {
        j.checked_sub(self.start)
            .and_then(|at| self.sums.get(at as usize))
            .copied()
            .unwrap_or(0)
    }
}

impl Tree {
    /// The highest level kept.
    fn top(&self) -> u32 {
        self.levels.len().saturating_sub(1) as u32
    }

    fn node(&self, k: u32, j: u64) -> u64 {
        self.levels.get(k as usize).map_or(0, |level| level.get(j))
    }

    /// Adds `delta` to page `n`'s sum, at every level.
    fn add(&mut self, n: u64, delta: i64) {
        if self.levels.is_empty() {
            self.levels.push(Level::default());
        }
        for (k, level) in self.levels.iter_mut().enumerate() {
            let j = n >> k;
            if level.sums.is_empty() {
                level.start = j;
            }
            let Some(at) = j.checked_sub(level.start) else {
                continue;
            };
            while level.sums.len() as u64 <= at {
                level.sums.push_back(0);
            }
            let sum = &mut level.sums[at as usize];
            *sum = sum.wrapping_add_signed(delta);
        }
    }

    /// Adds levels until pages `head ..tail` fit in O(levels) blocks.
    fn cover(&mut self, head: u64, tail: u64) {
        while tail - head > 1 << self.top() {
            let k = self.top() + 1;
            let start = head >> k;
            let sums = (start..=(tail - 1) >> k)
                .map(|j| self.node(k - 1, 2 * j) + self.node(k - 1, 2 * j + 1))
                .collect();
            self.levels.push(Level { start, sums });
        }
    }

    /// Forgets the blocks that end before page `first`.
    fn forget(&mut self, first: u64) {
        for (k, level) in self.levels.iter_mut().enumerate() {
            while !level.sums.is_empty() && (level.start + 1) << k <= first {
                level.sums.pop_front();
                level.start += 1;
            }
        }
    }

    /// The blocks that make up pages `a..=b`, in order.
    fn blocks(&self, a: u64, b: u64) -> impl Iterator<Item = (u32, u64)> + '_ {
        let top = self.top();
        let mut lo = a;
        std::iter::from_fn(move || {
            if lo > b {
                return None;
            }
            let mut k = 0;
            while k < top && lo.is_multiple_of(2 << k) && lo + (2 << k) <= b + 1 {
                k += 1;
            }
            let block = (k, lo >> k);
            lo += 1 << k;
            Some(block)
        })
    }

    fn sum(&self, a: u64, b: u64) -> u64 {
        self.blocks(a, b).map(|(k, j)| self.node(k, j)).sum()
    }

    /// The first page in `a..=b` at which the running total from `a`
    /// reaches `need`, and the total before it; or `None` and the whole
    /// total.
    fn find(&self, a: u64, b: u64, need: u64) -> (Option<u64>, u64) {
        let mut before = 0;
        for (k, j) in self.blocks(a, b) {
            let sum = self.node(k, j);
            if before + sum >= need {
                let (mut k, mut j) = (k, j);
                while k > 0 {
                    k -= 1;
                    let left = self.node(k, 2 * j);
                    if before + left >= need {
                        j *= 2;
                    } else {
                        before += left;
                        j = 2 * j + 1;
                    }
                }
                return (Some(j), before);
            }
            before += sum;
        }
        (None, before)
    }
}

/// The pages before the tail, once the log has outgrown one.
#[derive(Debug, Default)]
struct Sealed {
    /// Pages from number `first`; those below the head are dropped a few
    /// at a time.
    pages: VecDeque<Page>,
    first: u64,
    tree: Tree,
    /// A dropped page's records, kept for the next tail: a log in a
    /// steady state allocates nothing.
    spare: Vec<Record>,
}

/// A record's place: a page number and an index in it, which may be the
/// page's length (the next page's start).
type Position = (u64, usize);

/// Admitted requests of one client under one policy, in time order.
#[derive(Debug, Default)]
pub(super) struct Log {
    /// The newest page, which requests append to.
    tail: Page,
    tail_page: u64,
    sealed: Option<Box<Sealed>>,
    /// Where the oldest live record is.
    head: Position,
    /// The cost of live records.
    sum: u64,
    oldest: u64,
    newest: u64,
    /// The longest window counted under since the log was last empty.
    span: u64,
}

/// A check's window, as [`Log::prepare`] found it: its length, its count,
/// where it starts, and its oldest record. Kept by the caller for the
/// decision, not in the log.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Window {
    micros: u64,
    /// The span the check keeps the log's records for.
    span: u64,
    count: u64,
    first: Position,
    oldest: u64,
}

impl Window {
    /// Whether `cost` more units fit.
    pub(super) fn fits(&self, limit: u32, cost: u32) -> bool {
        self.count + u64::from(cost) <= u64::from(limit)
    }
}

impl Log {
    fn page(&self, n: u64) -> &Page {
        if n == self.tail_page {
            return &self.tail;
        }
        let sealed = self.sealed.as_deref().expect("a sealed page");
        &sealed.pages[(n - sealed.first) as usize]
    }

    fn page_mut(&mut self, n: u64) -> &mut Page {
        if n == self.tail_page {
            return &mut self.tail;
        }
        let sealed = self.sealed.as_deref_mut().expect("a sealed page");
        &mut sealed.pages[(n - sealed.first) as usize]
    }

    fn tree(&self) -> Option<&Tree> {
        self.sealed.as_deref().map(|sealed| &sealed.tree)
    }

    fn time_at(&self, (page, index): Position) -> u64 {
        self.page(page).records[index].time
    }

    /// The position of the first live record later than `x`.
    fn seek(&self, x: i64) -> Position {
        if self.oldest as i64 > x {
            return self.head;
        }
        let (mut lo, mut hi) = (self.head.0, self.tail_page);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            // An empty tail's base is stale: it holds nothing before x.
            let later = mid == self.tail_page && self.tail.records.is_empty();
            if !later && self.page(mid).base as i64 <= x {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let from = if lo == self.head.0 { self.head.1 } else { 0 };
        (lo, self.page(lo).first_after(from, x))
    }

    /// The live record at or after `position`, if any.
    fn live_from(&self, (page, index): Position) -> Option<Position> {
        let mut index = index;
        if page != self.tail_page {
            if index < self.page(page).records.len() {
                return Some((page, index));
            }
            if let Some(tree) = self.tree()
                && let (Some(next), _) = tree.find(page + 1, self.tail_page - 1, 1)
            {
                return Some((next, 0));
            }
            index = 0;
        }
        (index < self.tail.records.len()).then_some((self.tail_page, index))
    }

    /// The cost of live records from `position` on.
    fn sum_from(&self, (page, index): Position) -> u64 {
        let part = self.page(page).total() - self.page(page).total_before(index);
        if page == self.tail_page {
            return part;
        }
        let sealed = self
            .tree()
            .map_or(0, |tree| tree.sum(page + 1, self.tail_page - 1));
        part + sealed + self.tail.total()
    }

    /// The record at which the cost of live records from `position`
    /// reaches `need`.
    fn find_units(&self, (page, index): Position, need: u64) -> Option<Position> {
        let (mut need, mut index) = (need, index);
        if page != self.tail_page {
            let current = self.page(page);
            let before = current.total_before(index);
            let part = current.total() - before;
            if part >= need {
                return Some((page, current.reaching(index, before + need)));
            }
            need -= part;
            let (found, sealed) = self.tree().map_or((None, 0), |tree| {
                tree.find(page + 1, self.tail_page - 1, need)
            });
            if let Some(found) = found {
                return Some((found, self.page(found).reaching(0, need - sealed)));
            }
            need -= sealed;
            index = 0;
        }
        let target = self.tail.total_before(index) + need;
        (self.tail.total() >= target).then(|| (self.tail_page, self.tail.reaching(index, target)))
    }

    /// Drops records the span has passed over; an empty log starts afresh.
    fn prune(&mut self, now: u64) {
        if self.sum == 0 || self.oldest + self.span > now {
            return;
        }
        match self.live_from(self.seek(now as i64 - self.span as i64)) {
            None => *self = Self::default(),
            Some(head) => {
                self.head = head;
                self.sum = self.sum_from(head);
                self.oldest = self.time_at(head);
            }
        }
    }

    /// Gathers the live count into one record at `now`.
    fn gather(&mut self, now: u64) {
        let (sum, span) = (self.sum, self.span);
        *self = Self {
            tail: Page {
                base: now,
                records: vec![Record {
                    time: now,
                    total: sum,
                }],
            },
            sum,
            span,
            oldest: now,
            newest: now,
            ..Self::default()
        };
    }

    /// Drops a few of the pages the head has left behind.
    fn clean(&mut self) {
        let head = self.head.0;
        if let Some(sealed) = self.sealed.as_deref_mut() {
            for _ in 0..CLEAN_PAGES {
                if sealed.first >= head || sealed.pages.is_empty() {
                    break;
                }
                let dropped = sealed.pages.pop_front().expect("a page below the head");
                if sealed.spare.capacity() == 0 {
                    sealed.spare = dropped.records;
                    sealed.spare.clear();
                }
                sealed.first += 1;
            }
            sealed.tree.forget(sealed.first);
        }
    }

    /// Brings the log up to `now` for a check of `window_micros`, whose
    /// policy's tiers count the log under windows up to `span_micros`
    /// (the log keeps records for the longest of them), and finds that
    /// window.
    pub(super) fn prepare(&mut self, now: u64, window_micros: u64, span_micros: u64) -> Window {
        let span = span_micros.max(window_micros);
        self.prune(now);
        // Records of requests held for a delay (of any policy of theirs)
        // lie ahead of `now` by at most the longest delay a policy may
        // have; only a newest record beyond those is a clock that stepped
        // back.
        let ahead = crate::policy::MAX_DELAY.as_micros() as u64;
        if self.sum > 0 && self.newest.saturating_sub(now) > window_micros + ahead {
            self.gather(now);
        }
        if self.sum > 0 && span > self.span {
            self.span = span;
        }
        self.clean();
        let mut window = Window {
            micros: window_micros,
            span,
            count: self.sum,
            first: self.head,
            oldest: self.oldest,
        };
        if self.sum > 0 && window_micros < self.span && self.oldest + window_micros <= now {
            match self.live_from(self.seek(now as i64 - window_micros as i64)) {
                None => window.count = 0,
                Some(first) => {
                    window.first = first;
                    window.count = self.sum_from(first);
                    window.oldest = self.time_at(first);
                }
            }
        }
        window
    }

    /// Moves the full tail to the sealed pages and starts a new one.
    fn seal(&mut self) {
        let total = self.tail.total();
        let page = std::mem::take(&mut self.tail);
        let sealed = self.sealed.get_or_insert_with(|| {
            Box::new(Sealed {
                first: self.tail_page,
                ..Sealed::default()
            })
        });
        sealed.pages.push_back(page);
        self.tail.records = std::mem::take(&mut sealed.spare);
        sealed.tree.add(self.tail_page, total as i64);
        self.tail_page += 1;
        sealed.tree.cover(self.head.0, self.tail_page);
    }

    /// Records `cost` units after [`prepare`](Self::prepare) found
    /// `window`: at `pass` (now, or when a held request passes), or just
    /// after the newest record. Returns the time recorded at, or `None`
    /// for a cost of 0, which records nothing.
    pub(super) fn record(&mut self, pass: u64, cost: u32, window: &mut Window) -> Option<u64> {
        if cost == 0 {
            return None;
        }
        let time = if self.sum > 0 && self.newest >= pass {
            self.newest + 1
        } else {
            pass
        };
        if self.tail.records.len() == PAGE {
            self.seal();
        }
        if self.tail.records.is_empty() {
            self.tail.base = time;
        }
        let total = self.tail.total() + u64::from(cost);
        self.tail.records.push(Record { time, total });
        let position = (self.tail_page, self.tail.records.len() - 1);
        if self.sum == 0 {
            self.head = position;
            self.oldest = time;
            self.span = window.span;
        }
        if window.count == 0 {
            window.first = position;
            window.oldest = time;
        }
        self.sum += u64::from(cost);
        window.count += u64::from(cost);
        self.newest = time;
        Some(time)
    }

    /// Takes back `cost` units recorded at `at`, after
    /// [`prepare`](Self::prepare): the record of that time, if it is still
    /// live and of that cost. Nothing otherwise (it has left the window,
    /// or was taken back already). Returns whether it found the record.
    pub(super) fn refund(&mut self, at: u64, cost: u32) -> bool {
        if self.sum == 0 || at < self.oldest || at > self.newest {
            return false;
        }
        let Some((page, index)) = self.live_from(self.seek(at as i64 - 1)) else {
            return false;
        };
        let found = &self.page(page);
        let cost = u64::from(cost);
        if found.records[index].time != at
            || found.records[index].total - found.total_before(index) != cost
        {
            return false;
        }
        let records = &mut self.page_mut(page).records;
        records.remove(index);
        for later in &mut records[index..] {
            later.total -= cost;
        }
        if page != self.tail_page
            && let Some(sealed) = self.sealed.as_deref_mut()
        {
            sealed.tree.add(page, -(cost as i64));
        }
        self.sum -= cost;
        if self.sum == 0 {
            *self = Self::default();
        } else if self.head == (page, index) {
            self.head = self.live_from(self.head).expect("a live record");
            self.oldest = self.time_at(self.head);
        }
        true
    }

    /// Whether every record has left, so the log can be dropped.
    pub(super) fn is_idle(&self, now: u64) -> bool {
        self.sum == 0 || self.newest + self.span <= now
    }

    /// The decision for this log after [`prepare`](Self::prepare) found
    /// `window` (and [`record`](Self::record), if admitted).
    pub(super) fn decision(
        &self,
        now: u64,
        limit: u32,
        cost: u32,
        admitted: bool,
        window: &Window,
    ) -> Decision {
        let reset = if window.count == 0 {
            0
        } else {
            window.oldest + window.micros - now
        };
        let retry_after = (!admitted && !window.fits(limit, cost)).then(|| {
            let need = window.count + u64::from(cost) - u64::from(limit);
            // A cost above the limit never fits: the window.
            let leaves = (need <= window.count)
                .then(|| self.find_units(window.first, need))
                .flatten()
                .map_or(now, |at| self.time_at(at));
            Duration::from_micros(leaves + window.micros - now)
        });
        Decision::decided(
            admitted,
            limit,
            u32::try_from(u64::from(limit).saturating_sub(window.count)).unwrap_or(0),
            Duration::from_micros(reset),
            retry_after,
        )
    }
}

#[cfg(test)]
mod tests;
