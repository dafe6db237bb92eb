//! What a layer is made of: its parts ([`Shared`]), which every clone of
//! its services shares, and its [`Settings`], small and `Copy`.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::request::Parts;

use crate::key::KeyExtractor;
use crate::layer::credential_failures::CredentialFailures;
use crate::layer::delay::DelayedRequests;
use crate::layer::deny_cache::DenyCache;
use crate::layer::local_fallback::LocalLimits;
use crate::limits::ClientLimits;
use crate::policy::{FailMode, Policies, RequestCost};
use crate::response::headers::HeaderFormat;
use crate::response::rejection::OnRejection;
use crate::store::{Check, Store};
use crate::tier::TierLookup;

/// How long a [`LimitLookup`](crate::limits::LimitLookup)'s answer is kept unless set.
pub(crate) const DEFAULT_LIMIT_TTL: Duration = Duration::from_secs(60);

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
            max_delayed: crate::layer::delay::DEFAULT_MAX_DELAYED,
            max_delayed_bytes: crate::layer::delay::DEFAULT_MAX_DELAYED_BYTES,
        }
    }
}

/// Everything a [`RateLimit`] service shares with its clones.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) keys: Arc<dyn KeyExtractor>,
    /// The policies in force, replaceable while the layer serves.
    pub(crate) policies: Arc<ArcSwap<Policies>>,
    pub(crate) tier_lookup: Option<Arc<dyn TierLookup>>,
    pub(crate) deny_cache: Option<DenyCache>,
    pub(crate) on_rejection: Option<OnRejection>,
    pub(crate) exempt: Option<Exempt>,
    pub(crate) credential_failures: Option<CredentialFailures>,
    pub(crate) request_cost: Option<Arc<dyn RequestCost>>,
    /// The counts of policies that fall back to a local limit.
    pub(crate) local: Arc<LocalLimits>,
    /// The clients' own limits, when the layer looks them up.
    pub(crate) client_limits: Option<Arc<ClientLimits>>,
    /// The requests held now instead of denied, in every clone.
    pub(crate) delayed: Arc<DelayedRequests>,
    /// The namespace of every store key the layer writes, if set.
    pub(crate) namespace: Option<Arc<str>>,
    pub(crate) settings: Settings,
}

impl Shared {
    /// `check` in the layer's namespace.
    pub(crate) fn in_namespace(&self, check: &mut Check) {
        check.namespace.clone_from(&self.namespace);
    }
}

/// Says which requests the limiter leaves alone; set with
/// [`RateLimitLayer::exempt`].
pub(crate) type Exempt = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;
