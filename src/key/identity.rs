//! [`Identity`]: who the limiter found a request to be; and
//! [`KeyRejection`]: credentials it refuses.

use std::fmt;
use std::sync::Arc;

use http::HeaderValue;

use super::{Key, Unconfirmed};

/// What the limiter resolved for a request: the key it counts against, and
/// the client's tier when the extractor knows one.
///
/// With [`with_identity_extension(true)`](crate::RateLimitLayer::with_identity_extension)
/// the layer puts it in an admitted request's extensions, for handlers to
/// read; by default it does not.
///
/// ```
/// use slidegate::key::{Identity, Key};
///
/// let identity = Identity::new(Key::new("tenant-7")).with_tier("pro");
/// assert_eq!(identity.tier.as_deref(), Some("pro"));
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct Identity {
    /// The key the request is counted against.
    pub key: Key,
    /// The client's tier, if known.
    pub tier: Option<Arc<str>>,
    /// An API key that an async lookup must still confirm.
    pub(crate) unconfirmed: Option<Box<Unconfirmed>>,
}

impl Identity {
    /// The identity of the client `key`, without a tier.
    pub fn new(key: Key) -> Self {
        Self {
            key,
            tier: None,
            unconfirmed: None,
        }
    }

    /// This identity, of `tier`.
    #[must_use]
    pub fn with_tier(mut self, tier: impl Into<Arc<str>>) -> Self {
        self.tier = Some(tier.into());
        self
    }
}

/// A copy of an identity whose API key is still to be confirmed can only
/// turn out unknown: copying never confirms a key.
impl Clone for Identity {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            tier: self.tier.clone(),
            unconfirmed: self
                .unconfirmed
                .as_ref()
                .map(|_| Box::new(Unconfirmed::lost())),
        }
    }
}

impl PartialEq for Identity {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
            && self.tier == other.tier
            && self.unconfirmed.is_some() == other.unconfirmed.is_some()
    }
}

impl Eq for Identity {}

impl From<Key> for Identity {
    fn from(key: Key) -> Self {
        Self::new(key)
    }
}

/// Credentials that were presented but are not valid: the request is
/// answered `401 Unauthorized` rather than keyed as someone else.
///
/// ```
/// use slidegate::key::KeyRejection;
///
/// let rejection = KeyRejection::new("expired", "the token expired");
/// assert_eq!(rejection.reason(), "expired");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRejection {
    reason: &'static str,
    detail: String,
    challenge: Option<HeaderValue>,
}

impl KeyRejection {
    /// A rejection of reason class `reason` (a short machine-readable word
    /// such as `expired`) with a human-readable `detail`.
    pub fn new(reason: &'static str, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
            challenge: None,
        }
    }

    /// Sends `challenge` as the 401's `WWW-Authenticate` field (e.g.
    /// `Bearer error="invalid_token"`).
    ///
    /// ```
    /// use http::HeaderValue;
    /// use slidegate::key::KeyRejection;
    ///
    /// let rejection = KeyRejection::new("expired", "the token expired")
    ///     .with_challenge(HeaderValue::from_static("Bearer error=\"invalid_token\""));
    /// assert!(rejection.www_authenticate().is_some());
    /// ```
    #[must_use]
    pub fn with_challenge(mut self, challenge: HeaderValue) -> Self {
        self.challenge = Some(challenge);
        self
    }

    /// The reason class.
    pub fn reason(&self) -> &'static str {
        self.reason
    }

    /// The human-readable detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The `WWW-Authenticate` challenge, if any.
    pub fn www_authenticate(&self) -> Option<&HeaderValue> {
        self.challenge.as_ref()
    }
}

impl fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

impl std::error::Error for KeyRejection {}
