//! What a layer is made of: its parts ([`Shared`]), which every clone of
//! its services shares, and its [`Settings`], small and `Copy`.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::request::Parts;

use crate::RateLimitLayer;
use crate::headers::{HeaderFormat, HeaderStyle, ResetFormat};
use crate::key::{Identity, KeyExtractor};
use crate::layer::changes::ChangeState;
use crate::layer::decide::delay::DelayedRequests;
use crate::layer::inspect::LimitError;
use crate::layer::remembered::credential_failures::CredentialFailures;
use crate::layer::remembered::deny_cache::DenyCache;
use crate::layer::remembered::local_fallback::LocalLimits;
use crate::layer::stores::LayerStore;
use crate::limits::ClientLimits;
use crate::lookup::Lookup;
use crate::policy::{FailMode, Policies, Policy, RequestCost};
use crate::rejection::OnRejection;
use crate::store::{Check, Store};

/// How long a limit lookup's answer is kept unless set.
pub(crate) const DEFAULT_LIMIT_TTL: Duration = Duration::from_secs(60);

/// Finds the tier of a client whose key extractor named none: a
/// [`Lookup`] of the request head and the client's identity. Set with
/// [`RateLimitLayer::with_tier_lookup`](crate::RateLimitLayer::with_tier_lookup).
pub(crate) type TierLookup =
    dyn for<'a> Lookup<(&'a Parts, &'a Identity), Answer = Option<Arc<str>>>;

/// The layer's settings a request reads; small and `Copy`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) fail_mode: FailMode,
    pub(crate) header_format: HeaderFormat,
    pub(crate) lookup_timeout: Duration,
    /// Whether admitted requests carry the client's `Identity` extension.
    pub(crate) insert_identity: bool,
    /// Whether every policy is in shadow mode.
    pub(crate) shadow: bool,
    /// The number of instances a local limit is shared by.
    pub(crate) local_share: u32,
    /// The most requests held at once instead of denied.
    pub(crate) max_delayed: usize,
    /// The most bytes of request heads held at once.
    pub(crate) max_delayed_bytes: usize,
    /// How often the store's changes are read, when they are.
    pub(crate) runtime_changes: Option<Duration>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            fail_mode: FailMode::default(),
            header_format: HeaderFormat::default(),
            lookup_timeout: Duration::from_millis(100),
            insert_identity: false,
            shadow: false,
            local_share: 1,
            max_delayed: crate::layer::decide::delay::DEFAULT_MAX_DELAYED,
            max_delayed_bytes: crate::layer::decide::delay::DEFAULT_MAX_DELAYED_BYTES,
            runtime_changes: None,
        }
    }
}

/// Everything a [`RateLimit`](crate::RateLimit) service shares with its clones.
#[derive(Clone)]
pub(crate) struct Shared {
    /// The store, with slices served in front of it once a policy takes
    /// them.
    pub(crate) stores: Arc<LayerStore>,
    pub(crate) keys: Arc<dyn KeyExtractor>,
    /// The policies in force, replaceable while the layer serves.
    pub(crate) policies: Arc<ArcSwap<Policies>>,
    pub(crate) tier_lookup: Option<Arc<TierLookup>>,
    pub(crate) deny_cache: Option<DenyCache>,
    pub(crate) on_rejection: Option<OnRejection>,
    pub(crate) exempt: Option<Exempt>,
    pub(crate) credential_failures: Option<CredentialFailures>,
    pub(crate) request_cost: Option<Arc<dyn RequestCost>>,
    /// The counts of policies that fall back to a local limit.
    pub(crate) local: Arc<LocalLimits>,
    /// The clients' own limits, when the layer looks them up.
    pub(crate) client_limits: Option<Arc<ClientLimits>>,
    /// How long a limit lookup's answer is fresh, set before or after the
    /// lookup.
    pub(crate) limit_ttl: Duration,
    /// The requests held now instead of denied, in every clone.
    pub(crate) delayed: Arc<DelayedRequests>,
    /// The reservations each client holds unsettled, in every clone.
    pub(crate) unsettled: Arc<crate::layer::after::max_unsettled::Unsettled>,
    /// The namespace of every store key the layer writes, if set.
    pub(crate) namespace: Option<Arc<str>>,
    /// The deny list and the changes made at run time, in every clone.
    pub(crate) changes: Arc<ChangeState>,
    pub(crate) settings: Settings,
}

impl Shared {
    /// The store to call now.
    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        self.stores.get()
    }

    /// `check` in the layer's namespace.
    pub(crate) fn in_namespace(&self, check: &mut Check) {
        check.namespace.clone_from(&self.namespace);
    }

    /// The policy in force named `name`.
    pub(crate) fn policy_named(&self, name: &str) -> Result<Arc<Policy>, LimitError> {
        let policies = self.policies.load();
        policies
            .shared()
            .find(|policy| policy.name() == name)
            .cloned()
            .ok_or_else(|| LimitError::UnknownPolicy(name.to_owned()))
    }
}

/// Says which requests the limiter leaves alone; set with
/// [`RateLimitLayer::with_exemption`].
pub(crate) type Exempt = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

impl RateLimitLayer {
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
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_fail_mode(FailMode::Closed);
    /// ```
    #[must_use]
    pub fn with_fail_mode(mut self, fail_mode: FailMode) -> Self {
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
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_header_style(HeaderStyle::None);
    /// ```
    #[must_use]
    pub fn with_header_style(mut self, style: HeaderStyle) -> Self {
        self.settings_mut().header_format.style = style;
        self
    }

    /// How `X-RateLimit-Reset` is written (default seconds from now).
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, headers::ResetFormat, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_reset_format(ResetFormat::UnixSeconds);
    /// ```
    #[must_use]
    pub fn with_reset_format(mut self, format: ResetFormat) -> Self {
        self.settings_mut().header_format.reset = format;
        self
    }

    /// How long to wait for a lookup (default 100 ms): a client's tier
    /// ([`with_tier_lookup`](Self::with_tier_lookup)), an API key outside its table
    /// ([`Header::with_lookup`](crate::Header::with_lookup)) or a client's own limit
    /// ([`with_limit_lookup`](Self::with_limit_lookup)). Past it, the request goes on
    /// as each says (the base limits, an unknown key, the tier's limit),
    /// and a warning is traced.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 10, Duration::from_secs(1))).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
    ///     .with_lookup_timeout(Duration::from_millis(20));
    /// ```
    #[must_use]
    pub fn with_lookup_timeout(mut self, timeout: Duration) -> Self {
        self.settings_mut().lookup_timeout = timeout;
        self
    }

    /// Hands each admitted request's client to the inner service as an
    /// [`Identity`] request extension (its key and tier), for handlers that
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
    ///     .route_layer(RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies).with_identity_extension(true));
    /// ```
    #[must_use]
    pub fn with_identity_extension(mut self, insert: bool) -> Self {
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
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_shadow(true);
    /// ```
    #[must_use]
    pub fn with_shadow(mut self, shadow: bool) -> Self {
        self.settings_mut().shadow = shadow;
        self
    }

    /// The number of instances that share the store (default 1): while
    /// the store is unavailable, a policy that fails to a local limit
    /// ([`FailMode::Local`]) allows each instance its limit divided by
    /// this, rounded down, and at least one unit, so that together they
    /// stay within the limit. A request's cost is scaled alike (30 of a
    /// limit of 100 is 8 of a local 25). The [`layer`](crate::layer)
    /// module's *When the store is down* says how the local count and the
    /// store's learn from each other, so that a store that flaps never adds
    /// them up.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, policy::FailMode, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("all", 100, Duration::from_secs(60))).unwrap();
    /// // Four instances: 25 a minute each while Redis is down.
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
    ///     .with_fail_mode(FailMode::Local)
    ///     .with_local_share(4);
    /// ```
    #[must_use]
    pub fn with_local_share(mut self, instances: u32) -> Self {
        self.settings_mut().local_share = instances.max(1);
        self
    }

    /// The most requests this layer holds at once instead of denying them
    /// (policies with [`with_delay`](crate::Policy::with_delay)); default
    /// 10,000. Past it, a request the store would hold is answered `503`
    /// ([`Rejection::DelayFull`](crate::Rejection::DelayFull)), its units
    /// given back: the layer's places are taken by other requests, which
    /// must never push this client toward its block. With 0, no request
    /// is held: each is answered `429` as its policies would without a
    /// delay (its units given back, unless a policy of its blocks: see
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
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_max_delayed(1_000);
    /// ```
    #[must_use]
    pub fn with_max_delayed(mut self, max: usize) -> Self {
        self.settings_mut().max_delayed = max;
        self
    }

    /// The most bytes of request heads (URI and header fields) this layer
    /// holds at once in held requests; default 64 MiB. Past it, a request
    /// the store would hold is answered `503` and its units given back, as
    /// past [`with_max_delayed`](Self::with_max_delayed).
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(
    ///     Policy::new("all", 10, Duration::from_secs(1)).with_delay(Duration::from_millis(200)),
    /// )
    /// .unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_max_delayed_bytes(8 << 20);
    /// ```
    #[must_use]
    pub fn with_max_delayed_bytes(mut self, max: usize) -> Self {
        self.settings_mut().max_delayed_bytes = max;
        self
    }
}
