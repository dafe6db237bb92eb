//! The embedded store: sharded logs in process memory.

use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};

use hashbrown::HashTable;

use super::counter::{FixedWindow, SlidingCounter};
use super::sliding_log::Log;
use super::{Check, CheckFuture, Store, StoreError};
use crate::clock::{Clock, SystemClock, duration_micros};
use crate::{Algorithm, Decision, Key};

const DEFAULT_MAX_KEYS: usize = 1_000_000;
const SHARDS: usize = 64;
/// A shard sweeps idle logs when it grows past this many, then past twice
/// what the sweep left, so sweeping costs O(1) per insert amortised.
const MIN_SWEEP_AT: usize = 256;

/// What one (policy, client) pair has spent, with its hash, computed once
/// per check.
#[derive(Debug)]
struct Entry {
    hash: u64,
    policy: Arc<str>,
    key: Key,
    spent: Spent,
}

impl Entry {
    fn is(&self, check: &Check) -> bool {
        self.policy == check.policy && self.key == check.key
    }
}

/// What one client has spent under one policy, per algorithm.
#[derive(Debug)]
enum Spent {
    Log(Log),
    Counter(SlidingCounter),
    Fixed(FixedWindow),
}

impl Spent {
    fn new(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::SlidingLog => Self::Log(Log::default()),
            Algorithm::SlidingCounter => Self::Counter(SlidingCounter::default()),
            Algorithm::FixedWindow => Self::Fixed(FixedWindow::default()),
        }
    }

    /// A new state for `check`'s pair, brought up to `now`.
    fn fresh(now: u64, check: &Check) -> Self {
        let mut spent = Self::new(check.algorithm);
        spent.prepare(now, check);
        spent
    }

    /// Brings the state up to `now` for `check` (starting afresh if the
    /// policy changed algorithm) and says whether its cost fits.
    fn prepare(&mut self, now: u64, check: &Check) -> bool {
        let window = duration_micros(check.window);
        let same_algorithm = matches!(
            (&*self, check.algorithm),
            (Self::Log(_), Algorithm::SlidingLog)
                | (Self::Counter(_), Algorithm::SlidingCounter)
                | (Self::Fixed(_), Algorithm::FixedWindow)
        );
        if !same_algorithm {
            *self = Self::new(check.algorithm);
        }
        match self {
            Self::Log(log) => {
                log.prune(now, window);
                log.fits(check.limit, check.cost)
            }
            Self::Counter(counter) => {
                counter.roll(now, window / 1000);
                counter.fits(now, check.limit, check.cost)
            }
            Self::Fixed(fixed) => {
                fixed.roll(now, window);
                fixed.fits(check.limit, check.cost)
            }
        }
    }

    fn record(&mut self, now: u64, cost: u32) {
        match self {
            Self::Log(log) => log.record(now, cost),
            Self::Counter(counter) => counter.record(cost),
            Self::Fixed(fixed) => fixed.record(cost),
        }
    }

    fn decision(&self, now: u64, check: &Check, admitted: bool) -> Decision {
        let (limit, cost) = (check.limit, check.cost);
        match self {
            Self::Log(log) => log.decision(now, limit, cost, admitted),
            Self::Counter(counter) => counter.decision(now, limit, cost, admitted),
            Self::Fixed(fixed) => fixed.decision(now, limit, cost, admitted),
        }
    }

    fn is_idle(&self, now: u64) -> bool {
        match self {
            Self::Log(log) => log.is_idle(now),
            Self::Counter(counter) => counter.is_idle(now),
            Self::Fixed(fixed) => fixed.is_idle(now),
        }
    }
}

#[derive(Debug)]
struct Shard {
    logs: HashTable<Entry>,
    sweep_at: usize,
}

impl Shard {
    fn evict_idle(&mut self, now: u64) -> usize {
        let before = self.logs.len();
        self.logs.retain(|entry| !entry.spent.is_idle(now));
        self.sweep_at = (self.logs.len() * 2).max(MIN_SWEEP_AT);
        before - self.logs.len()
    }

    fn get_mut(&mut self, hash: u64, check: &Check) -> Option<&mut Spent> {
        self.logs
            .find_mut(hash, |entry| entry.is(check))
            .map(|entry| &mut entry.spent)
    }

    fn get(&self, hash: u64, check: &Check) -> Option<&Spent> {
        self.logs
            .find(hash, |entry| entry.is(check))
            .map(|entry| &entry.spent)
    }

    /// Makes room for `check`'s pair, which is not tracked yet, and tracks
    /// it, brought up to `now`.
    fn insert(
        &mut self,
        hash: u64,
        check: &Check,
        now: u64,
        inner: &Inner,
    ) -> Result<&mut Spent, StoreError> {
        make_room(self, now, inner)?;
        let entry = Entry {
            hash,
            policy: check.policy.clone(),
            key: check.key.clone(),
            spent: Spent::fresh(now, check),
        };
        let inserted = self.logs.insert_unique(hash, entry, |entry| entry.hash);
        Ok(&mut inserted.into_mut().spent)
    }
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Box<dyn Clock>,
    max_keys: usize,
    max_keys_per_shard: usize,
}

/// The embedded store, for one process: exact sliding logs in sharded
/// maps, with idle keys evicted and a bound on tracked keys so a flood of
/// distinct clients cannot exhaust memory. When the bound is reached, a
/// check that needs a new key fails with [`StoreError::Full`] and the
/// policy's fail mode decides.
///
/// Clones share the same state.
///
/// ```
/// use slidegate::{Check, Key, MemoryStore, Policy, Store};
/// use std::time::Duration;
///
/// # tokio_test();
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn tokio_test() {
/// let store = MemoryStore::new();
/// let policy = Policy::new("api", 2, Duration::from_secs(60));
/// let check = [Check::new(&policy, Key::new("alice"))];
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

    /// How many (policy, client) logs are tracked.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).logs.len()).sum()
    }

    /// Whether no log is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every log whose entries have all left the window, and returns
    /// how many were dropped. Runs on its own as shards grow; call it to
    /// reclaim memory eagerly.
    pub fn evict_idle(&self) -> usize {
        let now = self.inner.clock.now_micros();
        self.inner
            .shards
            .iter()
            .map(|s| lock(s).evict_idle(now))
            .sum()
    }

    fn hash_of(&self, check: &Check) -> u64 {
        self.inner
            .hasher
            .hash_one((check.policy.as_ref(), check.key.as_str()))
    }

    fn shard_of(hash: u64) -> usize {
        (hash % SHARDS as u64) as usize
    }

    fn check_now(&self, checks: &[Check]) -> Result<Vec<Decision>, StoreError> {
        match checks {
            [check] => self.check_one(check).map(|decision| vec![decision]),
            _ => self.check_batch(checks),
        }
    }

    /// The common case, one policy: one hash, one lock, no bookkeeping.
    fn check_one(&self, check: &Check) -> Result<Decision, StoreError> {
        let inner = &*self.inner;
        let now = inner.clock.now_micros();
        let hash = self.hash_of(check);
        let mut shard = lock(&inner.shards[Self::shard_of(hash)]);
        if let Some(spent) = shard.get_mut(hash, check) {
            let admitted = spent.prepare(now, check);
            if admitted {
                spent.record(now, check.cost);
            }
            return Ok(spent.decision(now, check, admitted));
        }
        if check.cost > check.limit {
            return Ok(denied(None, now, check));
        }
        let spent = shard.insert(hash, check, now, inner)?;
        spent.record(now, check.cost);
        Ok(spent.decision(now, check, true))
    }

    fn check_batch(&self, checks: &[Check]) -> Result<Vec<Decision>, StoreError> {
        let inner = &*self.inner;
        let now = inner.clock.now_micros();
        let hashes: Vec<u64> = checks.iter().map(|c| self.hash_of(c)).collect();
        // Lock each shard once, in ascending order, so batches never deadlock.
        let mut order: Vec<usize> = hashes.iter().map(|&h| Self::shard_of(h)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&id| lock(&inner.shards[id])).collect();
        let guard_of = |hash: u64| {
            order
                .binary_search(&Self::shard_of(hash))
                .expect("every check's shard is locked")
        };

        let mut all_fit = true;
        for (check, &hash) in checks.iter().zip(&hashes) {
            all_fit &= match guards[guard_of(hash)].get_mut(hash, check) {
                Some(spent) => spent.prepare(now, check),
                None => check.cost <= check.limit,
            };
        }
        if all_fit {
            // Make room for every new pair before recording any, so a full
            // store refuses the batch whole.
            for (check, &hash) in checks.iter().zip(&hashes) {
                let shard = &mut guards[guard_of(hash)];
                if shard.get(hash, check).is_none() {
                    shard.insert(hash, check, now, inner)?;
                }
            }
        }
        Ok(checks
            .iter()
            .zip(&hashes)
            .map(|(check, &hash)| {
                let shard = &mut guards[guard_of(hash)];
                if all_fit {
                    let spent = shard.get_mut(hash, check).expect("inserted above");
                    spent.record(now, check.cost);
                    spent.decision(now, check, true)
                } else {
                    denied(shard.get(hash, check), now, check)
                }
            })
            .collect())
    }
}

/// The decision for a request that is not admitted, from its pair's state
/// (already brought up to `now`) or a fresh one.
fn denied(spent: Option<&Spent>, now: u64, check: &Check) -> Decision {
    match spent {
        Some(spent) => spent.decision(now, check, false),
        None => Spent::fresh(now, check).decision(now, check, false),
    }
}

/// Ensures a shard can take one more log: sweeps idle logs when it has
/// grown enough, and refuses when it is at its share of the bound.
fn make_room(shard: &mut Shard, now: u64, inner: &Inner) -> Result<(), StoreError> {
    if shard.logs.len() >= shard.sweep_at || shard.logs.len() >= inner.max_keys_per_shard {
        shard.evict_idle(now);
    }
    if shard.logs.len() >= inner.max_keys_per_shard {
        return Err(StoreError::Full {
            max_keys: inner.max_keys,
        });
    }
    Ok(())
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
        CheckFuture::ready(self.check_now(checks))
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
    /// Reads time from `clock` (a [`FakeClock`](crate::FakeClock) in tests).
    ///
    /// ```
    /// use slidegate::{FakeClock, MemoryStore};
    ///
    /// let clock = FakeClock::new(0);
    /// let store = MemoryStore::builder().clock(clock.clone()).build();
    /// ```
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Box::new(clock);
        self
    }

    /// Tracks at most about `max_keys` (policy, client) logs (default one
    /// million). The bound is split evenly across 64 shards.
    ///
    /// ```
    /// use slidegate::MemoryStore;
    ///
    /// let store = MemoryStore::builder().max_keys(10_000).build();
    /// ```
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    logs: HashTable::new(),
                    sweep_at: MIN_SWEEP_AT,
                })
            })
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                hasher: RandomState::new(),
                clock: self.clock,
                max_keys: self.max_keys,
                max_keys_per_shard: self.max_keys.div_ceil(SHARDS),
            }),
        }
    }
}
