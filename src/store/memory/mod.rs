//! The embedded store: sharded logs in process memory, bounded, with
//! S3-FIFO-style admission so a flood of new keys never pushes out the
//! clients that keep coming back.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

mod bucket;
mod calendar;
mod counter;
mod fixed;
mod lease;
mod log;
mod shard;
mod spent;

pub(crate) use lease::next_id;

use self::shard::{KEYS_PER_SHARD, PairOf, Shard, lock};
use self::spent::{Placed, Spent, State};
use super::{Check, Decisions, Store, StoreFuture, unpaired_refund, unpaired_settlement};
use crate::clock::{Clock, SystemClock, duration_micros};
use crate::policy::Algorithm;
use crate::store::Decision;

const DEFAULT_MAX_KEYS: usize = 1_000_000;
const MAX_SHARDS: usize = 64;

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Seeded at random per store, so that no client can choose keys that
    /// collide; foldhash's quality variant, a fraction of SipHash's cost
    /// on the request path.
    hasher: foldhash::quality::RandomState,
    clock: Box<dyn Clock>,
    /// The tables of [`Store::entries`], by name.
    tables: Mutex<HashMap<String, HashMap<String, String>>>,
}

/// The embedded store, for one process: exact sliding logs in sharded
/// maps, with idle keys evicted and a bound on tracked keys so a flood of
/// distinct clients cannot exhaust memory. Clones share the same state.
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
/// assert!(store.check(&check).await.unwrap()[0].admitted());
/// assert!(store.check(&check).await.unwrap()[0].admitted());
/// assert!(!store.check(&check).await.unwrap()[0].admitted());
/// # }
/// ```
///
/// # The bound
///
/// The store tracks at most a million (policy, client) pairs by default
/// ([`MemoryStoreBuilder::with_max_keys`], config `[memory] max_keys`).
/// Measured on this crate's benchmark (`cargo bench --bench memory`), a
/// pair costs about 195 bytes with a sliding log holding one request, and
/// 116 bytes with a counter; a log grows by 16 bytes per request in its
/// window (in a buffer that doubles). A million pairs is about 190 MB.
///
/// At the bound the store never refuses a check and never fails open.
/// Idle pairs (every count left the window) are swept out each time a
/// shard has taken in as many new pairs as it held after its last sweep,
/// which costs O(1) per new pair, amortised ([`evict_idle`](Self::evict_idle)
/// sweeps at once). Between sweeps, a new pair takes the place of one seen
/// only once before any client that keeps coming back: new pairs wait in a
/// small queue (a tenth of the bound) and move to the main one when they
/// are seen again, as in S3-FIFO (the `quick_cache` crate's admission). A
/// flood of one-request clients churns among itself, while clients that
/// keep sending keep their counts and new clients are still counted. What
/// a full store can forget is the count of a client seen once, not yet
/// back.
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
            check.policy().as_ref(),
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
            _ => self.check_together(checks),
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

    /// A request of several checks, decided all-or-nothing under the
    /// locks of every shard they touch.
    fn check_together(&self, checks: &[Check]) -> Decisions {
        let inner = &*self.inner;
        let now = inner.clock.now_micros();
        let hashes: Vec<u64> = checks.iter().map(|c| self.hash_of(c)).collect();
        // Lock each shard once, in ascending order, so no two requests deadlock.
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
        let all_fit = decisions.iter().all(|d| d.retry_after().is_none());
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
            let at_us = duration_micros(*at);
            // A settlement of a reservation named by its id (not a charge
            // alone, nor a check without one).
            let settled = cost.is_some() && at_us != 0 && check.id != 0;
            // Settled already (sent twice): nothing more.
            if settled && shard.was_settled(now, check.id) {
                continue;
            }
            let Some(mut spent) = shard.pairs.peek_mut(&PairOf { hash, check }) else {
                // Nothing left to take back; a settlement's cost is still
                // counted, on a new pair, but not for a log's units that
                // have left its window (see `Refunded`).
                let named = at.is_zero()
                    || check.algorithm() != Algorithm::SlidingLog
                    || spent::in_window(now, at_us, check);
                let cost = cost.map(|cost| settled_units(cost, named, check));
                if let Some(cost) = cost.filter(|&cost| cost > 0) {
                    let (mut spent, mut prepared) = Spent::fresh(now, check);
                    if spent.state.charge(now, check, cost, &mut prepared.placed) {
                        shard.insert(hash, check, spent, now);
                        if settled {
                            shard.mark_settled(now, check.id);
                        }
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
            if !spent.state.is_of(check.algorithm()) && !charge_alone {
                continue;
            }
            let (_, mut prepared) = spent.prepare(now, check);
            // Counts held elsewhere are left as they are.
            if matches!(prepared.placed, Placed::HeldElsewhere(_)) {
                spent.unroll(prepared);
                continue;
            }
            let refunded = spent.refund(now, at_us, check);
            let charged = cost.is_some_and(|cost| {
                let units = settled_units(cost, charge_alone || refunded.named, check);
                units > 0 && spent.state.charge(now, check, units, &mut prepared.placed)
            });
            if !refunded.changed && !charged {
                spent.unroll(prepared);
            }
            drop(spent);
            if settled {
                shard.mark_settled(now, check.id);
            }
        }
    }
}

/// The units a settlement of `check` counts, `cost` the request's final
/// cost: all of them where its reserved units are still named, only
/// those beyond the reservation where they are not (a log's that have
/// left the window, which no record ever counted), as in the Redis
/// script.
fn settled_units(cost: u64, named: bool, check: &Check) -> u64 {
    if named {
        cost
    } else {
        cost.saturating_sub(u64::from(check.cost))
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
                if check.algorithm() != Algorithm::Concurrency {
                    return true;
                }
                let hash = self.hash_of(check);
                let mut shard = lock(&self.inner.shards[self.shard_of(hash)]);
                match shard.pairs.peek_mut(&PairOf { hash, check }) {
                    Some(mut spent) => match &mut spent.state {
                        State::Leases(leases) => leases.renew(now, check),
                        _ => true,
                    },
                    None => {
                        let (mut spent, _) = Spent::fresh(now, check);
                        let held = match &mut spent.state {
                            State::Leases(leases) => leases.renew(now, check),
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
            crate::store::gauges::memory_keys(before, shard.pairs.len());
        }
    }
}

impl Store for MemoryStore {
    fn check(&self, checks: &[Check]) -> StoreFuture {
        StoreFuture::ready(Ok(self.check_now(checks)))
    }

    fn peek(&self, checks: &[Check]) -> StoreFuture {
        StoreFuture::ready(Ok(self.peek_now(checks)))
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        if let Some(unpaired) = unpaired_refund(checks, recorded_at) {
            return StoreFuture::ready(Err(unpaired));
        }
        self.refund_now(checks, recorded_at, None);
        StoreFuture::ready(Ok(()))
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> StoreFuture<()> {
        if let Some(unpaired) = unpaired_settlement(checks, recorded_at, costs) {
            return StoreFuture::ready(Err(unpaired));
        }
        self.refund_now(checks, recorded_at, Some(costs));
        StoreFuture::ready(Ok(()))
    }

    fn renew(&self, checks: &[Check]) -> StoreFuture<Vec<bool>> {
        StoreFuture::ready(Ok(self.renew_now(checks)))
    }

    fn entries(&self, table: &str) -> StoreFuture<Vec<(String, String)>> {
        let tables = tables_of(&self.inner);
        let entries = tables.get(table).map_or_else(Vec::new, |entries| {
            entries
                .iter()
                .map(|(field, value)| (field.clone(), value.clone()))
                .collect()
        });
        StoreFuture::ready(Ok(entries))
    }

    fn set_entry(&self, table: &str, field: &str, value: &str) -> StoreFuture<()> {
        let mut tables = tables_of(&self.inner);
        let entries = tables.entry(table.to_owned()).or_default();
        entries.insert(field.to_owned(), value.to_owned());
        StoreFuture::ready(Ok(()))
    }

    fn remove_entry(&self, table: &str, field: &str, holding: Option<&str>) -> StoreFuture<()> {
        if let Some(entries) = tables_of(&self.inner).get_mut(table)
            && holding
                .is_none_or(|holding| entries.get(field).is_some_and(|value| value == holding))
        {
            entries.remove(field);
        }
        StoreFuture::ready(Ok(()))
    }

    fn reset(&self, checks: &[Check]) -> StoreFuture<()> {
        self.reset_now(checks);
        StoreFuture::ready(Ok(()))
    }

    fn shared_state(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        Some(self.inner.clone())
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
                tables: Mutex::default(),
            }),
        }
    }
}

/// The tables of [`Store::entries`], locked: a panic while they were held
/// left each entry whole.
fn tables_of(inner: &Inner) -> MutexGuard<'_, HashMap<String, HashMap<String, String>>> {
    inner
        .tables
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
