//! The middleware: [`RateLimitLayer`], the settings, cheap to clone, that
//! wrap a service into a [`RateLimit`], and what a layer remembers between
//! requests: a [`DenyCache`] of denied clients and the
//! [`CredentialFailures`] of client addresses.

// One request, in the order it meets them: `service` (the call), `decide`
// (what is known now, the store asked), `outcome` (its answer into a call
// or an answer), `future` and `body` (the inner service's response, and
// what the request owes the store when it ends: `owed`).

mod background;
mod batch;
mod body;
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
mod reject;
mod service;
mod settings;

pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use inspect::LimitError;
pub use policy_names::PolicyConflict;
pub use service::RateLimit;

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tower_layer::Layer;

use bytes::Bytes;
use http::Response;
use http::request::Parts;

use crate::key::KeyExtractor;
use crate::limits::{ClientLimits, LimitLookup};
use crate::policy::{FailMode, Policies, RequestCost};
use crate::response::headers::{HeaderStyle, ResetFormat};
use crate::response::rejection::Rejection;
use crate::store::Store;
use crate::tier::TierLookup;
pub use credential_failures::CredentialFailures;
pub use deny_cache::DenyCache;
pub(crate) use settings::Shared;
use settings::{DEFAULT_LIMIT_TTL, Settings};

/// Replaces a layer's policies while it serves; see
/// [`RateLimitLayer::policies_handle`].
#[derive(Clone)]
pub struct PoliciesHandle(Arc<ArcSwap<Policies>>);

impl std::fmt::Debug for PoliciesHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PoliciesHandle")
            .field(&**self.0.load())
            .finish()
    }
}

impl PoliciesHandle {
    /// The policies in force.
    pub fn current(&self) -> Arc<Policies> {
        self.0.load_full()
    }

    /// Puts `policies` in force for every request from now on.
    ///
    /// # Errors
    ///
    /// [`PolicyConflict`], leaving the policies in force as they are, if
    /// another layer on the same store and namespace has a policy of one
    /// of these names that counts otherwise: the two would share counts.
    pub fn replace(&self, policies: Policies) -> Result<(), PolicyConflict> {
        policy_names::may_replace(&self.0, &policies)?;
        self.0.store(Arc::new(policies));
        Ok(())
    }
}

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
    /// [`deny_cache`](Self::deny_cache).
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
                namespace: None,
                settings: Settings::default(),
            }),
        }
    }

    fn settings_mut(&mut self) -> &mut Settings {
        &mut Arc::make_mut(&mut self.shared).settings
    }

    /// The fail mode of policies that set none (default [`FailMode::Open`]).
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, policy::FailMode, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).fail_mode(FailMode::Closed);
    /// ```
    #[must_use]
    pub fn fail_mode(mut self, fail_mode: FailMode) -> Self {
        self.settings_mut().fail_mode = fail_mode;
        self
    }

    /// Which rate-limit headers to send (default [`HeaderStyle::XRateLimit`]).
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, headers::HeaderStyle, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).header_style(HeaderStyle::None);
    /// ```
    #[must_use]
    pub fn header_style(mut self, style: HeaderStyle) -> Self {
        self.settings_mut().header_format.style = style;
        self
    }

    /// Looks up the tier of clients whose key extractor named none (an API
    /// key's plan in a database, say); see [`TierLookup`].
    #[must_use]
    pub fn tier_lookup(mut self, lookup: impl TierLookup) -> Self {
        Arc::make_mut(&mut self.shared).tier_lookup = Some(Arc::new(lookup));
        self
    }

    /// How long to wait for the [`TierLookup`] (default 100 ms); past it,
    /// the request gets the base limits and a warning is traced.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
    ///     .tier_lookup_timeout(Duration::from_millis(20));
    /// ```
    #[must_use]
    pub fn tier_lookup_timeout(mut self, timeout: Duration) -> Self {
        self.settings_mut().lookup_timeout = timeout;
        self
    }

    /// Looks up each client's own limit under each policy (see
    /// [`LimitLookup`]), replacing its tier's; answers are kept for 60 s
    /// (see [`limit_lookup_ttl`](Self::limit_lookup_ttl)), and each lookup
    /// is bounded by the [lookup timeout](Self::tier_lookup_timeout).
    #[must_use]
    pub fn limit_lookup(mut self, lookup: impl LimitLookup) -> Self {
        let ttl = DEFAULT_LIMIT_TTL;
        Arc::make_mut(&mut self.shared).client_limits =
            Some(Arc::new(ClientLimits::new(Arc::new(lookup), ttl)));
        self
    }

    /// How long an answer of the [`LimitLookup`] is fresh (default 60 s):
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
    ///     .limit_lookup(Overrides::new())
    ///     .limit_lookup_ttl(Duration::from_secs(5));
    /// ```
    #[must_use]
    pub fn limit_lookup_ttl(mut self, ttl: Duration) -> Self {
        let shared = Arc::make_mut(&mut self.shared);
        if let Some(limits) = &shared.client_limits {
            shared.client_limits = Some(Arc::new(limits.with_ttl(ttl)));
        }
        self
    }

    /// The most requests this layer holds at once instead of denying them
    /// (policies with [`with_delay`](crate::Policy::with_delay)); default
    /// 10,000. Past it, a request the store would hold is answered `429`
    /// (its units given back, unless a policy of its blocks: see
    /// [`Policy::with_block`](crate::Policy::with_block)). A client holds
    /// at most what its own limit grants within the delay (the store
    /// records no request beyond it: a policy of 10 a second with a delay
    /// of 500 ms holds 5 requests of cost 1), so one client cannot fill
    /// the layer's places.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(
    ///     Policy::new("all", 10, Duration::from_secs(1)).with_delay(Duration::from_millis(200)),
    /// )
    /// .unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).max_delayed(1_000);
    /// ```
    #[must_use]
    pub fn max_delayed(mut self, max: usize) -> Self {
        self.settings_mut().max_delayed = max;
        self
    }

    /// The most bytes of request heads (URI and header fields) this layer
    /// holds at once in held requests; default 64 MiB. Past it, a request
    /// the store would hold is answered `429`, as past
    /// [`max_delayed`](Self::max_delayed).
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(
    ///     Policy::new("all", 10, Duration::from_secs(1)).with_delay(Duration::from_millis(200)),
    /// )
    /// .unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).max_delayed_bytes(8 << 20);
    /// ```
    #[must_use]
    pub fn max_delayed_bytes(mut self, max: usize) -> Self {
        self.settings_mut().max_delayed_bytes = max;
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

    /// Answers denied clients from `cache` until their retry time, without
    /// a store round trip (see [`DenyCache`]).
    #[must_use]
    pub fn deny_cache(mut self, cache: DenyCache) -> Self {
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

    /// Answers the limiter's rejections with `respond` where it returns a
    /// response, and with the limiter's own answers where it returns
    /// `None`: `application/problem+json`, or for a gRPC call
    /// (`content-type: application/grpc`) the gRPC status of
    /// [`Rejection::to_grpc`]. `respond` sees a typed [`Rejection`] (over a
    /// limit, invalid credentials, an unidentified client, a cost above the
    /// limit, the store unavailable) and the request's head (method, URI,
    /// headers), to answer each client in its own terms. Its answer keeps
    /// its status, headers and body, and gets the headers of the limiter's
    /// own answer that it does not set itself (`Retry-After`, the
    /// rate-limit headers, `WWW-Authenticate`): set one to send another
    /// value. With axum, [`on_rejection_into_response`] takes a hook that
    /// answers `impl IntoResponse`.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode, header::{ACCEPT, CONTENT_TYPE}};
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, Rejection, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).on_rejection(|rejection, request| {
    ///     let Rejection::Limited(limited) = rejection else {
    ///         return None; // the limiter's own answer
    ///     };
    ///     let accept = request.headers.get(ACCEPT)?.to_str().ok()?;
    ///     if !accept.contains("text/plain") {
    ///         return None;
    ///     }
    ///     let text = format!("slow down: try again in {} s\n", limited.retry_after().as_secs());
    ///     let response = Response::builder()
    ///         .status(StatusCode::TOO_MANY_REQUESTS)
    ///         .header(CONTENT_TYPE, "text/plain; charset=utf-8")
    ///         .body(Bytes::from(text))
    ///         .unwrap();
    ///     Some(response)
    /// });
    /// ```
    ///
    /// [`on_rejection_into_response`]: Self::on_rejection_into_response
    #[must_use]
    pub fn on_rejection(
        mut self,
        respond: impl Fn(&Rejection<'_>, &Parts) -> Option<Response<Bytes>> + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.shared).on_rejection = Some(Arc::new(respond));
        self
    }

    /// [`on_rejection`](Self::on_rejection) with a hook that answers as an
    /// axum handler does, with anything that implements
    /// [`IntoResponse`](axum::response::IntoResponse): `Html`, `Json`, a
    /// `(StatusCode, ...)` tuple, `Redirect`. The answer's body must be
    /// complete at once, as those are: a body that streams is not waited
    /// for, and the limiter answers itself (with a warning in the log).
    ///
    /// An HTML page for browsers, the limiter's JSON for everyone else:
    ///
    /// ```
    /// use axum::{http::{StatusCode, header::ACCEPT}, response::Html};
    /// use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, Rejection, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies)
    ///     .on_rejection_into_response(|rejection, request| {
    ///         let Rejection::Limited(limited) = rejection else {
    ///             return None;
    ///         };
    ///         let accept = request.headers.get(ACCEPT)?.to_str().ok()?;
    ///         accept.contains("text/html").then(|| {
    ///             let wait = limited.retry_after().as_secs();
    ///             let page = format!("<h1>Slow down</h1><p>Try again in {wait} seconds.</p>");
    ///             (StatusCode::TOO_MANY_REQUESTS, Html(page))
    ///         })
    ///     });
    /// ```
    #[cfg(feature = "axum")]
    #[must_use]
    pub fn on_rejection_into_response<R>(
        self,
        respond: impl Fn(&Rejection<'_>, &Parts) -> Option<R> + Send + Sync + 'static,
    ) -> Self
    where
        R: axum::response::IntoResponse,
    {
        self.on_rejection(move |rejection, request| {
            let response = respond(rejection, request)?.into_response();
            crate::response::axum_response::complete(response)
        })
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

    /// A handle that replaces this layer's policies while it serves (a
    /// configuration reloaded at runtime), shared by every service the
    /// layer wraps, clones included. Requests read the policies without a
    /// lock; a request already past its policy selection finishes under
    /// the policies it started with. Counts are kept by policy name: a
    /// policy that keeps its name keeps its clients' counts, under its new
    /// limit and window.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let minute = |limit| Policies::single(Policy::new("all", limit, Duration::from_secs(60))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, minute(10));
    /// let handle = layer.policies_handle();
    /// handle.replace(minute(20)).unwrap();
    /// assert_eq!(handle.current().iter().next().unwrap().limit(), 20);
    /// ```
    pub fn policies_handle(&self) -> PoliciesHandle {
        PoliciesHandle(self.shared.policies.clone())
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
    /// let public = RateLimitLayer::new(store.clone(), PeerIp::new(), minute(100)).namespace("public");
    /// let admin = RateLimitLayer::new(store, PeerIp::new(), minute(10)).namespace("admin");
    /// ```
    ///
    /// # Panics
    ///
    /// If `namespace` is not 1 to 64 ASCII letters, digits, `-` and `_`.
    #[must_use]
    pub fn namespace(mut self, namespace: &str) -> Self {
        assert!(
            crate::policy::is_valid_name(namespace),
            "slidegate: namespace `{namespace}` must be 1-64 ASCII letters, digits, `-` or `_`"
        );
        Arc::make_mut(&mut self.shared).namespace = Some(namespace.into());
        self
    }

    /// Counts refused credentials per client address and, past the limit,
    /// answers `429` to that address's credentialed requests without
    /// verifying them; see [`CredentialFailures`]. Off unless set here (the
    /// configuration file turns it on by default, with its trusted
    /// proxies).
    #[must_use]
    pub fn credential_failures(mut self, failures: CredentialFailures) -> Self {
        Arc::make_mut(&mut self.shared).credential_failures = Some(failures);
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
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).request_cost(
    ///     |parts: &http::request::Parts, _: &Policy| {
    ///         // No header: the policy's own cost. At least 1, at most 1,000.
    ///         let rows: u32 = parts.headers.get("x-rows")?.to_str().ok()?.parse().ok()?;
    ///         Some(rows.clamp(1, 1_000))
    ///     },
    /// );
    /// ```
    #[must_use]
    pub fn request_cost(mut self, cost: impl RequestCost) -> Self {
        Arc::make_mut(&mut self.shared).request_cost = Some(Arc::new(cost));
        self
    }

    /// Hands each admitted request's client to the inner service as an
    /// [`Identity`](crate::key::Identity) request extension (its key and tier), for handlers that
    /// log, bill or personalise by it. Off by default: the extension costs
    /// an allocation per request that no handler may read.
    ///
    /// ```
    /// use axum::{Extension, Router, routing::get};
    /// use slidegate::{PeerIp, Policies, Policy, RateLimitLayer, key::Identity, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let app: Router = Router::new()
    ///     .route("/whoami", get(|Extension(identity): Extension<Identity>| async move {
    ///         identity.tier.as_deref().unwrap_or("none").to_owned()
    ///     }))
    ///     .route_layer(RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies).insert_identity(true));
    /// ```
    #[must_use]
    pub fn insert_identity(mut self, insert: bool) -> Self {
        self.settings_mut().insert_identity = insert;
        self
    }

    /// Puts every policy in shadow mode (see [`Policy::with_shadow`](crate::Policy::with_shadow)):
    /// requests are counted and decided as usual and get their rate-limit
    /// headers, but none is denied; denials are traced at debug level
    /// instead. Refused credentials are still answered `401`, never `429`,
    /// and a store failure always fails open.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).shadow(true);
    /// ```
    #[must_use]
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.settings_mut().shadow = shadow;
        self
    }

    /// The number of instances that share the store (default 1): while
    /// the store is unavailable, a policy that fails to a local limit
    /// ([`FailMode::Local`]) allows each instance its limit divided by
    /// this, rounded down, and at least one unit, so that together they
    /// stay within the limit.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, policy::FailMode, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 100, Duration::from_secs(60))).unwrap();
    /// // Four instances: 25 a minute each while Redis is down.
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
    ///     .fail_mode(FailMode::Local)
    ///     .local_share(4);
    /// ```
    #[must_use]
    pub fn local_share(mut self, instances: u32) -> Self {
        self.settings_mut().local_share = instances.max(1);
        self
    }

    /// How `X-RateLimit-Reset` is written (default seconds from now).
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, headers::ResetFormat, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).reset_format(ResetFormat::UnixSeconds);
    /// ```
    #[must_use]
    pub fn reset_format(mut self, format: ResetFormat) -> Self {
        self.settings_mut().header_format.reset = format;
        self
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
    /// [`namespace`](RateLimitLayer::namespace), or the policies distinct
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
