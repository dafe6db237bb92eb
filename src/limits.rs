//! Per-client limits: [`LimitLookup`] finds a client's own limit under a
//! policy (from a database, say), and [`Overrides`] is a static table of
//! them (the configuration file's `[overrides]`). A limit found overrides
//! the tier's; a token bucket without a burst of its own takes it as its
//! burst too.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use quick_cache::sync::Cache;
use smallvec::SmallVec;
use tokio::time::Instant;

use crate::key::Key;
use crate::policy::Policy;
use crate::throttle::{LIMIT_LOOKUP_INVALID, LIMIT_LOOKUP_TIMEOUTS};

/// The future a [`LimitLookup`] returns: the client's own limit, or `None`
/// for the tier's.
pub type LimitFuture = Pin<Box<dyn Future<Output = Option<u32>> + Send + 'static>>;

/// Finds a client's own limit under a policy.
///
/// The layer asks once per client and policy, waits at most its lookup
/// timeout (100 ms by default, see
/// [`RateLimitLayer::tier_lookup_timeout`](crate::RateLimitLayer::tier_lookup_timeout)),
/// and keeps the answer for a while
/// ([`RateLimitLayer::limit_lookup_ttl`](crate::RateLimitLayer::limit_lookup_ttl),
/// 60 s by default), so most requests do not wait at all. A lookup that
/// fails or times out should answer `None`: the tier's limit applies. A
/// limit of 0 is taken as `None`. Any `Fn(&Key, &Policy) -> Future<Output
/// = Option<u32>>` is a lookup:
///
/// ```
/// use slidegate::{Global, Policies, Policy, RateLimitLayer, key::Key, store::MemoryStore};
/// use std::time::Duration;
///
/// // Pretend the contracts live in a database.
/// let lookup = |key: &Key, policy: &Policy| {
///     let enterprise = key.as_str() == "jwt:acme" && policy.name() == "api";
///     async move { enterprise.then_some(10_000) }
/// };
/// let policies = Policies::single(Policy::new("api", 100, Duration::from_secs(60)))?;
/// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).limit_lookup(lookup);
/// # Ok::<(), slidegate::policy::PolicyError>(())
/// ```
pub trait LimitLookup: Send + Sync + 'static {
    /// Starts looking up the limit of the client `key` under `policy`.
    fn limit(&self, key: &Key, policy: &Policy) -> LimitFuture;
}

impl<F, Fut> LimitLookup for F
where
    F: Fn(&Key, &Policy) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<u32>> + Send + 'static,
{
    fn limit(&self, key: &Key, policy: &Policy) -> LimitFuture {
        Box::pin(self(key, policy))
    }
}

/// A static table of per-client limits: `(client, policy) → limit`.
///
/// ```
/// use slidegate::{Global, Policies, Policy, RateLimitLayer, key::Key, limits::Overrides, store::MemoryStore};
/// use std::time::Duration;
///
/// let overrides = Overrides::new().with(Key::parse("jwt:alice").unwrap(), "search", 50);
/// assert_eq!(overrides.get(&Key::parse("jwt:alice").unwrap(), "search"), Some(50));
/// let policies = Policies::single(Policy::new("search", 5, Duration::from_secs(60)))?;
/// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).limit_lookup(overrides);
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
    pub fn with(mut self, key: Key, policy: impl Into<Arc<str>>, limit: u32) -> Self {
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

impl LimitLookup for Overrides {
    fn limit(&self, key: &Key, policy: &Policy) -> LimitFuture {
        let limit = self.get(key, policy.name());
        Box::pin(std::future::ready(limit))
    }
}

/// The clients' own limits a layer found, one per policy of a request's
/// plan (`None`: the tier's).
pub(crate) type Found = SmallVec<[Option<u32>; 2]>;

/// A layer's [`LimitLookup`] with the answers it keeps.
pub(crate) struct ClientLimits {
    lookup: Arc<dyn LimitLookup>,
    /// Answers per (policy, client), until they expire.
    cache: Cache<(Arc<str>, Key), (Option<u32>, Instant)>,
    ttl: Duration,
}

/// Answers kept at most, per layer.
const CACHED_ANSWERS: usize = 100_000;

impl ClientLimits {
    pub(crate) fn new(lookup: Arc<dyn LimitLookup>, ttl: Duration) -> Self {
        Self {
            lookup,
            cache: Cache::new(CACHED_ANSWERS),
            ttl,
        }
    }

    /// The same lookup with answers kept for `ttl`, starting afresh.
    pub(crate) fn with_ttl(&self, ttl: Duration) -> Self {
        Self::new(self.lookup.clone(), ttl)
    }

    /// The limits of `key` under `policies`, if every one is known now.
    pub(crate) fn known(&self, key: &Key, policies: &[Arc<Policy>]) -> Option<Found> {
        let now = Instant::now();
        policies
            .iter()
            .map(|policy| {
                let pair = (policy.shared_name().clone(), key.clone());
                self.cache
                    .get(&pair)
                    .filter(|(_, until)| *until > now)
                    .map(|(limit, _)| limit)
            })
            .collect()
    }

    /// Looks up the limits of `key` under `policies`, each bounded by
    /// `timeout`, and keeps the answers.
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
                (pair, policy.clone(), self.lookup.limit(key, policy))
            })
            .collect();
        let limits = self.clone();
        async move {
            let mut found = Found::new();
            for (pair, policy, lookup) in lookups {
                let limit = match tokio::time::timeout(timeout, lookup).await {
                    Ok(Some(limit)) if limit > 0 => match policy.validate_own_limit(limit) {
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
                            found.push(None);
                            continue;
                        }
                    },
                    Ok(_) => None,
                    Err(_) => {
                        if let Some(held_back) = LIMIT_LOOKUP_TIMEOUTS.admit() {
                            tracing::warn!(
                                ?timeout,
                                held_back,
                                "limit lookup timed out; the tier's limits apply"
                            );
                        }
                        // Not kept: the next request asks again.
                        found.push(None);
                        continue;
                    }
                };
                limits
                    .cache
                    .insert(pair, (limit, Instant::now() + limits.ttl));
                found.push(limit);
            }
            found
        }
    }
}
