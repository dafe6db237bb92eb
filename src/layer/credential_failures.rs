//! [`CredentialFailures`]: refused credentials counted per client address,
//! so that a client guessing keys or forging tokens is answered `429`
//! before any more of its credentials are verified.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http::request::Parts;

use crate::key::{KeyExtractor, KeyRejection, PeerIp};
use crate::layer::deny_cache::{Denied, DenyCache};
use crate::layer::reject::reject;
use crate::layer::settings::Shared;
use crate::policy::{CREDENTIAL_FAILURES, Policy};
use crate::rejection::Rejection;
use crate::response::limited::Limited;
use crate::store::{Check, CheckFuture, CheckOutcome, Decision};

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
    /// as 1, and a window outside a millisecond to
    /// [`MAX_WINDOW`](crate::policy::MAX_WINDOW) as the nearer of the two.
    pub fn new(limit: u32, window: Duration) -> Self {
        let window = window.clamp(Duration::from_millis(1), crate::policy::MAX_WINDOW);
        Self {
            policy: Policy::new(CREDENTIAL_FAILURES, limit.max(1), window),
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
        Some(Check::of_valid(&self.policy, address.key, None))
    }

    /// The cached denial of the address of `check`, if it is blocked now.
    pub(crate) fn blocked_now<'a>(&self, check: &'a Check) -> Option<Denied<'a>> {
        self.blocked.lookup(std::slice::from_ref(check))
    }

    /// A refusal to count against the address of `check`, sent now.
    fn refusal(&self, check: Check) -> Refusal {
        Refusal {
            blocked: self.blocked.clone(),
            sent_at: self.blocked.now(),
            check,
        }
    }
}

/// A refusal of credentials, counted against the client's address.
struct Refusal {
    blocked: DenyCache,
    check: Check,
    sent_at: u64,
}

impl Refusal {
    /// The store's decision on the refusal when it puts the address past
    /// its limit (a `429`), remembering the address as blocked while its
    /// refusals fill the window; `None` while the address is within it (a
    /// `401`). A store that cannot count does not change the answer: the
    /// credentials were refused all the same. Under `shadow`, counted and
    /// decided but never `429`.
    fn past_limit(&self, outcome: CheckOutcome, shadow: bool) -> Option<Decision> {
        let decision = outcome.ok()?.first().copied()?;
        let checks = std::slice::from_ref(&self.check);
        if shadow {
            if !decision.admitted {
                tracing::debug!("shadow mode: refused credentials past their limit");
            }
            return None;
        }
        if decision.admitted {
            if decision.remaining == 0 {
                // No refusal fits until the oldest leaves the window.
                let blocked =
                    Decision::denied(decision.limit, 0, decision.reset, Some(decision.reset));
                self.blocked
                    .remember(checks, std::slice::from_ref(&blocked), self.sent_at, |_| {
                        true
                    });
            }
            return None;
        }
        self.blocked.remember(
            checks,
            std::slice::from_ref(&decision),
            self.sent_at,
            |_| true,
        );
        Some(decision)
    }
}

/// The count of this address's refused credentials, when the layer
/// counts them and the request presents some.
pub(crate) fn refusal_of(shared: &Shared, parts: &Parts) -> Option<Check> {
    let failures = shared.credential_failures.as_ref()?;
    let mut check = failures.check_for(parts, &*shared.keys)?;
    shared.in_namespace(&mut check);
    Some(check)
}

/// The cached denial of the address `check` counts refusals of, while it
/// is blocked; never in shadow mode.
pub(crate) fn blocked<'a>(shared: &Shared, check: &'a Check) -> Option<Denied<'a>> {
    let failures = shared.credential_failures.as_ref()?;
    (!shared.settings.shadow)
        .then(|| failures.blocked_now(check))
        .flatten()
}

/// Answers refused credentials `401`, after counting the refusal against
/// the client's address (`check`) when the layer counts them: `429` once
/// the address is past its limit. `Err` holds the refusal while the store
/// counts it.
pub(crate) fn refused(
    shared: &Shared,
    parts: &Parts,
    check: Option<Check>,
    rejection: KeyRejection,
) -> Result<Response<Bytes>, Box<Counting>> {
    tracing::debug!(reason = rejection.reason(), "credentials refused");
    let Some((failures, check)) = shared.credential_failures.as_ref().zip(check) else {
        let refused = Rejection::InvalidCredentials(&rejection);
        return Ok(reject(shared, parts, refused));
    };
    let refusal = failures.refusal(check);
    match shared
        .store
        .check(std::slice::from_ref(&refusal.check))
        .into_ready()
    {
        Ok(outcome) => Ok(refusal.answer(shared, parts, &rejection, outcome)),
        Err(count) => Err(Box::new(Counting {
            refusal,
            rejection,
            count,
        })),
    }
}

/// A refusal of credentials the store is counting.
pub(crate) struct Counting {
    refusal: Refusal,
    rejection: KeyRejection,
    count: CheckFuture,
}

impl Counting {
    /// The answer, once the store has counted the refusal.
    pub(crate) async fn answer(self, shared: &Shared, parts: &Parts) -> Response<Bytes> {
        let outcome = self.count.await;
        self.refusal.answer(shared, parts, &self.rejection, outcome)
    }
}

impl Refusal {
    /// `429` when the store's `outcome` puts the address past its limit,
    /// `401` otherwise.
    fn answer(
        &self,
        shared: &Shared,
        parts: &Parts,
        rejection: &KeyRejection,
        outcome: CheckOutcome,
    ) -> Response<Bytes> {
        let Some(decision) = self.past_limit(outcome, shared.settings.shadow) else {
            return reject(shared, parts, Rejection::InvalidCredentials(rejection));
        };
        let decisions = [decision];
        let limited = Limited::new(std::slice::from_ref(&self.check), &decisions, 0, None);
        reject(shared, parts, Rejection::Limited(&limited))
    }
}
