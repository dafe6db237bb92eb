//! The middleware: [`RateLimitLayer`], the settings, cheap to clone, that
//! wrap a service into a [`RateLimit`], and what a layer remembers between
//! requests: a [`DenyCache`] of denied clients and the
//! [`CredentialFailures`] of client addresses.

// One request, in the order it meets them: `service` (the call), `decide`
// (what is known now, the store asked), `outcome` (its answer into a call
// or an answer), `future` and `body` (the inner service's response, and
// what the request owes the store when it ends: `owed`).

mod answered;
mod background;
mod body;
mod checks;
mod connection;
pub(crate) mod credential_failures;
mod decide;
mod delay;
pub(crate) mod deny_cache;
mod future;
mod inspect;
mod local_fallback;
mod outcome;
mod owed;
mod policy_names;
mod recorded;
mod refused;
mod reject;
mod service;
mod settings;
mod settled;
mod settlement;
mod unsettled;
mod usage;

pub use body::ResponseBody;
pub use connection::ConnectionLease;
pub use future::ResponseFuture;
pub use inspect::LimitError;
pub use policy_names::{PoliciesHandle, PolicyConflict};
pub use service::RateLimit;
pub use usage::Usage;

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tower_layer::Layer;

use http::request::Parts;

use crate::key::KeyExtractor;
use crate::key::{Identity, Key};
use crate::limits::ClientLimits;
use crate::lookup::Lookup;
use crate::policy::Policy;
use crate::policy::{Policies, RequestCost};
use crate::store::Store;
pub use credential_failures::CredentialFailures;
pub use deny_cache::DenyCache;
pub(crate) use settings::Shared;
use settings::{DEFAULT_LIMIT_TTL, Settings};

/// Applies sliding-window rate limiting to a service.
///
/// ```
/// use axum::{Router, routing::get};
/// use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, store::MemoryStore};
/// use std::time::Duration;
///
/// let policies = Policies::builder()
///     .route("GET /api/search", Policy::new("search", 5, Duration::from_secs(60)))
///     .default_policy(Policy::new("default", 100, Duration::from_secs(60)))
///     .build()
///     .unwrap();
/// let app: Router = Router::new()
///     .route("/api/search", get(|| async { "results" }))
///     .route_layer(RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies));
/// ```
#[derive(Clone)]
pub struct RateLimitLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policies", &**self.shared.policies.load())
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Limits requests by the client `key_extractor` finds, under
    /// `policies`, with counts in `store`.
    ///
    /// When the store [`is_remote`](Store::is_remote) (Redis), the layer
    /// keeps a [`DenyCache`] of 10,000 entries; see
    /// [`with_deny_cache`](Self::with_deny_cache).
    pub fn new(store: impl Store, key_extractor: impl KeyExtractor, policies: Policies) -> Self {
        let deny_cache = store
            .is_remote()
            .then(|| DenyCache::new(deny_cache::DEFAULT_CAPACITY));
        Self {
            shared: Arc::new(Shared {
                deny_cache,
                store: Arc::new(store),
                keys: Arc::new(key_extractor),
                policies: Arc::new(ArcSwap::from_pointee(policies)),
                tier_lookup: None,
                on_rejection: None,
                exempt: None,
                credential_failures: None,
                request_cost: None,
                local: Arc::default(),
                client_limits: None,
                delayed: Arc::default(),
                unsettled: Arc::default(),
                namespace: None,
                settings: Settings::default(),
            }),
        }
    }

    /// Looks up the tier of clients whose key extractor named none (an API
    /// key's plan in a database, say), from the request head and the
    /// client's [`Identity`].
    ///
    /// The layer asks only for identities without a tier, and waits at
    /// most its [lookup timeout](Self::with_lookup_timeout); a lookup that fails
    /// or times out should answer `None`, so the base limits apply. It
    /// runs on every such request, so real deployments cache (the layer
    /// does not). Any `Fn(&Parts, &Identity) -> impl Future<Output =
    /// Option<Arc<str>>>` is a lookup (see [`Lookup`]):
    ///
    /// ```
    /// use std::sync::Arc;
    /// use http::request::Parts;
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, key::Identity, store::MemoryStore};
    ///
    /// // Pretend the plans live in a database keyed by the limiter's key.
    /// let lookup = |_parts: &Parts, identity: &Identity| {
    ///     let key = identity.key.clone();
    ///     async move { (key.as_str() == "global").then(|| Arc::<str>::from("pro")) }
    /// };
    /// let policies = Policies::single(Policy::new("api", 10, std::time::Duration::from_secs(1)))?;
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_tier_lookup(lookup);
    /// # Ok::<(), slidegate::policy::PolicyError>(())
    /// ```
    #[must_use]
    pub fn with_tier_lookup(
        mut self,
        lookup: impl for<'a> Lookup<(&'a Parts, &'a Identity), Answer = Option<Arc<str>>>,
    ) -> Self {
        Arc::make_mut(&mut self.shared).tier_lookup = Some(Arc::new(lookup));
        self
    }

    /// Looks up each client's own limit under each policy (from a
    /// database, say), replacing its tier's: a limit of `Some(n)`, or
    /// `None` for the tier's.
    ///
    /// The layer asks once per client and policy, waits at most its
    /// [lookup timeout](Self::with_lookup_timeout), and keeps the answer for a
    /// while ([`with_limit_lookup_ttl`](Self::with_limit_lookup_ttl), 60 s by
    /// default), so most requests do not wait at all. Past its time, an
    /// answer is still served while it is refreshed in the background: a
    /// slow lookup never lifts a client's own limit to the tier's. A lookup
    /// that fails should answer `None`: the tier's limit applies. One that
    /// times out for a client with no earlier answer gives it the tier's
    /// limit, and is asked again a second later. A limit of 0 is taken as
    /// `None`, and a limit the policy cannot count exactly (see
    /// [`Policy::validate_own_limit`](crate::Policy::validate_own_limit)) is
    /// an error, traced, and the tier's limit applies. Any `Fn(&Key,
    /// &Policy) -> impl Future<Output = Option<u32>>` is a lookup (see
    /// [`Lookup`]), and so is a table of [`Overrides`](crate::limits::Overrides):
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
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_limit_lookup(lookup);
    /// # Ok::<(), slidegate::policy::PolicyError>(())
    /// ```
    #[must_use]
    pub fn with_limit_lookup(
        mut self,
        lookup: impl for<'a> Lookup<(&'a Key, &'a Policy), Answer = Option<u32>>,
    ) -> Self {
        let ttl = DEFAULT_LIMIT_TTL;
        Arc::make_mut(&mut self.shared).client_limits =
            Some(Arc::new(ClientLimits::new(Arc::new(lookup), ttl)));
        self
    }

    /// How long an answer of the [limit lookup](Self::with_limit_lookup) is fresh (default 60 s):
    /// a client's new limit takes effect within it (and the time of one
    /// refresh). Past it, the answer is still served while a refresh runs
    /// in the background, so a slow lookup never lifts a client's own
    /// limit meanwhile.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, limits::Overrides, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
    ///     .with_limit_lookup(Overrides::new())
    ///     .with_limit_lookup_ttl(Duration::from_secs(5));
    /// ```
    #[must_use]
    pub fn with_limit_lookup_ttl(mut self, ttl: Duration) -> Self {
        let shared = Arc::make_mut(&mut self.shared);
        if let Some(limits) = &shared.client_limits {
            shared.client_limits = Some(Arc::new(limits.with_ttl(ttl)));
        }
        self
    }

    /// Computes each request's cost per policy from its head (see
    /// [`RequestCost`]) instead of the policies' fixed costs. A cost the
    /// client writes is the client's to choose: clamp it.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("rows", 10_000, Duration::from_secs(60))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_request_cost(
    ///     |parts: &http::request::Parts, _: &Policy| {
    ///         // No header: the policy's own cost. At least 1, at most 1,000.
    ///         let rows: u32 = parts.headers.get("x-rows")?.to_str().ok()?.parse().ok()?;
    ///         Some(rows.clamp(1, 1_000))
    ///     },
    /// );
    /// ```
    #[must_use]
    pub fn with_request_cost(mut self, cost: impl RequestCost) -> Self {
        Arc::make_mut(&mut self.shared).request_cost = Some(Arc::new(cost));
        self
    }

    /// Leaves the requests `exempt` says yes to alone: they go to the inner
    /// service untouched, count nowhere and carry no rate-limit headers
    /// (an internal network, a health checker, a partner's key). Called
    /// for every request a policy applies to, before the client is
    /// identified, so keep it cheap. Set twice, a request is exempt when
    /// either says so.
    ///
    /// ```
    /// use ipnet::IpNet;
    /// use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 100, Duration::from_secs(60))).unwrap();
    /// let internal: IpNet = "10.1.0.0/16".parse().unwrap();
    /// let addresses = PeerIp::new();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), addresses.clone(), policies)
    ///     .exempt(move |parts| addresses.client(parts).is_some_and(|ip| internal.contains(&ip)));
    /// ```
    #[must_use]
    pub fn exempt(mut self, exempt: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        let shared = Arc::make_mut(&mut self.shared);
        shared.exempt = Some(match shared.exempt.take() {
            Some(earlier) => Arc::new(move |parts: &Parts| earlier(parts) || exempt(parts)),
            None => Arc::new(exempt),
        });
        self
    }

    /// Keeps this layer's counts under `namespace` in the store: every key
    /// it writes holds the namespace (Redis:
    /// `<prefix>:<namespace>:<policy>:{<client>}`), so layers in different
    /// namespaces count apart even where their policies share a name.
    /// Layers on one store without namespaces (or in one) share the counts
    /// of a policy name: one budget when their policies count alike, and
    /// refused when they do not (see [`PolicyConflict`]). A namespace is
    /// 1 to 64 ASCII letters, digits, `-` and `_`.
    ///
    /// ```
    /// use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let minute = |limit| Policies::single(Policy::new("api", limit, Duration::from_secs(60))).unwrap();
    /// let public = RateLimitLayer::new(store.clone(), PeerIp::new(), minute(100)).with_namespace("public");
    /// let admin = RateLimitLayer::new(store, PeerIp::new(), minute(10)).with_namespace("admin");
    /// ```
    ///
    /// # Panics
    ///
    /// If `namespace` is not 1 to 64 ASCII letters, digits, `-` and `_`.
    #[must_use]
    pub fn with_namespace(mut self, namespace: &str) -> Self {
        assert!(
            crate::policy::is_valid_name(namespace),
            "slidegate: namespace `{namespace}` must be 1-64 ASCII letters, digits, `-` or `_`"
        );
        Arc::make_mut(&mut self.shared).namespace = Some(namespace.into());
        self
    }

    /// Answers denied clients from `cache` until their retry time, without
    /// a store round trip (see [`DenyCache`]).
    #[must_use]
    pub fn with_deny_cache(mut self, cache: DenyCache) -> Self {
        Arc::make_mut(&mut self.shared).deny_cache = Some(cache);
        self
    }

    /// Sends every request to the store, denied clients included.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).without_deny_cache();
    /// ```
    #[must_use]
    pub fn without_deny_cache(mut self) -> Self {
        Arc::make_mut(&mut self.shared).deny_cache = None;
        self
    }

    /// How many requests this layer (with its clones) is delaying now
    /// (see [`Policy::with_delay`](crate::Policy::with_delay)): admitted,
    /// and waiting for their slot.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// assert_eq!(RateLimitLayer::new(MemoryStore::new(), Global, policies).delayed(), 0);
    /// ```
    pub fn delayed(&self) -> usize {
        self.shared.delayed.count()
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    /// Wraps `inner`.
    ///
    /// # Panics
    ///
    /// If another layer of the process on the same store (and namespace)
    /// has a policy of one of this layer's names that counts otherwise:
    /// the two would share counts under two limits. Give one layer a
    /// [namespace](RateLimitLayer::with_namespace), or the policies distinct
    /// names.
    fn layer(&self, inner: S) -> Self::Service {
        let shared = &self.shared;
        if let Some(state) = shared.store.state()
            && let Err(conflict) =
                policy_names::register(&state, shared.namespace.as_ref(), &shared.policies)
        {
            panic!("slidegate: {conflict}");
        }
        RateLimit::from_shared(inner, shared.clone())
    }
}

#[cfg(test)]
mod tests;
