//! The middleware: [`RateLimitLayer`], the settings, cheap to clone, that
//! wrap a service into a [`RateLimit`], and what a layer remembers between
//! requests: a [`DenyCache`] of denied clients and the
//! [`CredentialFailures`] of client addresses.
//!
//! # On an axum router
//!
//! ```
//! use axum::{Router, routing::get};
//! use slidegate::{
//!     Header,
//!     KeyExtractor,
//!     PeerIp,
//!     Policies,
//!     Policy,
//!     RateLimitLayer,
//!     policy::FailMode,
//!     store::RedisStore,
//! };
//! use slidegate::deadpool_redis::{Config, Runtime};
//! use std::time::Duration;
//!
//! fn app() -> Result<Router, Box<dyn std::error::Error>> {
//!     let pool = Config::from_url("redis://127.0.0.1:6379/").create_pool(Some(Runtime::Tokio1))?;
//!     let store = RedisStore::builder(pool)
//!         .with_timeout(Duration::from_millis(50))
//!         .build()
//!         .unwrap();
//!
//!     let search = Policy::new("search", 5, Duration::from_secs(60)).with_fail_mode(FailMode::Closed);
//!     let policies = Policies::builder()
//!         .with_route("GET /api/search", search)
//!         .with_every_route(Policy::new("account", 10_000, Duration::from_secs(86_400)))
//!         .with_default(Policy::new("default", 100, Duration::from_secs(60)))
//!         .build()?;
//!
//!     // A known API key when one is sent, else the client IP (X-Forwarded-For only from 10/8).
//!     let keys = Header::new(http::HeaderName::from_static("x-api-key"))
//!         .with_keys(["key-of-acme", "key-of-globex"])
//!         .or(PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse()?]));
//!
//!     Ok(Router::new()
//!         .route("/api/search", get(|| async { "results" }))
//!         .route_layer(RateLimitLayer::new(store, keys, policies)))
//!     // Serve with app.into_make_service_with_connect_info::<std::net::SocketAddr>()
//! }
//! ```
//!
//! Put the layer on with `Router::route_layer`: it limits the routes the
//! router matched, picking their policies by axum's `MatchedPath`, and
//! leaves unknown paths `404`. `Router::layer` runs before routing: every
//! path, unknown ones included, is counted, under the default policy when
//! no route matches.
//!
//! Serve the router with `into_make_service_with_connect_info::<SocketAddr>()`,
//! which alone gives requests the `ConnectInfo<SocketAddr>` that
//! [`PeerIp`](crate::PeerIp) reads the client's address from. Without it a
//! request keyed by its address has none and is answered `500` (and an
//! error is logged, at most once a second).
//!
//! For one process, [`MemoryStore::new()`](crate::store::MemoryStore::new)
//! takes the place of the `RedisStore`: the same decisions, sharded in
//! memory, with idle keys evicted and a bound on the keys it tracks (see
//! [`MemoryStore`](crate::store::MemoryStore)).
//!
//! # On any Tower service
//!
//! The layer works on any Tower service whose response body's data can be
//! made from `Bytes` (axum's `Body`, `http_body_util::Full<Bytes>`, tonic's
//! body, ...): a response's body is a [`ResponseBody`] around the inner
//! service's, which carries the limiter's own answers too and holds a
//! concurrency limit's lease until the body ends.
//!
//! # When the store is down
//!
//! Each policy has a [`FailMode`](crate::policy::FailMode), its own or the
//! layer's ([`RateLimitLayer::with_fail_mode`]): open lets the request
//! through and traces a warning, closed answers `503`, saying the limiter
//! is the problem, and local enforces a local limit. A
//! [`CircuitBreaker`](crate::store::CircuitBreaker) around the store makes
//! that answer immediate rather than one store timeout later.
//!
//! With [`FailMode::Local`](crate::policy::FailMode::Local) (config
//! `fail = "local"`), while the store is unavailable the policy is enforced
//! in this process on a `MemoryStore`, at its limit divided by the number
//! of instances ([`RateLimitLayer::with_local_share`]; rounded down, at
//! least one unit), so that together the instances stay within the limit.
//! A request's cost is scaled alike (30 of a limit of 100 is 8 of a local
//! 25), so a cost that fits the limit always fits its share. A policy
//! settled after the response reserves and settles in the local count too,
//! at the instance's share of the cost reported (an admission the store
//! made stays there at its reservation). The next request the store
//! answers goes back to it.
//!
//! The two counts learn from each other, so a store that flaps never adds
//! them up. Every admission the store makes for a local-mode policy is
//! recorded in the local count too, so the local limit starts from what
//! the store admitted (for policies that count some responses only, the
//! units a response sends back to the store come back to the local count
//! too). And for one window after the store last failed, a request must
//! fit the local count before the store is asked, so what was admitted
//! locally while the store was down still counts, and the store spends
//! nothing on a request the local count refuses. One instance
//! (`local_share = 1`) admits at most the limit in any window whether the
//! store fails every other call, flaps every 100 ms or stays down (the
//! repository's `tests/it/failures_shadow_fallback.rs`; without this, each
//! side would admit its own limit). With several instances, each holds
//! its share while the store is down and for a window after. The price is
//! one in-process check per request for local-mode policies while the
//! store answers. A request a full Redis refuses is limited at the local
//! share too, whatever its policies' fail mode but closed (see
//! `RedisStore`).
//!
//! ```toml
//! [redis.breaker]
//! failures = 5
//! cooldown = "2s"
//!
//! [limiter]
//! fail = "local"
//! local_share = 4
//! ```
//!
//! ```rust
//! use slidegate::{
//!     PeerIp,
//!     Policies,
//!     Policy,
//!     RateLimitLayer,
//!     policy::FailMode,
//!     store::{BreakerSettings, CircuitBreaker, RedisStore},
//! };
//! use std::time::Duration;
//!
//! # fn demo(pool: slidegate::deadpool_redis::Pool) {
//! # let policies = Policies::single(Policy::new("all", 100, Duration::from_secs(60))).unwrap();
//! let store = CircuitBreaker::new(RedisStore::new(pool), BreakerSettings::new(5, Duration::from_secs(2)));
//! let layer = RateLimitLayer::new(store, PeerIp::new(), policies)
//!     .with_fail_mode(FailMode::Local)
//!     .with_local_share(4);
//! # }
//! ```

// The Tower core is here: the layer, `service` (the call), `future` and
// `body` (the inner service's response). Beside it, a folder for each of
// the rest: `decide` (one request's decision: what is known now, the store
// asked, its answer turned into a call or an answer), `remembered` (what
// the layer keeps between requests) and `after` (what a request owes the
// store once its response says how it went, and its body ends).

pub(crate) mod after;
mod body;
pub(crate) mod changes;
mod decide;
mod future;
mod inspect;
pub(crate) mod remembered;
mod service;
mod settings;
mod stores;

pub use after::connection::ConnectionLease;
pub use after::messages::{MessageLimit, MessageRefused};
pub use after::usage::Usage;
pub use body::ResponseBody;
pub use changes::{Changes, DenyList};
pub use future::ResponseFuture;
pub use inspect::LimitError;
pub use remembered::policy_names::PoliciesHandle;
pub use service::RateLimit;

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
pub use remembered::credential_failures::CredentialFailures;
pub use remembered::deny_cache::DenyCache;
pub(crate) use settings::Shared;
use settings::{DEFAULT_LIMIT_TTL, Settings};
use stores::LayerStore;

/// Applies sliding-window rate limiting to a service.
///
/// The [`layer`](crate::layer) module says how to put it on an axum router
/// or any Tower service, and what it answers while its store is down.
///
/// ```
/// use axum::{Router, routing::get};
/// use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, store::MemoryStore};
/// use std::time::Duration;
///
/// let policies = Policies::builder()
///     .with_route("GET /api/search", Policy::new("search", 5, Duration::from_secs(60)))
///     .with_default(Policy::new("default", 100, Duration::from_secs(60)))
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
            .then(|| DenyCache::new(remembered::deny_cache::DEFAULT_CAPACITY));
        let stores = Arc::new(LayerStore::new(Arc::new(store), &policies));
        Self {
            shared: Arc::new(Shared {
                deny_cache,
                stores,
                keys: Arc::new(key_extractor),
                policies: Arc::new(ArcSwap::from_pointee(policies)),
                tier_lookup: None,
                on_rejection: None,
                exempt: None,
                credential_failures: None,
                request_cost: None,
                local: Arc::default(),
                client_limits: None,
                limit_ttl: DEFAULT_LIMIT_TTL,
                delayed: Arc::default(),
                unsettled: Arc::default(),
                namespace: None,
                changes: Arc::default(),
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
    /// default), so most requests do not wait at all. A lookup that fails
    /// should answer `None`: the tier's limit applies. The
    /// [`limits`](crate::limits) module says how answers are refreshed,
    /// what a timeout gives, and which limits are refused. Any `Fn(&Key,
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
        let shared = Arc::make_mut(&mut self.shared);
        let limits = ClientLimits::new(Arc::new(lookup), shared.limit_ttl);
        shared.client_limits = Some(Arc::new(limits));
        self
    }

    /// How long an answer of the [limit lookup](Self::with_limit_lookup) is fresh (default 60 s):
    /// a client's new limit takes effect within it (and the time of one
    /// refresh). Past it, the answer is still served while a refresh runs
    /// in the background, so a slow lookup never lifts a client's own
    /// limit meanwhile. Set before or after the lookup, it holds for it.
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
        shared.limit_ttl = ttl;
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
    /// service untouched, touch no store, count nowhere and carry no
    /// rate-limit headers (an internal network, a health checker, a
    /// partner's key). Called for every request a policy applies to, before
    /// the client is identified, so keep it cheap. Like
    /// [`with_route`](crate::policy::PoliciesBuilder::with_route), it adds
    /// an entry rather than replacing one: set twice, a request is exempt
    /// when either says so, so a layer made from a configuration file
    /// ([`Config::layer`](crate::config::Config::layer), with the file's
    /// `exempt` lists) keeps them beside exemptions added in code.
    ///
    /// [`PeerIp::client`](crate::PeerIp::client) gives the client's address
    /// as the extractor resolves it. A request whose client a trusted proxy
    /// cannot name (no forwarding header, `Forwarded: for=unknown`) has
    /// none, so it is never exempt by address, even when the proxy's own
    /// address is in an exempt network.
    ///
    /// In the configuration file, `exempt` lists client networks (resolved
    /// as `PeerIp` resolves them) and `exempt_api_keys` keys sent in its
    /// `api_key_header` (compared by digest). An empty exempt key is
    /// refused when the file loads: it would exempt every request with an
    /// empty header.
    ///
    /// ```toml
    /// [limiter]
    /// exempt = ["10.1.0.0/16"]            # client addresses, resolved as PeerIp resolves them
    /// exempt_api_keys = ["internal-key"]  # compared by digest
    /// ```
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
    ///     .with_exemption(move |parts| addresses.client(parts).is_some_and(|ip| internal.contains(&ip)));
    /// ```
    #[must_use]
    pub fn with_exemption(
        mut self,
        exempt: impl Fn(&Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
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
    /// refused when they do not (see [`PolicyError::SharedName`](crate::policy::PolicyError::SharedName)). Services in other
    /// processes that share a Redis cannot be seen: give them namespaces
    /// (or store prefixes) of their own. A namespace is 1 to 64 ASCII
    /// letters, digits, `-` and `_` (config `limiter.namespace`).
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
    /// The layer has no `build()` to fail at: a namespace written in code
    /// is a literal, wrong in every run (as
    /// [`HeaderName::from_static`](http::HeaderName::from_static) panics),
    /// and one read from a configuration file is refused as the file
    /// loads, with a [`ConfigError`](crate::config::ConfigError) naming
    /// `limiter.namespace`.
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
    /// a store round trip (see [`DenyCache`]); for a store in process too,
    /// which keeps none unless told. `None` sends every request to the
    /// store, denied clients included.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, layer::DenyCache, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let cached = RateLimitLayer::new(MemoryStore::new(), Global, policies.clone())
    ///     .with_deny_cache(DenyCache::new(10_000));
    /// let uncached = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_deny_cache(None);
    /// ```
    #[must_use]
    pub fn with_deny_cache(mut self, cache: impl Into<Option<DenyCache>>) -> Self {
        Arc::make_mut(&mut self.shared).deny_cache = cache.into();
        self
    }

    /// Refuses the clients `list` names with `403 Forbidden` on the routes
    /// the layer limits, before any limit is counted (an exemption does
    /// not lift it); see [`DenyList`]. The config file's `[deny]` fills
    /// one. Clients denied while the layer serves are the
    /// [`changes`](Self::changes) handle's.
    #[must_use]
    pub fn with_deny_list(self, list: DenyList) -> Self {
        self.shared.changes.set_deny_list(list);
        self
    }

    /// Reads the clients denied and the limits set at run time (see
    /// [`Changes`]) from the store every `every` (a second in a layer
    /// built from a config file), on a task of its own, started by the
    /// first request due: another instance's change applies here within
    /// `every` and one store call of the requests that find a read due (an
    /// instance that was idle decides its first request on the copy it
    /// has, and reads meanwhile). Requests read the local copy, never
    /// the store. `None` (the default) reads nothing: only this
    /// instance's own changes apply. A read that fails keeps the last
    /// copy, and a warning is logged; before the first read, only the
    /// static [`DenyList`] applies ([`Changes::read`] at start-up reads
    /// them at once).
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
    ///     .with_runtime_changes(Duration::from_secs(1));
    /// ```
    #[must_use]
    pub fn with_runtime_changes(mut self, every: impl Into<Option<Duration>>) -> Self {
        let every = every
            .into()
            .map(|every| every.max(Duration::from_millis(10)));
        Arc::make_mut(&mut self.shared).settings.runtime_changes = every;
        self
    }

    /// The handle that denies clients and sets their limits while the
    /// layer serves, on every instance on its store: see [`Changes`].
    pub fn changes(&self) -> Changes {
        Changes::new(self.shared.clone())
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
        if let Some(state) = shared.stores.given().shared_state()
            && let Err(conflict) = remembered::policy_names::register(
                state,
                shared.namespace.as_ref(),
                &shared.policies,
            )
        {
            panic!("slidegate: {conflict}");
        }
        RateLimit::from_shared(inner, shared.clone())
    }
}

#[cfg(test)]
mod tests;
