//! Per-client limits: a limit lookup gives a client its own limit under a
//! policy (from a database, say), replacing its tier's; a token bucket
//! without a burst of its own takes it as its burst too. Any `Fn(&Key,
//! &Policy) -> impl Future<Output = Option<u32>>` is a lookup, and so is
//! a [`Lookup`] of your own; [`Overrides`] is a static table, and the
//! configuration file's `[overrides]` fills one. Set it with
//! [`RateLimitLayer::with_limit_lookup`](crate::RateLimitLayer::with_limit_lookup).
//!
//! Each answer is fresh for
//! [`with_limit_lookup_ttl`](crate::RateLimitLayer::with_limit_lookup_ttl)
//! (60 s by default, at most 100,000 answers kept per layer); past it, the
//! answer is still served while a refresh runs in the background, so a
//! slow lookup never lifts a client's own limit, and no request waits for
//! it. Each lookup is bounded by the layer's
//! [lookup timeout](crate::RateLimitLayer::with_lookup_timeout): a first
//! lookup that times out gives the client the tier's limit (a warning is
//! traced) and is not asked again for a second. `None` or 0 keeps the
//! tier's limit.
//!
//! Every limit a client can be given passes the checks a policy's does
//! (a
//! token bucket's burst × window below 2^52 µs, a sliding counter's limit
//! × window below 2^51 ms), so both stores count it exactly. An override
//! that fails is refused as the file is read, naming its key; a lookup
//! answer that fails is a lookup error (traced; the tier's limit applies).
//! An own limit below a request's cost is answered `422`, as a cost above
//! the limit is.
//!
//! ```toml
//! [overrides]                          # "<key label>" = { <policy> = limit }
//! "jwt:alice" = { search = 50 }
//! ```
//!
//! ```
//! use slidegate::{Global, Policies, Policy, RateLimitLayer, key::Key, limits::Overrides, store::MemoryStore};
//! use std::time::Duration;
//!
//! let policies = Policies::single(Policy::new("search", 5, Duration::from_secs(60))).unwrap();
//! let overrides = Overrides::new().with_limit(Key::parse("jwt:alice").unwrap(), "search", 50);
//! let contracts = |key: &Key, policy: &Policy| {
//!     // Your database here.
//!     let enterprise = key.as_str() == "jwt:acme" && policy.name() == "search";
//!     async move { enterprise.then_some(10_000) }
//! };
//! let static_table = RateLimitLayer::new(MemoryStore::new(), Global, policies.clone())
//!     .with_limit_lookup(overrides);
//! let from_a_database = RateLimitLayer::new(MemoryStore::new(), Global, policies)
//!     .with_limit_lookup(contracts)
//!     .with_limit_lookup_ttl(Duration::from_secs(30));
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use quick_cache::sync::Cache;
use smallvec::SmallVec;
use tokio::time::Instant;

use crate::key::Key;
use crate::log_lines::LIMIT_LOOKUP_INVALID;
use crate::lookup::{LIMIT_REFRESH_TIMED_OUT, LIMIT_TIMED_OUT, Lookup, within};
use crate::policy::Policy;

/// Finds a client's own limit under a policy: a [`Lookup`] of the client's
/// key and the policy. Set with
/// [`RateLimitLayer::with_limit_lookup`](crate::RateLimitLayer::with_limit_lookup).
pub(crate) type LimitLookup = dyn for<'a> Lookup<(&'a Key, &'a Policy), Answer = Option<u32>>;

/// A static table of per-client limits: `(client, policy) → limit`.
///
/// ```
/// use slidegate::{Global, Policies, Policy, RateLimitLayer, key::Key, limits::Overrides, store::MemoryStore};
/// use std::time::Duration;
///
/// let overrides = Overrides::new().with_limit(Key::parse("jwt:alice").unwrap(), "search", 50);
/// assert_eq!(overrides.get(&Key::parse("jwt:alice").unwrap(), "search"), Some(50));
/// let policies = Policies::single(Policy::new("search", 5, Duration::from_secs(60)))?;
/// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_limit_lookup(overrides);
/// # Ok::<(), slidegate::policy::PolicyError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Per policy, per client.
    table: HashMap<Arc<str>, HashMap<Key, u32>>,
}

impl Overrides {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Gives the client `key` the limit `limit` under the policy named
    /// `policy`.
    #[must_use]
    pub fn with_limit(mut self, key: Key, policy: impl Into<Arc<str>>, limit: u32) -> Self {
        self.table
            .entry(policy.into())
            .or_default()
            .insert(key, limit);
        self
    }

    /// The limit of `key` under `policy`, if the table has one.
    pub fn get(&self, key: &Key, policy: &str) -> Option<u32> {
        self.table.get(policy)?.get(key).copied()
    }

    /// How many entries the table has.
    pub fn len(&self) -> usize {
        self.table.values().map(HashMap::len).sum()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

impl<'a> Lookup<(&'a Key, &'a Policy)> for Overrides {
    type Answer = Option<u32>;

    fn lookup(
        &self,
        (key, policy): (&'a Key, &'a Policy),
    ) -> Pin<Box<dyn Future<Output = Option<u32>> + Send + 'static>> {
        let limit = self.get(key, policy.name());
        Box::pin(std::future::ready(limit))
    }
}

/// The clients' own limits a layer found, one per policy of a request's
/// plan (`None`: the tier's).
pub(crate) type Found = SmallVec<[Option<u32>; 2]>;

/// A layer's limit lookup with the answers it keeps.
///
/// An answer is fresh for the layer's TTL. Past it, the answer is still
/// served while a refresh runs in the background, so a slow lookup never
/// lifts a client's own limit to the tier's meanwhile, and no request
/// waits for it. A client never looked up waits for its lookup, at most
/// the lookup timeout; one that timed out is given the tier's limits and
/// asked again only after [`FAILED_LOOKUP_KEPT`].
pub(crate) struct ClientLimits {
    lookup: Arc<LimitLookup>,
    /// Answers per (policy, client).
    cache: Cache<(Arc<str>, Key), Answer>,
    ttl: Duration,
}

/// A lookup's answer, and until when it is fresh.
#[derive(Debug, Clone, Copy)]
struct Answer {
    limit: Option<u32>,
    fresh_until: Instant,
}

/// A kept answer as the client's own limit under `policy` as it is now: a
/// reload may have changed the policy's window since the answer was kept,
/// so that the policy can no longer count it (the tier's limit applies).
fn still_countable(policy: &Policy, limit: Option<u32>) -> Option<u32> {
    limit.filter(|&limit| policy.validate_own_limit(limit).is_ok())
}

/// Answers kept at most, per layer.
const CACHED_ANSWERS: usize = 100_000;

/// How long a lookup that timed out, for a client with no earlier answer,
/// is remembered (the tier's limits apply meanwhile, without asking).
pub(crate) const FAILED_LOOKUP_KEPT: Duration = Duration::from_secs(1);

impl ClientLimits {
    pub(crate) fn new(lookup: Arc<LimitLookup>, ttl: Duration) -> Self {
        Self {
            lookup,
            cache: Cache::new(CACHED_ANSWERS),
            ttl,
        }
    }

    /// How long an answer is fresh.
    #[cfg(test)]
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The same lookup with answers kept for `ttl`, starting afresh.
    pub(crate) fn with_ttl(&self, ttl: Duration) -> Self {
        Self::new(self.lookup.clone(), ttl)
    }

    /// The limits of `key` under `policies`, if an answer is kept for
    /// every one: an answer past its time is served as it is, and
    /// refreshed in the background (each lookup bounded by `timeout`).
    pub(crate) fn known(
        self: &Arc<Self>,
        key: &Key,
        policies: &[Arc<Policy>],
        timeout: Duration,
    ) -> Option<Found> {
        let now = Instant::now();
        let mut found = Found::new();
        for policy in policies {
            let pair = (policy.shared_name().clone(), key.clone());
            let answer = self.cache.get(&pair)?;
            if answer.fresh_until <= now && !self.refresh(pair, policy, key, answer, timeout) {
                return None;
            }
            found.push(still_countable(policy, answer.limit));
        }
        Some(found)
    }

    /// Starts refreshing a stale answer in the background; it is served
    /// meanwhile, and marked fresh for the lookup's timeout so that other
    /// requests do not start the same refresh. Says whether it started
    /// (not without a Tokio runtime to run it on).
    fn refresh(
        self: &Arc<Self>,
        pair: (Arc<str>, Key),
        policy: &Arc<Policy>,
        key: &Key,
        stale: Answer,
        timeout: Duration,
    ) -> bool {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let refreshing = Answer {
            fresh_until: Instant::now() + timeout,
            ..stale
        };
        self.cache.insert(pair.clone(), refreshing);
        let lookup = self.lookup.lookup((key, &**policy));
        let limits = self.clone();
        let policy = policy.clone();
        runtime.spawn(async move {
            // A refresh that times out keeps the stale answer.
            if let Some(answer) = within(lookup, timeout, &LIMIT_REFRESH_TIMED_OUT).await {
                let limit = limits.accepted(&policy, answer);
                limits.keep(pair, limit, limits.ttl);
            }
        });
        true
    }

    fn keep(&self, pair: (Arc<str>, Key), limit: Option<u32>, fresh_for: Duration) {
        let fresh_until = Instant::now() + fresh_for;
        self.cache.insert(pair, Answer { limit, fresh_until });
    }

    /// A lookup's `answer` as the client's own limit: `None` for the
    /// tier's, and for an answer the policy cannot count (traced).
    fn accepted(&self, policy: &Policy, answer: Option<u32>) -> Option<u32> {
        let limit = answer.filter(|&limit| limit > 0)?;
        match policy.validate_own_limit(limit) {
            Ok(()) => Some(limit),
            Err(invalid) => {
                if let Some(held_back) = LIMIT_LOOKUP_INVALID.admit() {
                    tracing::warn!(
                        %invalid,
                        held_back,
                        "limit lookup answered a limit the policy cannot count; \
                         the tier's limits apply"
                    );
                }
                None
            }
        }
    }

    /// Looks up the limits of `key` under `policies`, each bounded by
    /// `timeout`, and keeps the answers. A lookup that times out keeps the
    /// answer it had, if it is still kept; otherwise the tier's limits
    /// apply, remembered for [`FAILED_LOOKUP_KEPT`].
    pub(crate) fn look_up(
        self: &Arc<Self>,
        key: &Key,
        policies: &[Arc<Policy>],
        timeout: Duration,
    ) -> impl Future<Output = Found> + Send + 'static {
        let lookups: SmallVec<[_; 2]> = policies
            .iter()
            .map(|policy| {
                let pair = (policy.shared_name().clone(), key.clone());
                let lookup = self.lookup.lookup((key, &**policy));
                (pair, policy.clone(), lookup)
            })
            .collect();
        let limits = self.clone();
        async move {
            let mut found = Found::new();
            for (pair, policy, lookup) in lookups {
                match within(lookup, timeout, &LIMIT_TIMED_OUT).await {
                    Some(answer) => {
                        let limit = limits.accepted(&policy, answer);
                        limits.keep(pair, limit, limits.ttl);
                        found.push(limit);
                    }
                    None => {
                        let kept = limits.cache.get(&pair).map(|answer| answer.limit);
                        match kept {
                            Some(limit) => found.push(still_countable(&policy, limit)),
                            None => {
                                limits.keep(pair, None, FAILED_LOOKUP_KEPT.min(limits.ttl));
                                found.push(None);
                            }
                        }
                    }
                }
            }
            found
        }
    }
}
