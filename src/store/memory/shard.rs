//! The memory store's shards: each a bounded map of (policy, client)
//! pairs to what they have spent, with S3-FIFO-style admission and a
//! sweep of idle pairs.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use quick_cache::unsync::Cache;
use quick_cache::{Equivalent, OptionsBuilder, UnitWeighter};

use super::spent::Spent;
use crate::key::Key;
use crate::store::Check;

/// Keys per shard below which the store does not split further: a small
/// bound in few shards keeps room for active clients in each.
pub(super) const KEYS_PER_SHARD: usize = 1024;
/// The share of a shard kept for clients seen more than once; new keys
/// wait in the rest until they come back (S3-FIFO's small queue is 10%).
pub(super) const RETURNING_SHARE: f64 = 0.9;
/// A shard sweeps idle pairs once it has taken in as many new pairs as it
/// held after its last sweep (and at least this many), so sweeping costs
/// O(1) per insert amortised, at the bound too.
pub(super) const MIN_SWEEP_AFTER: usize = 256;

/// One (policy, client) pair, as the shard's map key, with its hash
/// computed once per check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Pair {
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
pub(super) struct PairOf<'a> {
    pub(super) hash: u64,
    pub(super) check: &'a Check,
}

impl Hash for PairOf<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl Equivalent<Pair> for PairOf<'_> {
    fn equivalent(&self, pair: &Pair) -> bool {
        pair.policy == *self.check.policy()
            && pair.key == self.check.key
            && pair.namespace == self.check.namespace
    }
}

/// Hashes a [`Pair`] or [`PairOf`] to the hash it carries, already mixed.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CarriedHash;

impl BuildHasher for CarriedHash {
    type Hasher = Carried;

    fn build_hasher(&self) -> Carried {
        Carried(0)
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Carried(u64);

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

pub(super) type Pairs = Cache<Pair, Spent, UnitWeighter, CarriedHash>;

#[derive(Debug)]
pub(super) struct Shard {
    pub(super) pairs: Pairs,
    /// New pairs taken in since the last sweep of idle ones.
    inserted: usize,
    /// How many new pairs trigger the next sweep.
    sweep_after: usize,
    /// The reservations settled (by their ids, see `Check::id`), each
    /// with the time until which it is kept: a second settlement of one
    /// does nothing, as the Redis script's marks (`:s`) say. Kept beside
    /// the pairs, which most settle nothing into, and through a reset.
    settled: foldhash::HashMap<u64, u64>,
    /// How many marks trigger the next sweep of those past their time.
    sweep_settled_after: usize,
}

/// How long (µs) a settlement's mark is kept from when it lands, as the
/// Redis script keeps it (`SETTLED_MARKS` in `lua/driver.lua`): longer
/// than the layer goes on sending a settlement that failed.
const SETTLED_MARKS: u64 = 300_000_000;

/// The fewest marks a sweep of those past their time waits for.
const MIN_SETTLED_SWEEP: usize = 64;

impl Shard {
    pub(super) fn new(capacity: usize) -> Self {
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
            settled: foldhash::HashMap::default(),
            sweep_settled_after: MIN_SETTLED_SWEEP,
        }
    }

    /// Whether the reservation `id` was settled already.
    pub(super) fn was_settled(&self, now: u64, id: u64) -> bool {
        self.settled.get(&id).is_some_and(|&until| until > now)
    }

    /// Marks the settlement of the reservation `id`; marks past their
    /// time are swept once they have doubled since the last sweep.
    pub(super) fn mark_settled(&mut self, now: u64, id: u64) {
        self.settled.insert(id, now + SETTLED_MARKS);
        if self.settled.len() >= self.sweep_settled_after {
            self.settled.retain(|_, until| *until > now);
            self.sweep_settled_after = (2 * self.settled.len()).max(MIN_SETTLED_SWEEP);
        }
    }

    pub(super) fn evict_idle(&mut self, now: u64) -> usize {
        let before = self.pairs.len();
        self.pairs.retain(|_, spent| !spent.is_idle(now));
        self.inserted = 0;
        self.sweep_after = self.pairs.len().max(MIN_SWEEP_AFTER);
        crate::store::gauges::memory_keys(before, self.pairs.len());
        before - self.pairs.len()
    }

    /// Tracks a new pair, already brought up to `now`. Idle pairs are swept
    /// out every so often; at the bound, the cache evicts a pair that was
    /// seen once before one that keeps coming back.
    pub(super) fn insert(&mut self, hash: u64, check: &Check, spent: Spent, now: u64) {
        if self.inserted >= self.sweep_after {
            self.evict_idle(now);
        }
        self.inserted += 1;
        let pair = Pair {
            hash,
            namespace: check.namespace.clone(),
            policy: check.policy().clone(),
            key: check.key.clone(),
        };
        let before = self.pairs.len();
        self.pairs.insert(pair, spent);
        crate::store::gauges::memory_keys(before, self.pairs.len());
    }
}

pub(super) fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard cannot leave a log half-updated in a way
    // that over-admits, so a poisoned lock is still usable.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
