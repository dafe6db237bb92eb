//! [`KeyExtractor`]: a request head read into an [`Identity`], chained
//! with [`KeyExtractor::or`]; and [`Global`], one key for every request.

use std::sync::Arc;

use http::request::Parts;
use smol_str::SmolStr;

use super::{Identity, Key, KeyRejection};

/// What a [`KeyExtractor`] found.
pub(crate) type Extracted = Result<Option<Identity>, KeyRejection>;

/// Reads a request head and says who the client is, or that it cannot tell.
///
/// ```
/// use slidegate::{Header, KeyExtractor, PeerIp, key::Key};
///
/// // A known API key when one is sent, else the client's IP address.
/// let keys = Header::new(http::HeaderName::from_static("x-api-key"))
///     .with_keys(["key-of-acme"])
///     .or(PeerIp::new());
/// // Any closure over the request head works too; its keys are `user:`.
/// let by_tenant = |parts: &http::request::Parts| {
///     parts.headers.get("x-tenant").map(|v| Key::new(v.as_bytes()))
/// };
/// let (parts, _) = http::Request::builder()
///     .header("x-tenant", "acme")
///     .body(())
///     .unwrap()
///     .into_parts();
/// assert_eq!(by_tenant.extract(&parts).unwrap().unwrap().key.as_str(), "user:acme");
/// assert!(keys.extract(&parts).unwrap().is_none());
/// ```
pub trait KeyExtractor: Send + Sync + 'static {
    /// The client's identity; `Ok(None)` when this extractor cannot tell
    /// (the next extractor in the chain decides); an error when the client
    /// presented credentials that are not valid.
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection>;

    /// Whether the request carries credentials this extractor would verify
    /// (a bearer token, an API key), before verifying them. The layer
    /// counts refused credentials per client address, and past a limit
    /// answers requests that carry credentials without verifying them.
    /// Default: `false`.
    fn presents_credentials(&self, parts: &Parts) -> bool {
        let _ = parts;
        false
    }

    /// Whether this extractor identifies clients only by credentials, so
    /// that a request it cannot key sent none: the layer then answers `401`
    /// rather than `500`. Default: `false`.
    fn needs_credentials(&self) -> bool {
        false
    }

    /// Tries `self`, then `next` when `self` yields nothing. A rejection
    /// stops the chain: invalid credentials never fall through to a
    /// weaker key.
    fn or<B>(self, next: B) -> Or<Self, B>
    where
        Self: Sized,
        B: KeyExtractor,
    {
        Or { first: self, next }
    }
}

impl<F> KeyExtractor for F
where
    F: Fn(&Parts) -> Option<Key> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        Ok(self(parts).map(Identity::from))
    }
}

impl KeyExtractor for Box<dyn KeyExtractor> {
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        (**self).extract(parts)
    }

    fn presents_credentials(&self, parts: &Parts) -> bool {
        (**self).presents_credentials(parts)
    }

    fn needs_credentials(&self) -> bool {
        (**self).needs_credentials()
    }
}

impl KeyExtractor for Arc<dyn KeyExtractor> {
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        (**self).extract(parts)
    }

    fn presents_credentials(&self, parts: &Parts) -> bool {
        (**self).presents_credentials(parts)
    }

    fn needs_credentials(&self) -> bool {
        (**self).needs_credentials()
    }
}

/// Two extractors in order: see [`KeyExtractor::or`].
///
/// ```
/// use slidegate::{Header, KeyExtractor, PeerIp, key::Or};
///
/// let either: Or<Header, PeerIp> = Header::new(http::HeaderName::from_static("x-api-key"))
///     .with_keys(["key-of-acme"])
///     .or(PeerIp::new());
/// // A request without a known key is keyed by its address, not refused.
/// assert!(!either.needs_credentials());
/// ```
#[derive(Debug, Clone)]
pub struct Or<A, B> {
    first: A,
    next: B,
}

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for Or<A, B> {
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        match self.first.extract(parts)? {
            Some(mut identity) => {
                // An API key still to be confirmed: should it be unknown,
                // the rest of the chain decides.
                if let Some(unconfirmed) = identity.unconfirmed.as_mut() {
                    unconfirmed
                        .otherwise
                        .fall_back_to(|| self.next.extract(parts));
                }
                Ok(Some(identity))
            }
            None => self.next.extract(parts),
        }
    }

    fn presents_credentials(&self, parts: &Parts) -> bool {
        self.first.presents_credentials(parts) || self.next.presents_credentials(parts)
    }

    fn needs_credentials(&self) -> bool {
        self.first.needs_credentials() && self.next.needs_credentials()
    }
}

/// One key for every request: a limit on the whole service.
///
/// ```
/// use slidegate::{Global, KeyExtractor};
///
/// let (parts, _) = http::Request::new(()).into_parts();
/// assert_eq!(Global.extract(&parts).unwrap().unwrap().key.as_str(), "global");
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        Ok(Some(Key(SmolStr::new_static("global")).into()))
    }
}
