//! [`DenyCache`]: answering a denied client locally until its retry time,
//! without a store round trip.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use quick_cache::sync::Cache;
use smallvec::SmallVec;

use crate::clock::{Clock, SystemClock, duration_micros};
use crate::policy::Algorithm;
use crate::response::problem::TooManyBody;
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
    limit: u32,
    burst: u32,
    window: Duration,
    block_micros: u64,
    delay_micros: u64,
    cost: u32,
    algorithm: Algorithm,
    body: Arc<TooManyBody>,
}

/// The still-denied checks of a request, with what to answer them. A
/// request of one or two policies, all still denied, is answered without an
/// allocation: a flood from a denied client is the cache's hot path.
#[derive(Debug)]
pub(crate) struct Denied<'a> {
    pub(crate) checks: Cow<'a, [Check]>,
    pub(crate) decisions: SmallVec<[Decision; 2]>,
    pub(crate) bodies: SmallVec<[Arc<TooManyBody>; 2]>,
}

/// A small bounded cache of denials, so that a client that keeps sending
/// while denied is answered `429` locally until its `Retry-After` passes,
/// instead of costing a store round trip per request.
///
/// It is exact: a denial is cached until `sent + retry_after`, measured
/// from before the request was sent, and capacity can only free later than
/// the store said (other requests only add to the count), so the cache
/// never denies a request the store would admit. An entry answers only
/// requests of the same namespace, with the same limit, burst, window,
/// block and algorithm and at least the same cost: a reload that changes
/// a policy leaves its cached denials unanswered.
///
/// [`RateLimitLayer`](crate::RateLimitLayer) keeps one by default when its
/// store [`is_remote`](crate::store::Store::is_remote) (Redis).
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

    /// The checks of the request that are still denied, with their
    /// decisions, if any is: the request can be answered `429` now.
    pub(crate) fn lookup<'a>(&self, checks: &'a [Check]) -> Option<Denied<'a>> {
        let now = self.now();
        let mut denied_at: SmallVec<[usize; 2]> = SmallVec::new();
        let mut decisions = SmallVec::new();
        let mut bodies = SmallVec::new();
        for (index, check) in checks.iter().enumerate() {
            let key = check.scope();
            let Some(denial) = self.inner.entries.get(&key) else {
                continue;
            };
            if denial.until <= now {
                self.inner.entries.remove(&key);
                continue;
            }
            let same = denial.limit == check.limit
                && denial.burst == check.burst
                && denial.window == check.window
                && denial.block_micros == check.block_micros
                && denial.delay_micros == check.delay_micros
                && denial.algorithm == check.algorithm
                && check.cost >= denial.cost;
            if !same {
                continue;
            }
            denied_at.push(index);
            bodies.push(denial.body.clone());
            decisions.push(Decision::denied(
                check.burst,
                denial.remaining,
                Duration::from_micros(denial.reset_at.saturating_sub(now)),
                Some(Duration::from_micros(denial.until - now)),
            ));
        }
        if denied_at.is_empty() {
            return None;
        }
        let checks = if denied_at.len() == checks.len() {
            Cow::Borrowed(checks)
        } else {
            Cow::Owned(denied_at.iter().map(|&i| checks[i].clone()).collect())
        };
        Some(Denied {
            checks,
            decisions,
            bodies,
        })
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
            let stands = match decision.blocked_for {
                // The retry time counts the block in.
                Some(_) if lasting(index) => decision.retry_after,
                Some(block) => Some(block),
                None if lasting(index) => decision.retry_after.and_then(|retry| {
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
                reset_at: sent_at.saturating_add(duration_micros(decision.reset)),
                remaining: decision.remaining,
                limit: check.limit,
                burst: check.burst,
                window: check.window,
                block_micros: check.block_micros,
                delay_micros: check.delay_micros,
                cost: check.cost,
                algorithm: check.algorithm,
                body: Arc::new(TooManyBody::new(check)),
            };
            self.inner.entries.insert(check.scope(), denial);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use crate::key::Key;
    use crate::policy::Policy;

    const SEC: Duration = Duration::from_secs(1);

    fn denied(retry: Duration, remaining: u32) -> Decision {
        Decision::denied(10, remaining, retry, Some(retry))
    }

    #[test]
    fn a_denial_answers_until_its_retry_time_only() {
        let clock = FakeClock::new(1_000_000);
        let cache = DenyCache::with_clock(100, clock.clone());
        let policy = Policy::new("p", 10, 60 * SEC).with_cost(3);
        let check = Check::new(&policy, Key::new("k")).unwrap();
        cache.remember(
            std::slice::from_ref(&check),
            &[denied(5 * SEC, 2)],
            clock.now_micros(),
            |_| true,
        );

        clock.advance(SEC);
        let denied = cache.lookup(std::slice::from_ref(&check)).unwrap();
        assert_eq!(denied.checks, std::slice::from_ref(&check));
        assert_eq!(denied.decisions[0].retry_after, Some(4 * SEC));
        assert_eq!(denied.decisions[0].remaining, 2);

        clock.advance(4 * SEC - Duration::from_micros(1));
        assert!(cache.lookup(std::slice::from_ref(&check)).is_some());
        clock.advance(Duration::from_micros(1));
        assert!(cache.lookup(std::slice::from_ref(&check)).is_none());
        assert!(cache.is_empty(), "the expired denial was dropped");
    }

    #[test]
    fn only_the_same_limits_and_at_least_the_same_cost_match() {
        let clock = FakeClock::new(0);
        let cache = DenyCache::with_clock(100, clock.clone());
        let policy = Policy::new("p", 10, 60 * SEC).with_cost(3);
        let check = Check::new(&policy, Key::new("k")).unwrap();
        cache.remember(
            std::slice::from_ref(&check),
            &[denied(5 * SEC, 2)],
            0,
            |_| true,
        );
        let variants = [
            (
                Policy::new("p", 10, 60 * SEC).with_cost(2),
                false,
                "a cheaper request may fit",
            ),
            (
                Policy::new("p", 10, 60 * SEC).with_cost(4),
                true,
                "a dearer one cannot",
            ),
            (
                Policy::new("p", 50, 60 * SEC).with_cost(3),
                false,
                "another tier's limit",
            ),
            (
                Policy::new("p", 10, 30 * SEC).with_cost(3),
                false,
                "another window",
            ),
            (
                Policy::new("q", 10, 60 * SEC).with_cost(3),
                false,
                "another policy",
            ),
        ];
        for (policy, hit, why) in variants {
            let check = Check::new(&policy, Key::new("k")).unwrap();
            assert_eq!(cache.lookup(&[check]).is_some(), hit, "{why}");
        }
        let other_client = Check::new(&policy, Key::new("someone-else")).unwrap();
        assert!(cache.lookup(&[other_client]).is_none());
    }

    #[test]
    fn admitted_policies_of_a_denied_request_are_not_cached() {
        let cache = DenyCache::with_clock(100, FakeClock::new(0));
        let tight = Check::new(&Policy::new("tight", 1, 60 * SEC), Key::new("k")).unwrap();
        let loose = Check::new(&Policy::new("loose", 100, 60 * SEC), Key::new("k")).unwrap();
        let fits = Decision {
            retry_after: None,
            ..denied(SEC, 50)
        };
        cache.remember(
            &[tight.clone(), loose.clone()],
            &[denied(SEC, 0), fits],
            0,
            |_| true,
        );
        assert!(cache.lookup(std::slice::from_ref(&loose)).is_none());
        let checks = [loose, tight.clone()];
        let denied = cache.lookup(&checks).unwrap();
        assert_eq!(&*denied.checks, [tight]);
    }

    #[test]
    fn the_cache_stays_bounded() {
        let cache = DenyCache::with_clock(100, FakeClock::new(0));
        let policy = Policy::new("p", 10, 60 * SEC);
        for client in 0..10_000 {
            let check = Check::new(&policy, Key::new(format!("c{client}"))).unwrap();
            cache.remember(&[check], &[denied(SEC, 0)], 0, |_| true);
        }
        assert!(cache.len() <= 110, "{} entries", cache.len());
    }
}
