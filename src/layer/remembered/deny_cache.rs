//! [`DenyCache`]: answering a denied client locally until its retry time,
//! without a store round trip.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use quick_cache::sync::Cache;
use smallvec::SmallVec;

use crate::clock::{Clock, SystemClock, duration_micros};
use crate::key::Key;
use crate::layer::decide::priced::Price;
use crate::policy::Terms;
use crate::response::problem::TooManyBody;
use crate::store::Checks;
use crate::store::{Check, Decision, Scope};

/// Entries a layer's deny cache holds by default.
pub(crate) const DEFAULT_CAPACITY: usize = 10_000;

/// What a store said when it denied a client under one policy.
#[derive(Debug, Clone)]
struct Entry {
    /// Until when (µs) the request cannot fit: a lower bound on the store's
    /// own retry time, since it counts from before the request was sent.
    until: u64,
    reset_at: u64,
    remaining: u32,
    /// The check the store denied.
    denied: Asked,
    body: Arc<TooManyBody>,
}

/// What a check asks of its policy's count: a denial answers a check of
/// the same terms (one `PartialEq`, as a slice compares them, see
/// `Check::counts_as`), the same client limit and burst, at the same cost
/// or more.
#[derive(Debug, Clone)]
struct Asked {
    terms: Arc<Terms>,
    limit: u32,
    burst: u32,
    cost: u32,
}

impl Asked {
    fn of_check(check: &Check) -> Self {
        Self {
            terms: check.terms.clone(),
            limit: check.limit(),
            burst: check.burst,
            cost: check.cost,
        }
    }

    /// Whether the denial of `denied` answers the check `price` asks.
    fn answers(&self, price: &Price<'_>) -> bool {
        price.cost >= self.cost
            && (price.limit, price.burst) == (self.limit, self.burst)
            // `Arc`'s own comparison: the same pointer, or equal terms.
            && *price.terms == self.terms
    }
}

/// The still-denied checks of a request, with what to answer them. A
/// request of one or two policies is answered without an allocation: a
/// flood from a denied client is the cache's hot path.
#[derive(Debug, Default)]
pub(crate) struct Denied {
    pub(crate) checks: Checks,
    pub(crate) decisions: SmallVec<[Decision; 2]>,
    pub(crate) bodies: SmallVec<[Arc<TooManyBody>; 2]>,
}

/// A small bounded cache of denials, so that a client that keeps sending
/// while denied is answered `429` locally until its `Retry-After` passes,
/// instead of costing a store round trip per request: a flood from one
/// client costs one round trip per retry period.
///
/// It is exact: a denial is cached until `sent + retry_after` (less the
/// policy's delay, for a policy that holds requests: within it the store
/// holds them), measured from before the request was sent, and capacity
/// can only free later than the store said (other requests only add to
/// the count), so the cache never denies a request the store would admit.
/// An entry answers only requests of the same namespace, with the same
/// limit, burst, window, block, delay and algorithm and at least the same
/// cost: a reload that changes
/// a policy leaves its cached denials unanswered.
///
/// A block is answered from the cache for as long as it lasts, even under
/// a policy that counts failures only: a refund never lifts a block. A
/// denial something besides time may lift sooner is kept only for its
/// block, if any: a concurrency limit's (a lease can end at any moment,
/// so each such denial is a store call), that of a policy that counts
/// some responses only (a refund may free it early) and that of a policy
/// settled after the response (so may a settlement below its
/// reservation).
///
/// The cache is asked before the store, so it answers whatever becomes of
/// the store: with Redis down and a policy that fails closed, a client
/// already denied keeps getting `429`, with its `Retry-After`, from the
/// cache until its retry time, not `503`.
///
/// [`RateLimitLayer`](crate::RateLimitLayer) keeps one of 10,000 entries
/// by default when its store [`is_remote`](crate::store::Store::is_remote)
/// (Redis).
/// [`with_deny_cache(DenyCache::new(n))`](crate::RateLimitLayer::with_deny_cache)
/// gives it room for `n` denials, one per client and policy (and turns it
/// on for a store in process);
/// [`with_deny_cache(None)`](crate::RateLimitLayer::with_deny_cache) turns
/// it off.
///
/// ```
/// use slidegate::{Global, Policies, Policy, RateLimitLayer, layer::DenyCache, store::MemoryStore};
/// use std::time::Duration;
///
/// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
/// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
///     .with_deny_cache(DenyCache::new(50_000));
/// ```
#[derive(Clone)]
pub struct DenyCache {
    inner: Arc<Inner>,
}

struct Inner {
    /// Denials by their check's scope (namespace, policy, client), so that
    /// layers sharing a cache keep their denials apart.
    entries: Cache<Scope, Entry>,
    clock: Box<dyn Clock>,
}

impl fmt::Debug for DenyCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DenyCache")
            .field("entries", &self.inner.entries.len())
            .field("capacity", &self.inner.entries.capacity())
            .finish()
    }
}

impl DenyCache {
    /// A cache of at most `capacity` denials, on the system clock.
    pub fn new(capacity: usize) -> Self {
        Self::with_clock(capacity, SystemClock::new())
    }

    /// A cache of at most `capacity` denials, reading time from `clock` (a
    /// [`FakeClock`](crate::clock::FakeClock) in tests).
    pub fn with_clock(capacity: usize, clock: impl Clock) -> Self {
        Self {
            inner: Arc::new(Inner {
                entries: Cache::new(capacity.max(1)),
                clock: Box::new(clock),
            }),
        }
    }

    /// How many denials are cached (some may have expired).
    pub fn len(&self) -> usize {
        self.inner.entries.len()
    }

    /// Whether no denial is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn now(&self) -> u64 {
        self.inner.clock.now_micros()
    }

    /// The request's checks that are still denied, with their decisions,
    /// if any is: the request can be answered `429` now. Otherwise the
    /// time now on the cache's clock (µs). The client is `key` in the
    /// layer's `namespace`; a check is built only for a denied price, and
    /// only enforced prices are asked.
    pub(crate) fn lookup(
        &self,
        key: &Key,
        namespace: Option<&Arc<str>>,
        prices: &[Price<'_>],
    ) -> Result<Denied, u64> {
        let now = self.now();
        let mut found: Option<Denied> = None;
        for price in prices.iter().filter(|price| price.enforced) {
            let counted = price.key(key).as_str();
            let scope = ScopeRef(namespace.map(|n| &**n), &price.terms.policy, counted);
            let Some(denial) = self.inner.entries.get(&scope) else {
                continue;
            };
            if denial.until <= now {
                self.inner.entries.remove(&scope);
                continue;
            }
            if !denial.denied.answers(price) {
                continue;
            }
            let denied = found.get_or_insert_with(Denied::default);
            denied.checks.push(price.check(key, namespace));
            denied.bodies.push(denial.body.clone());
            denied.decisions.push(Decision::new_denied(
                price.burst,
                denial.remaining,
                Duration::from_micros(denial.reset_at.saturating_sub(now)),
                Some(Duration::from_micros(denial.until - now)),
            ));
        }
        found.ok_or(now)
    }

    /// Forgets the denial of `check`'s client under its policy.
    pub(crate) fn forget(&self, check: &Check) {
        self.inner.entries.remove(&check.scope());
    }

    /// Remembers the policies that denied checks sent at `sent_at`: each
    /// until its retry time when `lasting` says nothing but time frees it,
    /// and otherwise (a refund or a lease's end may free it sooner) for as
    /// long as its block lasts, if it blocked.
    pub(crate) fn remember(
        &self,
        checks: &[Check],
        decisions: &[Decision],
        sent_at: u64,
        lasting: impl Fn(usize) -> bool,
    ) {
        for (index, (check, decision)) in checks.iter().zip(decisions).enumerate() {
            // Unless blocked, a request that fits within its policy's
            // delay is the store's to hold: the denial stands until then.
            let stands = match decision.blocked_for() {
                // The retry time counts the block in.
                Some(_) if lasting(index) => decision.retry_after(),
                Some(block) => Some(block),
                None if lasting(index) => decision.retry_after().and_then(|retry| {
                    retry
                        .checked_sub(check.delay())
                        .filter(|left| !left.is_zero())
                }),
                None => None,
            };
            let Some(stands) = stands else {
                continue;
            };
            let denial = Entry {
                until: sent_at.saturating_add(duration_micros(stands)),
                reset_at: sent_at.saturating_add(duration_micros(decision.reset())),
                remaining: decision.remaining(),
                denied: Asked::of_check(check),
                body: Arc::new(TooManyBody::new(check)),
            };
            self.inner.entries.insert(check.scope(), denial);
        }
    }
}

/// A [`Scope`] borrowed from a request's key and plan, to look an entry up
/// without cloning its parts. It hashes as a `Scope` does: field by field,
/// each string as a `str` (an `Arc<str>` and a [`Key`] hash as their text).
#[derive(Hash)]
struct ScopeRef<'a>(Option<&'a str>, &'a str, &'a str);

impl quick_cache::Equivalent<Scope> for ScopeRef<'_> {
    fn equivalent(&self, (namespace, policy, key): &Scope) -> bool {
        self.0 == namespace.as_deref() && self.1 == &**policy && self.2 == key.as_str()
    }
}

#[cfg(test)]
mod tests;
