//! Whose count a policy keeps: the client's, by default, or another
//! key's that an extractor of its own reads from the request
//! ([`Policy::per`]), such as one count for everyone ([`Global`]) or one
//! per organisation (a JWT claim).
//!
//! [`Global`]: crate::Global

use std::fmt;
use std::sync::Arc;

use super::Policy;
use crate::key::KeyExtractor;

/// What a policy [counted per another key](Policy::per) does with a
/// request its extractor finds no key in (a token without the claim, no
/// such header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PerMissing {
    /// The policy does not apply to the request: it is neither counted
    /// nor denied by it (config `per_missing = "skip"`, the default).
    #[default]
    Skip,
    /// The request is refused `401`, as a request no extractor keys
    /// (config `per_missing = "refuse"`).
    Refuse,
}

/// The key a policy counts under, when not the client's: see
/// [`Policy::per`].
#[derive(Clone)]
pub(crate) struct Per {
    pub(crate) extractor: Arc<dyn KeyExtractor>,
    pub(crate) missing: PerMissing,
}

impl fmt::Debug for Per {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Per")
            .field("missing", &self.missing)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Per {
    /// The same extractor (the same `Arc`), missing keys met the same way.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.extractor, &other.extractor) && self.missing == other.missing
    }
}

impl Eq for Per {}

impl Policy {
    /// Counts the policy under the key `extractor` reads from each
    /// request, in place of the client's: [`Global`](crate::Global) for
    /// one count shared by every client, [`PeerIp`](crate::PeerIp) for the
    /// address whoever the client is, a JWT claim for its organisation, a
    /// header. The count is shared, so no client's tier or own limit
    /// applies to it: it counts at the policy's base limits, or at the
    /// limit set for its key at run time
    /// ([`Changes::set_limit`](crate::layer::Changes::set_limit)). The
    /// request is still decided all or nothing across its policies: one
    /// that a policy denies counts in none.
    ///
    /// A request the extractor finds no key in meets
    /// [`with_per_missing`](Self::with_per_missing) (skip the policy, by
    /// default: a client that can leave the key out, an API key or a
    /// header, is then not counted there, so refuse where it must be
    /// there; a header is the client's own choice unless your gateway
    /// sets it); one whose credentials it refuses (a bad token) is
    /// answered `401`, as the layer's own extractor's refusal is. An API
    /// key that only an async lookup knows
    /// ([`Header::with_lookup`](crate::Header::with_lookup)) is no key
    /// here: the extractor is asked as the request arrives, and a policy's
    /// key never waits.
    ///
    /// A login limited per client address, and at 1,000 a minute for all
    /// clients together:
    ///
    /// ```
    /// use slidegate::{Global, PeerIp, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let minute = Duration::from_secs(60);
    /// let policies = Policies::builder()
    ///     .with_route("POST /login", Policy::new("login", 5, minute))
    ///     .with_route("POST /login", Policy::new("login_all", 1_000, minute).per(Global))
    ///     .build()?;
    /// let layer = RateLimitLayer::new(MemoryStore::new(), PeerIp::new(), policies);
    /// # Ok::<(), slidegate::policy::PolicyError>(())
    /// ```
    ///
    /// On Redis the policies of one request are decided in one call; on a
    /// Redis Cluster, where their keys may live in different slots, see
    /// [`RedisStore`](crate::store::RedisStore) for how they stay all or
    /// nothing.
    #[must_use]
    pub fn per(mut self, extractor: impl KeyExtractor) -> Self {
        let missing = self
            .per
            .as_ref()
            .map_or_else(PerMissing::default, |per| per.missing);
        self.per = Some(Per {
            extractor: Arc::new(extractor),
            missing,
        });
        self
    }

    /// What a request that [`per`](Self::per)'s extractor finds no key in
    /// gets: [`PerMissing::Skip`] (the default) or
    /// [`PerMissing::Refuse`]. Without `per`, it changes nothing.
    ///
    /// ```
    /// use slidegate::{Policy, key::Key, policy::PerMissing};
    /// use std::time::Duration;
    ///
    /// let by_org = |parts: &http::request::Parts| {
    ///     parts.headers.get("x-org").map(|org| Key::new(org.as_bytes()))
    /// };
    /// let orgs = Policy::new("org", 10_000, Duration::from_secs(3600))
    ///     .per(by_org)
    ///     .with_per_missing(PerMissing::Refuse);
    /// assert_eq!(orgs.per_missing(), Some(PerMissing::Refuse));
    /// ```
    #[must_use]
    pub fn with_per_missing(mut self, missing: PerMissing) -> Self {
        if let Some(per) = self.per.as_mut() {
            per.missing = missing;
        }
        self
    }

    /// Whether the policy counts under a key of its own
    /// ([`per`](Self::per)).
    pub fn is_per(&self) -> bool {
        self.per.is_some()
    }

    /// What a request without a key of the policy's
    /// [`per`](Self::per) gets; `None` when the policy counts per client.
    pub fn per_missing(&self) -> Option<PerMissing> {
        self.per.as_ref().map(|per| per.missing)
    }

    pub(crate) fn per_extractor(&self) -> Option<&Per> {
        self.per.as_ref()
    }
}
