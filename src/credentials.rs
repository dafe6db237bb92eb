//! [`CredentialFailures`]: refused credentials counted per client address,
//! so that a client guessing keys or forging tokens is answered `429`
//! before any more of its credentials are verified.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http::request::Parts;

use crate::deny_cache::DenyCache;
use crate::key::{KeyExtractor, KeyRejection, PeerIp};
use crate::layer::Options;
use crate::layer::flow::cached_denial;
use crate::policy::Policy;
use crate::response::problem::{invalid_credentials, too_many_requests};
use crate::response::rejection::{self, OnRejection, Rejection};
use crate::store::{Check, CheckOutcome, Decision};

/// The name under which refused credentials are counted; no policy of a
/// layer may take it.
pub(crate) const POLICY_NAME: &str = "credential_failures";

/// Addresses a layer remembers as blocked, at most.
const BLOCKED_CAPACITY: usize = 10_000;

/// Counts refused credentials (a bad signature, an expired or malformed
/// token, an unknown API key refused with
/// [`Header::reject_unknown`](crate::Header::reject_unknown)) per client
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
/// use slidegate::{CredentialFailures, Header, MemoryStore, PeerIp, Policies, Policy, RateLimitLayer};
/// use std::time::Duration;
///
/// let proxies = PeerIp::new().trust_proxies(["10.0.0.0/8".parse().unwrap()]);
/// let api_keys = Header::new(http::HeaderName::from_static("x-api-key"))
///     .keys(["key-of-acme"])
///     .reject_unknown();
/// let policies = Policies::single(Policy::new("api", 100, Duration::from_secs(60))).unwrap();
/// let layer = RateLimitLayer::new(MemoryStore::new(), api_keys, policies).credential_failures(
///     CredentialFailures::new(10, Duration::from_secs(60)).peer_ip(proxies),
/// );
/// ```
#[derive(Clone)]
pub struct CredentialFailures {
    policy: Policy,
    peer_ip: PeerIp,
    blocked: DenyCache,
}

impl fmt::Debug for CredentialFailures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CredentialFailures")
            .field("limit", &self.policy.limit())
            .field("window", &self.policy.window())
            .field("peer_ip", &self.peer_ip)
            .finish_non_exhaustive()
    }
}

impl CredentialFailures {
    /// At most `limit` refused credentials per address within `window`
    /// (the configuration's default is 10 a minute). A limit of 0 is taken
    /// as 1, and a window under a millisecond as one millisecond.
    pub fn new(limit: u32, window: Duration) -> Self {
        let window = window.max(Duration::from_millis(1));
        Self {
            policy: Policy::new(POLICY_NAME, limit.max(1), window),
            peer_ip: PeerIp::new(),
            blocked: DenyCache::new(BLOCKED_CAPACITY),
        }
    }

    /// Resolves client addresses with `peer_ip` (default: the TCP peer,
    /// no proxy trusted).
    #[must_use]
    pub fn peer_ip(mut self, peer_ip: PeerIp) -> Self {
        self.peer_ip = peer_ip;
        self
    }

    /// Remembers blocked addresses in `blocked` (a
    /// [`DenyCache::with_clock`] in tests) rather than a cache of 10,000
    /// on the system clock.
    #[must_use]
    pub fn blocked(mut self, blocked: DenyCache) -> Self {
        self.blocked = blocked;
        self
    }

    /// The count of the request's address, if it presents credentials the
    /// chain `keys` would verify and its address is known.
    pub(crate) fn check_for(&self, parts: &Parts, keys: &dyn KeyExtractor) -> Option<Check> {
        if !keys.presents_credentials(parts) {
            return None;
        }
        let address = self.peer_ip.extract(parts).ok().flatten()?;
        Some(Check::new(&self.policy, address.key))
    }

    /// `429` if the address of `check` is blocked now.
    pub(crate) fn blocked_answer(
        &self,
        check: &Check,
        options: Options,
        on_rejection: Option<&OnRejection>,
    ) -> Option<Response<Bytes>> {
        if options.shadow {
            return None;
        }
        cached_denial(
            &self.blocked,
            std::slice::from_ref(check),
            options,
            on_rejection,
        )
    }

    /// A refusal of `rejection` to count against the address of `check`,
    /// sent now.
    pub(crate) fn refusal(
        &self,
        check: Check,
        rejection: KeyRejection,
        options: Options,
        on_rejection: Option<OnRejection>,
    ) -> Refusal {
        Refusal {
            blocked: self.blocked.clone(),
            check,
            rejection,
            sent_at: self.blocked.now(),
            options,
            on_rejection,
        }
    }
}

/// A refusal whose count the store is deciding.
pub(crate) struct Refusal {
    pub(crate) blocked: DenyCache,
    pub(crate) check: Check,
    pub(crate) rejection: KeyRejection,
    pub(crate) sent_at: u64,
    pub(crate) options: Options,
    pub(crate) on_rejection: Option<OnRejection>,
}

impl Refusal {
    /// The answer once the refusal is counted: `401` while the address is
    /// within its limit (remembering it as blocked when this refusal used
    /// the last of it), `429` past it. A store that cannot count does not
    /// change the answer: the credentials were refused all the same.
    pub(crate) fn answer(self, outcome: CheckOutcome) -> Response<Bytes> {
        let hook = self.on_rejection.as_ref();
        let refused = || {
            rejection::answer(
                hook,
                &Rejection::InvalidCredentials(&self.rejection),
                || invalid_credentials(&self.rejection),
            )
        };
        let Some(decision) = outcome
            .ok()
            .and_then(|decisions| decisions.first().copied())
        else {
            return refused();
        };
        let checks = std::slice::from_ref(&self.check);
        if self.options.shadow {
            // Counted and decided, but never answered `429`.
            if !decision.admitted {
                tracing::debug!("shadow mode: refused credentials past their limit");
            }
            return refused();
        }
        if decision.admitted {
            if decision.remaining == 0 {
                // No refusal fits until the oldest leaves the window.
                let blocked =
                    Decision::denied(decision.limit, 0, decision.reset, Some(decision.reset));
                self.blocked
                    .remember(checks, std::slice::from_ref(&blocked), self.sent_at);
            }
            return refused();
        }
        let decisions = [decision];
        self.blocked.remember(checks, &decisions, self.sent_at);
        too_many_requests(
            checks,
            &decisions,
            0,
            None,
            hook,
            self.options.header_style,
            self.options.reset_format,
        )
    }
}
