//! [`CredentialFailures`]: refused credentials counted per client address,
//! so that a client guessing keys or forging tokens is answered `429`
//! before any more of its credentials are verified.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;

use crate::RateLimitLayer;
use crate::key::{KeyExtractor, PeerIp};
use crate::layer::decide::priced::{Asked, Priced};
use crate::layer::remembered::deny_cache::{Denied, DenyCache};
use crate::policy::plan::Plan;
use crate::policy::{CREDENTIAL_FAILURES, FailMode, Policy};
use crate::store::Check;

/// Addresses a layer remembers as blocked, at most.
const BLOCKED_CAPACITY: usize = 10_000;

/// Counts refused credentials (a bad signature, an expired or malformed
/// token, an unknown API key refused with
/// [`Header::with_unknown_rejected`](crate::Header::with_unknown_rejected)) per client
/// address, in the layer's store, as the policy `credential_failures`.
/// Once an address has had `limit` refusals within `window`, every request
/// from it that carries credentials is answered `429` with `Retry-After`
/// until the oldest refusal leaves the window, without verifying anything:
/// a flood of forged tokens costs no signature checks.
///
/// The address is the one [`PeerIp`] resolves, so give it the same trusted
/// proxies as the key chain: behind a proxy it does not trust, every client
/// shares the proxy's address and so its count. Each instance of a service
/// learns that an address is blocked from its own answers, so with a
/// shared store an instance may verify one more credential from a blocked
/// address before it answers `429` too.
///
/// ```
/// use slidegate::{
///     Header,
///     PeerIp,
///     Policies,
///     Policy,
///     RateLimitLayer,
///     layer::CredentialFailures,
///     store::MemoryStore,
/// };
/// use std::time::Duration;
///
/// let proxies = PeerIp::new().with_trusted_proxies(["10.0.0.0/8".parse().unwrap()]);
/// let api_keys = Header::new(http::HeaderName::from_static("x-api-key"))
///     .with_keys(["key-of-acme"])
///     .with_unknown_rejected(true);
/// let policies = Policies::single(Policy::new("api", 100, Duration::from_secs(60))).unwrap();
/// let layer = RateLimitLayer::new(MemoryStore::new(), api_keys, policies).with_credential_failures(
///     CredentialFailures::new(10, Duration::from_secs(60)).with_peer_ip(proxies),
/// );
/// ```
#[derive(Clone)]
pub struct CredentialFailures {
    /// The plan of the one policy `credential_failures`.
    plan: Arc<Plan>,
    peer_ip: PeerIp,
    blocked: DenyCache,
}

impl fmt::Debug for CredentialFailures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CredentialFailures")
            .field("limit", &self.policy().limit())
            .field("window", &self.policy().window())
            .field("peer_ip", &self.peer_ip)
            .finish_non_exhaustive()
    }
}

impl CredentialFailures {
    /// At most `limit` refused credentials per address within `window`
    /// (the configuration's default is 10 a minute). A limit of 0 is taken
    /// as 1, and a window outside a millisecond to
    /// 366 days as the nearer of the two.
    pub fn new(limit: u32, window: Duration) -> Self {
        let window = window.clamp(Duration::from_millis(1), crate::policy::MAX_WINDOW);
        Self {
            plan: Arc::new(Plan::new(vec![Arc::new(Policy::new(
                CREDENTIAL_FAILURES,
                limit.max(1),
                window,
            ))])),
            peer_ip: PeerIp::new(),
            blocked: DenyCache::new(BLOCKED_CAPACITY),
        }
    }

    /// Resolves client addresses with `peer_ip` (default: the TCP peer,
    /// no proxy trusted).
    #[must_use]
    pub fn with_peer_ip(mut self, peer_ip: PeerIp) -> Self {
        self.peer_ip = peer_ip;
        self
    }

    /// Remembers blocked addresses in `blocked` (a
    /// [`DenyCache::with_clock`] in tests) rather than a cache of 10,000
    /// on the system clock.
    #[must_use]
    pub fn with_blocked(mut self, blocked: DenyCache) -> Self {
        self.blocked = blocked;
        self
    }

    fn policy(&self) -> &Policy {
        &self.plan.policies[0]
    }

    /// One refusal, priced: a unit of the policy.
    fn refusal(&self) -> Priced<'_> {
        Priced::of(&self.plan, None, Asked::default(), false, FailMode::Open)
            .expect("one unit fits a limit of at least one")
    }

    /// The count of the request's address in the layer's `namespace`, if
    /// the request presents credentials the chain `keys` would verify and
    /// its address is known.
    pub(crate) fn check_for(
        &self,
        parts: &Parts,
        keys: &dyn KeyExtractor,
        namespace: Option<&Arc<str>>,
    ) -> Option<Check> {
        if !keys.presents_credentials(parts) {
            return None;
        }
        let address = self.peer_ip.extract(parts).ok().flatten()?;
        Some(self.refusal().prices[0].check(&address.key, namespace))
    }

    /// The cached denial of the address of `check` (its key and
    /// namespace), if it is blocked now.
    pub(crate) fn blocked_now(&self, check: &Check) -> Option<Denied> {
        let prices = self.refusal().prices;
        let namespace = check.namespace.as_ref();
        self.blocked.lookup(&check.key, namespace, &prices).ok()
    }

    /// The addresses known to be blocked.
    pub(crate) fn blocked_addresses(&self) -> &DenyCache {
        &self.blocked
    }
}

impl RateLimitLayer {
    /// Counts refused credentials per client address and, past the limit,
    /// answers `429` to that address's credentialed requests without
    /// verifying them; see [`CredentialFailures`]. Off unless set here (the
    /// configuration file turns it on by default, with its trusted
    /// proxies).
    #[must_use]
    pub fn with_credential_failures(mut self, failures: CredentialFailures) -> Self {
        Arc::make_mut(&mut self.shared).credential_failures = Some(failures);
        self
    }
}
