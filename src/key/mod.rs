//! Who is asking: [`KeyExtractor`]s turn a request head into a [`Key`].
//!
//! Built-ins: [`PeerIp`], [`Header`] (with an API key → tier table),
//! `JwtClaim` (feature `jwt`), [`Global`], and any closure
//! `Fn(&http::request::Parts) -> Option<Key>`. Chain them with
//! [`KeyExtractor::or`]: the first that yields a key wins, and one that
//! refuses the client's credentials ([`KeyRejection`], answered `401`)
//! stops the chain.
//!
//! Key material from the client never reaches the store raw when it could
//! hurt: secrets are hashed, and so is anything long, binary or holding a
//! `{`, `}` or `#`, so no client can pick a Redis Cluster slot, bloat memory
//! with huge keys, or read another tenant's key names.

mod header;
#[cfg(feature = "jwt")]
mod jwt;
mod peer_ip;

pub use header::Header;
#[cfg(feature = "jwt")]
pub use jwt::{JwtClaim, JwtClaimBuilder, JwtError};
pub use peer_ip::{ForwardedHeader, PeerIp};

use std::fmt::{self, Write as _};
use std::sync::Arc;

use http::request::Parts;
use sha2::{Digest, Sha256};

/// Longest key material kept as it is; longer material is hashed.
const MAX_RAW_LEN: usize = 64;

/// A client's identity as the store sees it: printable ASCII without braces,
/// at most a hundred or so bytes.
///
/// ```
/// use slidegate::Key;
///
/// assert_eq!(Key::new("user-42").as_str(), "user-42");
/// // Braces would let a client choose its Redis Cluster slot: hashed.
/// assert!(Key::new("{evil}").as_str().starts_with('#'));
/// // Secrets are always hashed.
/// assert_ne!(Key::hashed("sk_live_123").as_str(), "sk_live_123");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key(Arc<str>);

impl Key {
    /// Keeps `material` as it is when it is short printable ASCII without
    /// `{`, `}` or `#`; hashes it otherwise.
    pub fn new(material: impl AsRef<[u8]>) -> Self {
        let bytes = material.as_ref();
        match std::str::from_utf8(bytes) {
            Ok(text) if is_safe_raw(text) => Self(text.into()),
            _ => Self::hashed(bytes),
        }
    }

    /// Always hashes `material` (SHA-256, first 128 bits, hex, after a `#`).
    /// Use this for secrets such as API keys.
    pub fn hashed(material: impl AsRef<[u8]>) -> Self {
        Self(hash_hex(material.as_ref()).into())
    }

    /// A key made of a trusted `kind` label and client material, as
    /// `kind:material` with the material sanitised like [`Key::new`].
    pub(crate) fn labelled(kind: &str, material: Key) -> Self {
        Self(format!("{kind}:{}", material.0).into())
    }

    /// A key `label:value` for a value the crate formats itself (an IP
    /// address or network), which is always short, printable and free of
    /// braces; built with one allocation.
    pub(crate) fn formatted(label: &str, value: impl fmt::Display) -> Self {
        use std::io::Write as _;
        let mut buffer = [0u8; MAX_RAW_LEN];
        let mut cursor = std::io::Cursor::new(&mut buffer[..]);
        if write!(cursor, "{label}:{value}").is_ok() {
            let len = cursor.position() as usize;
            if let Ok(text) = std::str::from_utf8(&buffer[..len]) {
                return Self(text.into());
            }
        }
        Self::labelled(label, Key::new(value.to_string()))
    }

    /// A key of text the crate built itself from ASCII.
    pub(crate) fn from_ascii(text: &[u8]) -> Self {
        Self(String::from_utf8_lossy(text).into())
    }

    /// The key's text, as written into store keys.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Key").field(&self.as_str()).finish()
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn is_safe_raw(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= MAX_RAW_LEN
        && text
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'{' | b'}' | b'#'))
}

fn hash_hex(material: &[u8]) -> String {
    let digest = Sha256::digest(material);
    let mut out = String::with_capacity(33);
    out.push('#');
    for byte in &digest[..16] {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

/// What the limiter resolved for a request: the key it counts against, and
/// the client's tier when the extractor knows one.
///
/// The layer stores it in the request extensions, so handlers can read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The key the request is counted against.
    pub key: Key,
    /// The client's tier, if known.
    pub tier: Option<Arc<str>>,
}

impl From<Key> for Identity {
    fn from(key: Key) -> Self {
        Self { key, tier: None }
    }
}

/// Credentials that were presented but are not valid: the request is
/// answered `401 Unauthorized` rather than keyed as someone else.
///
/// ```
/// use slidegate::KeyRejection;
///
/// let rejection = KeyRejection::new("expired", "the token expired");
/// assert_eq!(rejection.reason(), "expired");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRejection {
    reason: &'static str,
    detail: String,
}

impl KeyRejection {
    /// A rejection of reason class `reason` (a short machine-readable word
    /// such as `expired`) with a human-readable `detail`.
    pub fn new(reason: &'static str, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }

    /// The reason class.
    pub fn reason(&self) -> &'static str {
        self.reason
    }

    /// The human-readable detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

impl fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

impl std::error::Error for KeyRejection {}

/// What a [`KeyExtractor`] found: an identity, nothing (the next extractor
/// in the chain decides), or credentials it refuses.
pub type Extracted = Result<Option<Identity>, KeyRejection>;

/// Reads a request head and says who the client is, or that it cannot tell.
///
/// ```
/// use slidegate::{Header, Key, KeyExtractor, PeerIp};
///
/// // API key when present, else the client's IP address.
/// let keys = Header::new(http::HeaderName::from_static("x-api-key")).or(PeerIp::new());
/// // Any closure over the request head works too.
/// let by_tenant = |parts: &http::request::Parts| {
///     parts.headers.get("x-tenant").map(|v| Key::new(v.as_bytes()))
/// };
/// let (parts, _) = http::Request::builder()
///     .header("x-tenant", "acme")
///     .body(())
///     .unwrap()
///     .into_parts();
/// assert_eq!(by_tenant.extract(&parts).unwrap().unwrap().key.as_str(), "acme");
/// assert!(keys.extract(&parts).unwrap().is_none());
/// ```
pub trait KeyExtractor: Send + Sync + 'static {
    /// The client's identity; `Ok(None)` when this extractor cannot tell;
    /// an error when the client presented credentials that are not valid.
    fn extract(&self, parts: &Parts) -> Extracted;

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
    fn extract(&self, parts: &Parts) -> Extracted {
        Ok(self(parts).map(Identity::from))
    }
}

impl KeyExtractor for Box<dyn KeyExtractor> {
    fn extract(&self, parts: &Parts) -> Extracted {
        (**self).extract(parts)
    }
}

impl KeyExtractor for Arc<dyn KeyExtractor> {
    fn extract(&self, parts: &Parts) -> Extracted {
        (**self).extract(parts)
    }
}

/// Two extractors in order: see [`KeyExtractor::or`].
#[derive(Debug, Clone)]
pub struct Or<A, B> {
    first: A,
    next: B,
}

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for Or<A, B> {
    fn extract(&self, parts: &Parts) -> Extracted {
        match self.first.extract(parts)? {
            Some(identity) => Ok(Some(identity)),
            None => self.next.extract(parts),
        }
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
    fn extract(&self, _parts: &Parts) -> Extracted {
        Ok(Some(Key(Arc::from("global")).into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_material_is_hashed() {
        let long = "a".repeat(MAX_RAW_LEN + 1);
        for material in [
            &b"{slot}"[..],
            b"has space",
            b"#abc",
            b"\xff\xfe",
            b"",
            long.as_bytes(),
        ] {
            let key = Key::new(material);
            assert!(key.as_str().starts_with('#'), "{material:?} -> {key}");
            assert_eq!(key.as_str().len(), 33);
        }
        assert_eq!(
            Key::new("a".repeat(MAX_RAW_LEN)).as_str().len(),
            MAX_RAW_LEN
        );
    }

    #[test]
    fn hashing_is_stable_and_distinguishes_inputs() {
        assert_eq!(Key::hashed("a"), Key::hashed("a"));
        assert_ne!(Key::hashed("a"), Key::hashed("b"));
        // SHA-256("abc") starts ba7816bf8f01cfea414140de5dae2223.
        assert_eq!(
            Key::hashed("abc").as_str(),
            "#ba7816bf8f01cfea414140de5dae2223"
        );
    }

    #[test]
    fn or_falls_through_in_order() {
        let none = |_: &Parts| None::<Key>;
        let first = |_: &Parts| Some(Key::new("first"));
        let (parts, _) = http::Request::new(()).into_parts();
        assert_eq!(
            none.or(first)
                .extract(&parts)
                .unwrap()
                .unwrap()
                .key
                .as_str(),
            "first"
        );
        assert_eq!(
            first
                .or(Global)
                .extract(&parts)
                .unwrap()
                .unwrap()
                .key
                .as_str(),
            "first"
        );
        assert_eq!(none.or(none).extract(&parts), Ok(None));
    }

    #[test]
    fn a_rejection_stops_the_chain() {
        struct Refuses;
        impl KeyExtractor for Refuses {
            fn extract(&self, _: &Parts) -> Extracted {
                Err(KeyRejection::new("expired", "old"))
            }
        }
        let (parts, _) = http::Request::new(()).into_parts();
        let rejection = Refuses.or(Global).extract(&parts).unwrap_err();
        assert_eq!(rejection.reason(), "expired");
    }
}
