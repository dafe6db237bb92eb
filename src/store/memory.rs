//! The embedded store: sharded logs in process memory, bounded, with
//! S3-FIFO-style admission so a flood of new keys never pushes out the
//! clients that keep coming back.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use quick_cache::unsync::Cache;
use quick_cache::{Equivalent, OptionsBuilder, UnitWeighter};

use super::bucket::TokenBucket;
use super::counter::{FixedWindow, SlidingCounter};
use super::leases::Leases;
use super::quota::Quota;
use super::sliding_log::{Log, Window};
use super::{Check, CheckFuture, Decisions, StateId, Store, unpaired_refund, unpaired_settlement};
use crate::clock::{Clock, SystemClock, duration_micros};
use crate::key::Key;
use crate::policy::Algorithm;
use crate::store::Decision;

const DEFAULT_MAX_KEYS: usize = 1_000_000;
const MAX_SHARDS: usize = 64;
/// Keys per shard below which the store does not split further: a small
/// bound in few shards keeps room for active clients in each.
const KEYS_PER_SHARD: usize = 1024;
/// The share of a shard kept for clients seen more than once; new keys
/// wait in the rest until they come back (S3-FIFO's small queue is 10%).
const RETURNING_SHARE: f64 = 0.9;
/// A shard sweeps idle pairs once it has taken in as many new pairs as it
/// held after its last sweep (and at least this many), so sweeping costs
/// O(1) per insert amortised, at the bound too.
const MIN_SWEEP_AFTER: usize = 256;

/// One (policy, client) pair, as the shard's map key, with its hash
/// computed once per check.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pair {
    hash: u64,
    namespace: Option<Arc<str>>,
    policy: Arc<str>,
    key: Key,
}

impl Hash for Pair {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// A check's pair, borrowed, to look up without building a [`Pair`].
struct PairOf<'a> {
    hash: u64,
    check: &'a Check,
}

impl Hash for PairOf<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl Equivalent<Pair> for PairOf<'_> {
    fn equivalent(&self, pair: &Pair) -> bool {
        pair.policy == self.check.policy
            && pair.key == self.check.key
            && pair.namespace == self.check.namespace
    }
}

/// Hashes a [`Pair`] or [`PairOf`] to the hash it carries, already mixed.
#[derive(Debug, Clone, Copy, Default)]
struct CarriedHash;

impl BuildHasher for CarriedHash {
    type Hasher = Carried;

    fn build_hasher(&self) -> Carried {
        Carried(0)
    }
}

#[derive(Debug, Clone, Copy)]
struct Carried(u64);

impl Hasher for Carried {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used; fold anything else in for completeness.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }
}

/// What one client has spent under one policy, per algorithm.
#[derive(Debug)]
enum Counts {
    Log(Log),
    Counter(SlidingCounter),
    Fixed(FixedWindow),
    Bucket(TokenBucket),
    Leases(Leases),
    Quota(Quota),
}

impl Counts {
    fn new(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::SlidingLog => Self::Log(Log::default()),
            Algorithm::SlidingCounter => Self::Counter(SlidingCounter::default()),
            Algorithm::FixedWindow => Self::Fixed(FixedWindow::default()),
            Algorithm::TokenBucket => Self::Bucket(TokenBucket::default()),
            Algorithm::Concurrency => Self::Leases(Leases::default()),
            Algorithm::Calendar(_) => Self::Quota(Quota::default()),
        }
    }

    fn is_of(&self, algorithm: Algorithm) -> bool {
        matches!(
            (self, algorithm),
            (Self::Log(_), Algorithm::SlidingLog)
                | (Self::Counter(_), Algorithm::SlidingCounter)
                | (Self::Fixed(_), Algorithm::FixedWindow)
                | (Self::Bucket(_), Algorithm::TokenBucket)
                | (Self::Leases(_), Algorithm::Concurrency)
                | (Self::Quota(_), Algorithm::Calendar(_))
        )
    }

    /// Brings the counts up to `now` for `check` and says whether its cost
    /// fits; see [`Spent::prepare`].
    fn prepare(&mut self, now: u64, check: &Check) -> (bool, Placed) {
        let window = check.window_micros();
        let held_elsewhere = match self {
            Self::Counter(counter) => counter.held_elsewhere(now, window / 1000),
            Self::Fixed(fixed) => fixed.held_elsewhere(now, window),
            Self::Bucket(bucket) => bucket.held_elsewhere(now, check),
            Self::Log(_) | Self::Leases(_) | Self::Quota(_) => None,
        };
        if let Some(until) = held_elsewhere {
            return (false, Placed::HeldElsewhere(until));
        }
        match self {
            Self::Log(log) => {
                let window = log.prepare(now, window, check.span_micros);
                (window.fits(check.limit, check.cost), Placed::Log(window))
            }
            Self::Counter(counter) => {
                let before = *counter;
                let moved = counter.roll(now, window / 1000);
                let placed = if moved {
                    Placed::Kept
                } else {
                    Placed::Counter(before)
                };
                (counter.fits(check.limit, check.cost), placed)
            }
            Self::Fixed(fixed) => {
                let before = *fixed;
                let moved = fixed.roll(now, window);
                let placed = if moved {
                    Placed::Kept
                } else {
                    Placed::Fixed(before)
                };
                (fixed.fits(check.limit, check.cost), placed)
            }
            Self::Bucket(bucket) => {
                let before = *bucket;
                let moved = bucket.place(now, check);
                let placed = if moved {
                    Placed::Kept
                } else {
                    Placed::Bucket(before)
                };
                (bucket.fits(check), placed)
            }
            Self::Leases(leases) => {
                leases.prepare(now, check);
                (leases.fits(check), Placed::Kept)
            }
            Self::Quota(quota) => {
                let before = *quota;
                let moved = match check.algorithm {
                    Algorithm::Calendar(calendar) => quota.place(now, calendar),
                    _ => false,
                };
                // The Redis script writes a count only when it changes.
                let placed = if moved {
                    Placed::Kept
                } else {
                    Placed::Quota(before)
                };
                (quota.fits(check.limit, check.cost), placed)
            }
        }
    }

    fn unroll(&mut self, placed: Placed) {
        match (self, placed) {
            (Self::Counter(counter), Placed::Counter(before)) => *counter = before,
            (Self::Fixed(fixed), Placed::Fixed(before)) => *fixed = before,
            (Self::Bucket(bucket), Placed::Bucket(before)) => *bucket = before,
            (Self::Quota(quota), Placed::Quota(before)) => *quota = before,
            _ => {}
        }
    }

    /// Whether the request fits at `pass`, later than now, after
    /// [`prepare`](Self::prepare) (see [`Spent::held_until`]).
    fn fits_at(&self, check: &Check, pass: u64) -> bool {
        let (limit, cost) = (check.limit, check.cost);
        match self {
            // The window only loses units as time passes.
            Self::Log(_) => cost <= limit,
            Self::Counter(counter) => counter.fits_at(limit, cost, pass),
            Self::Fixed(fixed) => fixed.fits_at(limit, cost, pass),
            Self::Bucket(bucket) => bucket.fits_at(check, pass),
            // Never held: its lease would be taken now, and its time would
            // run while the request waits; a calendar quota takes no delay.
            Self::Leases(_) | Self::Quota(_) => false,
        }
    }

    /// Records `cost` units of `check` (its own cost, or a settlement's),
    /// passing at `pass` (now, or later for a held request); a lease is
    /// taken at `now`.
    fn record(
        &mut self,
        (now, pass): (u64, u64),
        check: &Check,
        cost: u32,
        placed: &mut Placed,
    ) -> Option<u64> {
        match self {
            Self::Log(log) => match placed {
                Placed::Log(window) => log.record(pass, cost, window),
                _ => unreachable!("a log is prepared with its window"),
            },
            Self::Counter(counter) => Some(counter.record(cost, pass)),
            Self::Fixed(fixed) => Some(fixed.record(cost, pass)),
            Self::Bucket(bucket) => Some(bucket.record(cost, pass, pass > now)),
            Self::Leases(leases) => Some(leases.record(now, check.lease)),
            Self::Quota(quota) => Some(quota.record(cost, now)),
        }
    }

    fn refund(&mut self, at: u64, check: &Check) -> bool {
        let cost = check.cost;
        match self {
            Self::Log(log) => {
                log.refund(at, cost);
                true
            }
            Self::Counter(counter) => counter.refund(at, cost),
            Self::Fixed(fixed) => fixed.refund(at, cost),
            Self::Bucket(bucket) => bucket.refund(at, cost),
            Self::Leases(leases) => {
                leases.release(check.lease);
                true
            }
            Self::Quota(quota) => match check.algorithm {
                Algorithm::Calendar(calendar) => quota.refund(at, cost, calendar),
                _ => false,
            },
        }
    }

    /// Counts `units` more at `now`, past the limit if need be, after
    /// [`prepare`](Self::prepare): what a request settled after its
    /// response cost (see [`Store::settle`]). As in the Redis script, a
    /// log, a fixed window and a calendar count at most the burst (a
    /// record of the whole limit already denies every request until it
    /// leaves); a sliding counter and a bucket as their arithmetic allows.
    /// Returns whether it counted any.
    fn charge(&mut self, now: u64, check: &Check, units: u64, placed: &mut Placed) -> bool {
        let units = match self {
            Self::Leases(_) => return false,
            Self::Bucket(bucket) => bucket.chargeable(units),
            Self::Counter(counter) => counter.chargeable(units, check.limit),
            _ => u32::try_from(units.min(u64::from(check.burst))).unwrap_or(u32::MAX),
        };
        if units == 0 {
            return false;
        }
        self.record((now, now), check, units, placed).is_some()
    }

    fn decision(&self, now: u64, check: &Check, admitted: bool, placed: &Placed) -> Decision {
        let (limit, cost) = (check.limit, check.cost);
        match (self, placed) {
            (_, &Placed::HeldElsewhere(until)) => {
                let wait = Duration::from_micros(until.saturating_sub(now));
                Decision::denied(check.burst, 0, wait, Some(wait))
            }
            (Self::Log(log), Placed::Log(window)) => {
                log.decision(now, limit, cost, admitted, window)
            }
            (Self::Log(_), _) => unreachable!("a log is prepared with its window"),
            (Self::Counter(counter), _) => counter.decision(now, limit, cost, admitted),
            (Self::Fixed(fixed), _) => fixed.decision(now, limit, cost, admitted),
            (Self::Bucket(bucket), _) => bucket.decision(now, check, admitted),
            (Self::Leases(leases), _) => leases.decision(check, admitted),
            (Self::Quota(quota), _) => quota.decision(now, limit, cost, admitted),
        }
    }

    fn is_idle(&self, now: u64) -> bool {
        match self {
            Self::Log(log) => log.is_idle(now),
            Self::Counter(counter) => counter.is_idle(now),
            Self::Fixed(fixed) => fixed.is_idle(now),
            Self::Bucket(bucket) => bucket.is_idle(now),
            Self::Leases(leases) => leases.is_idle(now),
            Self::Quota(quota) => quota.is_idle(now),
        }
    }
}

/// What one client has spent under one policy, and until when a denial
/// blocks it.
#[derive(Debug)]
struct Spent {
    counts: Counts,
    /// The end of the client's block (µs); 0 when never blocked.
    blocked_until: u64,
}

impl Spent {
    fn new(algorithm: Algorithm) -> Self {
        Self {
            counts: Counts::new(algorithm),
            blocked_until: 0,
        }
    }

    /// A new state for `check`'s pair, brought up to `now`.
    fn fresh(now: u64, check: &Check) -> (Self, Prepared) {
        let mut spent = Self::new(check.algorithm);
        let (_, prepared) = spent.prepare(now, check);
        (spent, prepared)
    }

    /// Brings the state up to `now` for `check` (starting afresh if the
    /// policy changed algorithm) and says whether the request may be
    /// admitted: its cost fits, and the client is not blocked. A counter
    /// or bucket is only placed at `now` for this decision: what
    /// [`unroll`](Self::unroll) is given puts it back unless it had to
    /// move (as the Redis script writes it only then).
    fn prepare(&mut self, now: u64, check: &Check) -> (bool, Prepared) {
        if !self.counts.is_of(check.algorithm) {
            self.counts = Counts::new(check.algorithm);
        }
        let (fits, placed) = self.counts.prepare(now, check);
        let blocked = self.is_blocked(now, check);
        (fits && !blocked, Prepared { placed, fits })
    }

    /// Puts a counter back as it was before [`prepare`](Self::prepare),
    /// for a decision that counted nothing.
    fn unroll(&mut self, prepared: Prepared) {
        self.counts.unroll(prepared.placed);
    }

    /// Records `cost`, for a request that passes at `pass` (`now`, or
    /// later for a held one), and returns the time it was recorded at
    /// (none for a log given a cost of 0).
    fn record(
        &mut self,
        now: u64,
        pass: u64,
        check: &Check,
        prepared: &mut Prepared,
    ) -> Option<u64> {
        self.counts
            .record((now, pass), check, check.cost, &mut prepared.placed)
    }

    /// When a request that does not fit now would fit within the delay of
    /// `check`'s policy, and no block holds it: the time its policy fits
    /// it, after [`prepare`](Self::prepare). `None` when it must be denied.
    fn held_until(&self, now: u64, check: &Check, prepared: &Prepared) -> Option<u64> {
        if prepared.fits {
            return (!self.is_blocked(now, check)).then_some(now);
        }
        if check.delay_micros == 0 || self.is_blocked(now, check) {
            return None;
        }
        let retry = self
            .counts
            .decision(now, check, false, &prepared.placed)
            .retry_after
            .map_or(0, duration_micros);
        (retry <= check.delay_micros).then_some(now + retry)
    }

    /// Whether the request fits at `pass` (see [`held_until`](Self::held_until)).
    fn fits_at(&self, check: &Check, pass: u64, prepared: &Prepared) -> bool {
        !matches!(prepared.placed, Placed::HeldElsewhere(_)) && self.counts.fits_at(check, pass)
    }

    /// Takes back `cost` units recorded at `at`, after
    /// [`prepare`](Self::prepare); says whether a counter changed.
    fn refund(&mut self, at: u64, check: &Check) -> bool {
        self.counts.refund(at, check)
    }

    /// The decision of a request recorded at `at`, passing at `pass`.
    fn recorded(
        &self,
        now: u64,
        pass: u64,
        check: &Check,
        at: Option<u64>,
        prepared: &Prepared,
    ) -> Decision {
        let mut decision = self.decision(now, check, true, prepared);
        if pass > now {
            decision = decision.with_delayed_for(Duration::from_micros(pass - now));
        }
        match at {
            Some(at) => decision.with_recorded_at(Duration::from_micros(at)),
            None => decision,
        }
    }

    /// The decision of a denied request, which records nothing; a policy
    /// that blocks, denied by its own count, blocks the client from now.
    fn denied(&mut self, now: u64, check: &Check, prepared: Prepared) -> Decision {
        let mut decision = self.decision(now, check, false, &prepared);
        // A denial the delay can hold is no denial for the block.
        let beyond_delay = check.delay_micros == 0
            || decision
                .retry_after
                .is_some_and(|retry| duration_micros(retry) > check.delay_micros);
        if check.block_micros > 0 && !prepared.fits && self.blocked_until <= now && beyond_delay {
            self.blocked_until = now + check.block_micros;
            decision = self.decision(now, check, false, &prepared);
        }
        self.unroll(prepared);
        decision
    }

    fn decision(&self, now: u64, check: &Check, admitted: bool, prepared: &Prepared) -> Decision {
        let mut decision = self.counts.decision(now, check, admitted, &prepared.placed);
        if self.is_blocked(now, check) {
            let left = Duration::from_micros(self.blocked_until - now);
            decision.remaining = 0;
            decision.retry_after = Some(decision.retry_after.map_or(left, |wait| wait.max(left)));
            decision.blocked_for = Some(left);
        }
        decision
    }

    /// Whether the client is blocked under `check` at `now`: a block set
    /// by a policy that no longer blocks (reloaded without `block`) is
    /// lifted, as the Redis script no longer reads its key.
    fn is_blocked(&self, now: u64, check: &Check) -> bool {
        check.block_micros > 0 && self.blocked_until > now
    }

    fn is_idle(&self, now: u64) -> bool {
        self.blocked_until <= now && self.counts.is_idle(now)
    }
}

/// What [`Spent::prepare`] found for one decision: whether the request's
/// cost fits the counts, and what it placed.
#[derive(Debug, Clone, Copy)]
struct Prepared {
    placed: Placed,
    fits: bool,
}

/// A log's window, or a counter's or bucket's state before it was placed
/// at the time of the decision, to put back if the decision counts
/// nothing.
#[derive(Debug, Clone, Copy)]
enum Placed {
    Kept,
    /// Counts that hold units of requests held for their delay, counted
    /// now under another window length, which could not keep those units
    /// until their requests pass: left as they are, they decide nothing
    /// and every request is denied until this time (µs), when the last
    /// of those requests has passed. The Redis script does the same.
    HeldElsewhere(u64),
    Log(Window),
    Counter(SlidingCounter),
    Fixed(FixedWindow),
    Bucket(TokenBucket),
    Quota(Quota),
}

type Pairs = Cache<Pair, Spent, UnitWeighter, CarriedHash>;

#[derive(Debug)]
struct Shard {
    pairs: Pairs,
    /// New pairs taken in since the last sweep of idle ones.
    inserted: usize,
    /// How many new pairs trigger the next sweep.
    sweep_after: usize,
}

impl Shard {
    fn new(capacity: usize) -> Self {
        let options = OptionsBuilder::new()
            .estimated_items_capacity(capacity.min(KEYS_PER_SHARD))
            .weight_capacity(capacity as u64)
            .hot_allocation(RETURNING_SHARE)
            .build()
            .expect("valid cache options");
        Self {
            pairs: Cache::with_options(options, UnitWeighter, CarriedHash, Default::default()),
            inserted: 0,
            sweep_after: MIN_SWEEP_AFTER,
        }
    }

    fn evict_idle(&mut self, now: u64) -> usize {
        let before = self.pairs.len();
        self.pairs.retain(|_, spent| !spent.is_idle(now));
        self.inserted = 0;
        self.sweep_after = self.pairs.len().max(MIN_SWEEP_AFTER);
        crate::metrics::memory_keys(before, self.pairs.len());
        before - self.pairs.len()
    }

    /// Tracks a new pair, already brought up to `now`. Idle pairs are swept
    /// out every so often; at the bound, the cache evicts a pair that was
    /// seen once before one that keeps coming back.
    fn insert(&mut self, hash: u64, check: &Check, spent: Spent, now: u64) {
        if self.inserted >= self.sweep_after {
            self.evict_idle(now);
        }
        self.inserted += 1;
        let pair = Pair {
            hash,
            namespace: check.namespace.clone(),
            policy: check.policy.clone(),
            key: check.key.clone(),
        };
        let before = self.pairs.len();
        self.pairs.insert(pair, spent);
        crate::metrics::memory_keys(before, self.pairs.len());
    }
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Seeded at random per store, so that no client can choose keys that
    /// collide; foldhash's quality variant, a fraction of SipHash's cost
    /// on the request path.
    hasher: foldhash::quality::RandomState,
    clock: Box<dyn Clock>,
}

/// The embedded store, for one process: exact sliding logs in sharded
/// maps, with idle keys evicted and a bound on tracked keys so a flood of
/// distinct clients cannot exhaust memory.
///
/// At the bound the store never refuses a check and never fails open.
/// Idle pairs are swept out regularly (at O(1) per new pair, amortised);
/// between sweeps a new (policy, client) pair takes the place of one seen
/// only once, before any client that keeps coming back (an S3-FIFO style
/// admission, from the `quick_cache` crate). A flood of one-request
/// keys churns among itself while active clients keep their counts, and
/// new clients are still counted.
///
/// Clones share the same state.
///
/// ```
/// use slidegate::{Policy, key::Key, store::{Check, MemoryStore, Store}};
/// use std::time::Duration;
///
/// # tokio_test();
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn tokio_test() {
/// let store = MemoryStore::new();
/// let policy = Policy::new("api", 2, Duration::from_secs(60));
/// let check = [Check::new(&policy, Key::new("alice")).unwrap()];
/// assert!(store.check(&check).await.unwrap()[0].admitted);
/// assert!(store.check(&check).await.unwrap()[0].admitted);
/// assert!(!store.check(&check).await.unwrap()[0].admitted);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store on the system clock tracking at most a million keys.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Starts configuring a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder::default()
    }

    /// How many (policy, client) pairs are tracked.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).pairs.len()).sum()
    }

    /// Whether no pair is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every pair whose counts have all left the window, and returns
    /// how many were dropped. Runs on its own as shards take in new pairs;
    /// call it to reclaim memory eagerly.
    pub fn evict_idle(&self) -> usize {
        let now = self.inner.clock.now_micros();
        self.inner
            .shards
            .iter()
            .map(|s| lock(s).evict_idle(now))
            .sum()
    }

    fn hash_of(&self, check: &Check) -> u64 {
        self.inner.hasher.hash_one((
            check.namespace.as_deref(),
            check.policy.as_ref(),
            check.key.as_str(),
        ))
    }

    /// The shard of a hash, from bits the shard's own table does not use
    /// (it takes the lowest for positions and the highest for tags).
    fn shard_of(&self, hash: u64) -> usize {
        ((hash >> 32) % self.inner.shards.len() as u64) as usize
    }

    fn check_now(&self, checks: &[Check]) -> Decisions {
        match checks {
            [check] => Decisions::from([self.check_one(check)]),
            _ => self.check_batch(checks),
        }
    }

    /// The common case, one policy: one hash, one lock, no bookkeeping.
    fn check_one(&self, check: &Check) -> Decision {
        let inner = &*self.inner;
        let now = inner.clock.now_micros();
        let hash = self.hash_of(check);
        let mut shard = lock(&inner.shards[self.shard_of(hash)]);
        if let Some(mut spent) = shard.pairs.get_mut(&PairOf { hash, check }) {
            let (fits, mut prepared) = spent.prepare(now, check);
            let pass = if fits {
                now
            } else {
                match spent
                    .held_until(now, check, &prepared)
                    .filter(|&pass| spent.fits_at(check, pass, &prepared))
                {
                    Some(pass) => pass,
                    None => return spent.denied(now, check, prepared),
                }
            };
            let at = spent.record(now, pass, check, &mut prepared);
            return spent.recorded(now, pass, check, at, &prepared);
        }
        let (mut spent, mut prepared) = Spent::fresh(now, check);
        if !prepared.fits {
            return spent.decision(now, check, false, &prepared);
        }
        let at = spent.record(now, now, check, &mut prepared);
        let decision = spent.recorded(now, now, check, at, &prepared);
        shard.insert(hash, check, spent, now);
        decision
    }

    fn check_batch(&self, checks: &[Check]) -> Decisions {
        let inner = &*self.inner;
        let now = inner.clock.now_micros();
        let hashes: Vec<u64> = checks.iter().map(|c| self.hash_of(c)).collect();
        // Lock each shard once, in ascending order, so batches never deadlock.
        let mut order: Vec<usize> = hashes.iter().map(|&h| self.shard_of(h)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&id| lock(&inner.shards[id])).collect();
        let guard_of = |hash: u64| {
            order
                .binary_search(&self.shard_of(hash))
                .expect("every check's shard is locked")
        };

        let mut all_fit = true;
        let mut tracked = Vec::with_capacity(checks.len());
        let mut found = Vec::with_capacity(checks.len());
        for (check, &hash) in checks.iter().zip(&hashes) {
            let pairs = &mut guards[guard_of(hash)].pairs;
            all_fit &= match pairs.get_mut(&PairOf { hash, check }) {
                Some(mut spent) => {
                    tracked.push(true);
                    let (fits, prepared) = spent.prepare(now, check);
                    found.push(Some(prepared));
                    fits
                }
                None => {
                    tracked.push(false);
                    found.push(None);
                    check.cost <= check.burst
                }
            };
        }
        // A request that does not fit now may be held until every policy
        // fits it, each within its delay (see `Spent::held_until`).
        let pass = if all_fit {
            Some(now)
        } else {
            let mut pass = Some(now);
            for (index, (check, &hash)) in checks.iter().zip(&hashes).enumerate() {
                let pairs = &mut guards[guard_of(hash)].pairs;
                let until = match (pairs.peek_mut(&PairOf { hash, check }), &found[index]) {
                    (Some(spent), Some(prepared)) => spent.held_until(now, check, prepared),
                    // A new pair fits whatever it can ever fit now.
                    _ => (check.cost <= check.burst).then_some(now),
                };
                pass = pass.zip(until).map(|(pass, until)| pass.max(until));
            }
            pass.filter(|&pass| {
                checks
                    .iter()
                    .zip(&hashes)
                    .enumerate()
                    .all(|(index, (check, &hash))| {
                        let pairs = &mut guards[guard_of(hash)].pairs;
                        match (pairs.peek_mut(&PairOf { hash, check }), &found[index]) {
                            (Some(spent), Some(prepared)) => spent.fits_at(check, pass, prepared),
                            _ => {
                                let (spent, prepared) = Spent::fresh(now, check);
                                spent.fits_at(check, pass, &prepared)
                            }
                        }
                    })
            })
        };
        let mut decisions: Vec<Option<Decision>> = vec![None; checks.len()];
        // Tracked pairs first: a new pair taken in below may push one out,
        // and its decision must not be lost with it.
        for (index, (check, &hash)) in checks.iter().zip(&hashes).enumerate() {
            let pairs = &mut guards[guard_of(hash)].pairs;
            if let Some(mut spent) = pairs
                .peek_mut(&PairOf { hash, check })
                .filter(|_| tracked[index])
            {
                let mut prepared = found[index].expect("a tracked pair is prepared");
                decisions[index] = Some(match pass {
                    Some(pass) => {
                        let at = spent.record(now, pass, check, &mut prepared);
                        spent.recorded(now, pass, check, at, &prepared)
                    }
                    None => spent.denied(now, check, prepared),
                });
            }
        }
        for (index, (check, &hash)) in checks.iter().zip(&hashes).enumerate() {
            if decisions[index].is_some() {
                continue;
            }
            let (mut spent, mut prepared) = Spent::fresh(now, check);
            if let Some(pass) = pass {
                let at = spent.record(now, pass, check, &mut prepared);
                decisions[index] = Some(spent.recorded(now, pass, check, at, &prepared));
                guards[guard_of(hash)].insert(hash, check, spent, now);
            } else {
                decisions[index] = Some(spent.decision(now, check, false, &prepared));
            }
        }
        decisions
            .into_iter()
            .map(|decision| decision.expect("every check is decided"))
            .collect()
    }
}

impl MemoryStore {
    /// Each check's decision as it would be now, recording nothing: admitted
    /// if every check fits.
    fn peek_now(&self, checks: &[Check]) -> Decisions {
        let now = self.inner.clock.now_micros();
        let mut decisions: Decisions = checks
            .iter()
            .map(|check| {
                let hash = self.hash_of(check);
                let mut shard = lock(&self.inner.shards[self.shard_of(hash)]);
                match shard.pairs.peek_mut(&PairOf { hash, check }) {
                    Some(mut spent) => {
                        let (_, prepared) = spent.prepare(now, check);
                        let decision = spent.decision(now, check, false, &prepared);
                        spent.unroll(prepared);
                        decision
                    }
                    None => {
                        let (spent, prepared) = Spent::fresh(now, check);
                        spent.decision(now, check, false, &prepared)
                    }
                }
            })
            .collect();
        let all_fit = decisions.iter().all(|d| d.retry_after.is_none());
        for decision in decisions.iter_mut() {
            decision.admitted = all_fit;
        }
        decisions
    }

    /// Takes back each check's units, recorded at the time beside it, and
    /// for a settlement counts the units beside them in `costs` (see
    /// [`Store::settle`]).
    fn refund_now(&self, checks: &[Check], recorded_at: &[Duration], costs: Option<&[u64]>) {
        let now = self.inner.clock.now_micros();
        for (index, (check, at)) in checks.iter().zip(recorded_at).enumerate() {
            let hash = self.hash_of(check);
            let mut shard = lock(&self.inner.shards[self.shard_of(hash)]);
            let cost = costs.map(|costs| costs[index]);
            let Some(mut spent) = shard.pairs.peek_mut(&PairOf { hash, check }) else {
                // Nothing left to take back; a settlement's cost is still
                // counted, on a new pair.
                if let Some(cost) = cost {
                    let (mut spent, mut prepared) = Spent::fresh(now, check);
                    if spent.counts.charge(now, check, cost, &mut prepared.placed) {
                        shard.insert(hash, check, spent, now);
                    }
                }
                continue;
            };
            // Units counted by another algorithm (the policy was reloaded
            // as another since) are not in these counts: the refund takes
            // nothing, and the new counts stay, as on Redis, where each
            // algorithm has a key of its own. A charge alone (nothing
            // recorded: a time of zero) is counted as a check of its
            // algorithm would count it, in counts of that algorithm.
            let charge_alone = cost.is_some() && at.is_zero();
            if !spent.counts.is_of(check.algorithm) && !charge_alone {
                continue;
            }
            let (_, mut prepared) = spent.prepare(now, check);
            // Counts held elsewhere are left as they are.
            if matches!(prepared.placed, Placed::HeldElsewhere(_)) {
                spent.unroll(prepared);
                continue;
            }
            let refunded = spent.refund(duration_micros(*at), check);
            let charged = cost
                .is_some_and(|cost| spent.counts.charge(now, check, cost, &mut prepared.placed));
            if !refunded && !charged {
                spent.unroll(prepared);
            }
        }
    }
}

impl MemoryStore {
    /// Keeps each concurrency check's lease a lease time from now, taken
    /// again if it expired meanwhile.
    fn renew_now(&self, checks: &[Check]) -> Vec<bool> {
        let now = self.inner.clock.now_micros();
        checks
            .iter()
            .map(|check| {
                if check.algorithm != Algorithm::Concurrency {
                    return true;
                }
                let hash = self.hash_of(check);
                let mut shard = lock(&self.inner.shards[self.shard_of(hash)]);
                match shard.pairs.peek_mut(&PairOf { hash, check }) {
                    Some(mut spent) => match &mut spent.counts {
                        Counts::Leases(leases) => leases.renew(now, check),
                        _ => true,
                    },
                    None => {
                        let (mut spent, _) = Spent::fresh(now, check);
                        let held = match &mut spent.counts {
                            Counts::Leases(leases) => leases.renew(now, check),
                            _ => true,
                        };
                        shard.insert(hash, check, spent, now);
                        held
                    }
                }
            })
            .collect()
    }

    /// Forgets each check's pair.
    fn reset_now(&self, checks: &[Check]) {
        for check in checks {
            let hash = self.hash_of(check);
            let mut shard = lock(&self.inner.shards[self.shard_of(hash)]);
            let before = shard.pairs.len();
            shard.pairs.remove(&PairOf { hash, check });
            crate::metrics::memory_keys(before, shard.pairs.len());
        }
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard cannot leave a log half-updated in a way
    // that over-admits, so a poisoned lock is still usable.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Store for MemoryStore {
    fn check(&self, checks: &[Check]) -> CheckFuture {
        CheckFuture::ready(Ok(self.check_now(checks)))
    }

    fn peek(&self, checks: &[Check]) -> CheckFuture {
        CheckFuture::ready(Ok(self.peek_now(checks)))
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> CheckFuture<()> {
        if let Some(unpaired) = unpaired_refund(checks, recorded_at) {
            return CheckFuture::ready(Err(unpaired));
        }
        self.refund_now(checks, recorded_at, None);
        CheckFuture::ready(Ok(()))
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> CheckFuture<()> {
        if let Some(unpaired) = unpaired_settlement(checks, recorded_at, costs) {
            return CheckFuture::ready(Err(unpaired));
        }
        self.refund_now(checks, recorded_at, Some(costs));
        CheckFuture::ready(Ok(()))
    }

    fn renew(&self, checks: &[Check]) -> CheckFuture<Vec<bool>> {
        CheckFuture::ready(Ok(self.renew_now(checks)))
    }

    fn reset(&self, checks: &[Check]) -> CheckFuture<()> {
        self.reset_now(checks);
        CheckFuture::ready(Ok(()))
    }

    fn state(&self) -> Option<StateId> {
        Some(StateId::of(&self.inner))
    }
}

/// Configures a [`MemoryStore`].
#[derive(Debug)]
#[must_use]
pub struct MemoryStoreBuilder {
    clock: Box<dyn Clock>,
    max_keys: usize,
}

impl Default for MemoryStoreBuilder {
    fn default() -> Self {
        Self {
            clock: Box::new(SystemClock::new()),
            max_keys: DEFAULT_MAX_KEYS,
        }
    }
}

impl MemoryStoreBuilder {
    /// Reads time from `clock` (a [`FakeClock`](crate::clock::FakeClock) in tests).
    ///
    /// ```
    /// use slidegate::{clock::FakeClock, store::MemoryStore};
    ///
    /// let clock = FakeClock::new(0);
    /// let store = MemoryStore::builder().with_clock(clock.clone()).build();
    /// ```
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Box::new(clock);
        self
    }

    /// Tracks at most `max_keys` (policy, client) pairs (default one
    /// million), split evenly across up to 64 shards. At the bound, a new
    /// pair takes the place of one seen only once before any that keeps
    /// coming back (idle pairs are swept out regularly); checks are never
    /// refused.
    ///
    /// ```
    /// use slidegate::store::MemoryStore;
    ///
    /// let store = MemoryStore::builder().with_max_keys(10_000).build();
    /// ```
    pub fn with_max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let shards = (self.max_keys / KEYS_PER_SHARD).clamp(1, MAX_SHARDS);
        let per_shard = self.max_keys / shards;
        let extra = self.max_keys % shards;
        let shards = (0..shards)
            .map(|index| Mutex::new(Shard::new(per_shard + usize::from(index < extra))))
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                hasher: foldhash::quality::RandomState::default(),
                clock: self.clock,
            }),
        }
    }
}
