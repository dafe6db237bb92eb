//! Who is asking: [`KeyExtractor`]s turn a request head into a [`Key`],
//! and into the client's tier when a token or a table names one.
//!
//! Built-ins: [`PeerIp`], [`Header`] (known API keys, or a header your own
//! gateway sets), `JwtClaim` (feature `jwt`), [`Global`], and any closure
//! `Fn(&http::request::Parts) -> Option<Key>`. Chain them with
//! [`KeyExtractor::or`]: the first that yields a key wins, and one that
//! refuses the client's credentials ([`KeyRejection`], answered `401`)
//! stops the chain.
//!
//! A verified bearer token, else a known API key, else the client's
//! address, with a tier of its own limits for `pro` clients:
//!
//! ```rust
//! use slidegate::{Header, JwtClaim, KeyExtractor, PeerIp, Policies, Policy, policy::TierLimits};
//! use std::time::Duration;
//!
//! /// `public_key_pem`: the identity provider's RSA public key, in PEM.
//! fn keys_and_policies(
//!     public_key_pem: &[u8],
//! ) -> Result<(impl KeyExtractor, Policies), Box<dyn std::error::Error>> {
//!     // A verified bearer token; else an API key; else the client IP.
//!     let jwt = JwtClaim::builder()
//!         .with_public_key_pem(public_key_pem)
//!         .with_algorithms(["RS256"])
//!         .with_issuers(["https://auth.example"])
//!         .with_tier_claim("plan")
//!         .build()?;
//!     let api_keys = Header::new(http::HeaderName::from_static("x-api-key"))
//!         .with_tiers([("key-of-acme", "pro")]);
//!     let keys = jwt.or(api_keys).or(PeerIp::new());
//!
//!     let policies = Policies::builder()
//!         .with_route(
//!             "GET /api/search",
//!             Policy::new("search", 5, Duration::from_secs(60))
//!                 .with_tier("pro", TierLimits::new().with_limit(50)),
//!         )
//!         .build()?;
//!     Ok((keys, policies))
//! }
//! # let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/rsa_public.pem");
//! # let pem = std::fs::read(path).unwrap();
//! # keys_and_policies(&pem).unwrap();
//! ```
//!
//! # Labels and hashing
//!
//! Every source writes its keys under a label of its own, which no other
//! source can produce: `ip:` ([`PeerIp`]), `jwt:` (`JwtClaim`), `key:`
//! (API keys), `header:<name>:` (a trusted [`Header`]), `global`
//! ([`Global`]), and `user:` for keys made with [`Key::new`] or
//! [`Key::hashed`] by closures and your own extractors. A client that
//! controls a header or a claim can never name another client's bucket.
//!
//! Key material from the client never reaches the store raw when it could
//! hurt: secrets are hashed, and so is anything long, binary or holding a
//! `{`, `}` or `#`, so no client can pick a Redis Cluster slot, bloat memory
//! with huge keys, or read another tenant's key names.
//!
//! # Bearer tokens
//!
//! `JwtClaim` (feature `jwt`) reads `Authorization: Bearer`, verifies the
//! signature with the key of the token's algorithm family, refuses every
//! algorithm outside the allow-list (`none` always), requires `exp`, checks
//! `exp` and `nbf` with a 5 s leeway, and `iss` and `aud` when configured.
//! The key is the `sub` claim (or the one named with `with_key_claim`,
//! config `key_claim`), as `jwt:<sub>`. No bearer token: the next extractor
//! decides. A bad one: `401` with `WWW-Authenticate: Bearer
//! error="invalid_token"` and a problem+json `reason` of `malformed`,
//! `algorithm_not_allowed`, `unknown_key` (a `kid` no key has, with keys
//! given per `kid`), `wrong_key_type`, `bad_signature`, `expired`,
//! `not_yet_valid`, `wrong_issuer`, `wrong_audience`, `missing_claim` or
//! `invalid_claim`; the chain stops there. `JwtClaim` tells how keys
//! rotate.
//!
//! # Client addresses
//!
//! [`PeerIp`] keys a client by its address: the peer's, or, when the peer
//! is one of the trusted proxies ([`PeerIp::with_trusted_proxies`]), the
//! right-most address in `X-Forwarded-For` that is not a trusted proxy
//! ([`PeerIp::with_forwarded_header`]`(`[`ForwardedHeader::Forwarded`]`)`
//! reads RFC 7239 `Forwarded: for=...` instead; config
//! `forwarded_header = "forwarded"`).
//!
//! IPv6 clients are counted by their /64 ([`PeerIp::with_ipv6_prefix`],
//! config `ipv6_prefix`; 128 counts each address), since one subscriber
//! gets a whole /64 and could otherwise rotate through it; IPv4 clients by
//! their address ([`PeerIp::with_ipv4_prefix`] to group them).
//!
//! Behind a CDN or proxy that sets one header to the address it saw
//! (`CF-Connecting-IP`, `True-Client-IP`, `Fly-Client-IP`, `X-Real-IP`),
//! [`PeerIp::with_client_ip_header`]`(name)` (config `client_ip_header`)
//! reads that header from the trusted proxies instead; it must hold one
//! address on one line, or the request is keyed by the proxy. A request
//! that carries the header from a peer that is not trusted is keyed by the
//! peer, and the first such request of the process is logged as a warning:
//! the usual sign of a proxy missing from the trusted proxies.
//!
//! # API keys
//!
//! An API key is a client only when it is known: in the table given to
//! [`Header::with_keys`] or [`Header::with_tiers`] (the config's `[api_keys]`), as
//! `key:#<hash>`. An unknown key is no identity, so the next extractor
//! decides (the address, say); [`Header::with_unknown_rejected`] (config
//! `unknown_api_key = "reject"`) answers it `401` instead. A header your
//! own gateway sets after authenticating the client, and strips from what
//! clients send, can be taken as it is with [`Header::trusted`] (keys
//! `header:<name>:#<hash>`): any client that can write such a header picks
//! its own bucket, so it is an explicit opt-in.
//!
//! API keys that live in a database: [`Header::with_lookup`] takes an
//! async lookup (any `Fn(&[u8]) -> impl Future<Output = ApiKeyStatus>`, or
//! a type of yours implementing [`Lookup`]) asked about keys outside the
//! table, which answers [`ApiKeyStatus::Known`]`(tier)` or
//! [`ApiKeyStatus::Unknown`]. The layer waits for it at most
//! [`with_lookup_timeout`]; a lookup that times out counts the key as
//! unknown. It runs once per request with such a key: cache in it, unknown
//! keys included.
//!
//! API keys are hashed on the way in, tier table included: no raw key is
//! logged or written to Redis.
//!
//! # Tiers
//!
//! A client's tier comes from its token's tier claim, its API key's entry
//! in [`Header::with_tiers`] or its lookup's answer, and each policy gives a
//! tier its own limit, window and cost with
//! [`Policy::with_tier`](crate::Policy::with_tier). A tier the policy does
//! not name, or no tier, gets the policy's base values. For tiers that
//! live in a database, [`RateLimitLayer::with_tier_lookup`] takes an async
//! lookup (bounded by [`with_lookup_timeout`], 100 ms by default; on
//! timeout the base limits apply).
//!
//! # Refused credentials
//!
//! Refused credentials (a bad signature, an expired or malformed token, an
//! unknown API key with `reject`) are counted per client address, as
//! [`PeerIp`] resolves it, in the layer's store, under the name
//! `credential_failures`. Past the limit (10 a minute by default in the
//! config; [`RateLimitLayer::with_credential_failures`] in code), every
//! request from that address that carries credentials to a limited route
//! (one a policy applies to) is answered `429` with `Retry-After` until the
//! oldest refusal leaves the window, without verifying it. With a shared
//! store, another instance may verify one more credential from such an
//! address before it learns the address is blocked.
//!
//! # Exemptions, live policies and the client in handlers
//!
//! Exempt requests go to the handler untouched: never limited, no
//! rate-limit headers, nothing counted in the store. In code,
//! [`RateLimitLayer::with_exemption`]`(|parts| ...)` (with [`PeerIp::client`] for
//! the address as the extractor resolves it); in the config, `exempt`
//! (client networks) and `exempt_api_keys` (keys in `api_key_header`,
//! compared by hash).
//!
//! Policies can be replaced while the layer serves:
//! [`RateLimitLayer::policies_handle`] gives a [`PoliciesHandle`] whose
//! [`replace`](crate::PoliciesHandle::replace)`(policies)` is in force for
//! the next request (read without a lock). Counts are kept by policy name,
//! so a policy that keeps its name keeps its clients' counts under its new
//! limit and window.
//!
//! Handlers can read the client the limiter resolved (its key and tier) as
//! an `Extension<Identity>` ([`Identity`]) when the layer is built with
//! [`.with_identity_extension(true)`](crate::RateLimitLayer::with_identity_extension)
//! (the example server does, for `/api/whoami`); it is off by default,
//! since the extension costs an allocation per admitted request.
//!
//! [`Lookup`]: crate::lookup::Lookup
//! [`with_lookup_timeout`]: crate::RateLimitLayer::with_lookup_timeout
//! [`RateLimitLayer::with_tier_lookup`]: crate::RateLimitLayer::with_tier_lookup
//! [`RateLimitLayer::with_credential_failures`]: crate::RateLimitLayer::with_credential_failures
//! [`RateLimitLayer::with_exemption`]: crate::RateLimitLayer::with_exemption
//! [`RateLimitLayer::policies_handle`]: crate::RateLimitLayer::policies_handle
//! [`PoliciesHandle`]: crate::PoliciesHandle

mod api_key_lookup;
mod extractor;
mod header;
mod identity;
#[cfg(feature = "jwt")]
pub(crate) mod jwt;
mod peer_ip;

pub use api_key_lookup::ApiKeyStatus;
pub(crate) use api_key_lookup::{ApiKeyLookup, Otherwise, Unconfirmed, confirmed};
pub(crate) use extractor::Extracted;
pub use extractor::{Global, KeyExtractor, Or};
pub use header::Header;
pub(crate) use header::api_key_of;
pub use identity::{Identity, KeyRejection};
#[cfg(feature = "jwt")]
pub use jwt::{JwtClaim, JwtClaimBuilder, JwtError};
pub use peer_ip::{ForwardedHeader, PeerIp};

use std::borrow::Cow;
use std::fmt::{self, Write as _};

use sha2::{Digest, Sha256};
use smol_str::{SmolStr, SmolStrBuilder};

/// Longest key material kept as it is; longer material is hashed.
const MAX_RAW_LEN: usize = 64;

/// The label of keys made by [`Key::new`] and [`Key::hashed`].
const USER_LABEL: &str = "user";

/// A client's identity as the store sees it: a label naming the source,
/// then printable ASCII without braces, at most a hundred or so bytes.
///
/// ```
/// use slidegate::key::Key;
///
/// // Keys made in your code are labelled `user:`, so they can never be
/// // mistaken for an address (`ip:`), a token's subject (`jwt:`) or an API
/// // key (`key:`).
/// assert_eq!(Key::new("tenant-42").as_str(), "user:tenant-42");
/// assert_eq!(Key::new("ip:192.0.2.7").as_str(), "user:ip:192.0.2.7");
/// // Braces would let a client choose its Redis Cluster slot: hashed.
/// assert!(Key::new("{evil}").as_str().starts_with("user:#"));
/// // Secrets are always hashed.
/// assert!(!Key::hashed("sk_live_123").as_str().contains("sk_live_123"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key(SmolStr);

impl Key {
    /// A key of your own under the `user:` label: `material` is kept as it
    /// is when it is short printable ASCII without `{`, `}` or `#`, and
    /// hashed otherwise.
    pub fn new(material: impl AsRef<[u8]>) -> Self {
        Self::labelled(USER_LABEL, &sanitized(material.as_ref()))
    }

    /// A key of your own under the `user:` label, always hashed (SHA-256,
    /// first 128 bits, hex, after a `#`). Use this for secrets.
    pub fn hashed(material: impl AsRef<[u8]>) -> Self {
        Self::labelled(USER_LABEL, &hash_hex(material.as_ref()))
    }

    /// `label:text`, for a label of a built-in source and text that is
    /// already safe.
    pub(crate) fn labelled(label: &str, text: &str) -> Self {
        let mut key = SmolStrBuilder::new();
        key.push_str(label);
        key.push(':');
        key.push_str(text);
        Self(key.finish())
    }

    /// A key `label:value` for a value the crate formats itself (an IP
    /// address or network), which is always short, printable and free of
    /// braces; held inline (no allocation) when short, as IPv4 keys are.
    pub(crate) fn formatted(label: &str, value: impl fmt::Display) -> Self {
        use std::io::Write as _;
        let mut buffer = [0u8; MAX_RAW_LEN];
        let mut cursor = std::io::Cursor::new(&mut buffer[..]);
        if write!(cursor, "{label}:{value}").is_ok() {
            let len = cursor.position() as usize;
            if let Ok(text) = std::str::from_utf8(&buffer[..len]) {
                return Self(SmolStr::new(text));
            }
        }
        Self::labelled(label, &sanitized(value.to_string().as_bytes()))
    }

    /// A key of text the crate built itself from ASCII.
    pub(crate) fn from_ascii(text: &[u8]) -> Self {
        match std::str::from_utf8(text) {
            Ok(text) => Self(SmolStr::new(text)),
            Err(_) => Self(SmolStr::new(String::from_utf8_lossy(text))),
        }
    }

    /// The key's text, as written into store keys.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key whose text ([`as_str`](Self::as_str)) is `text`: a key in
    /// its label form, as `/api/whoami` in the example server shows it
    /// (`ip:203.0.113.9`, `jwt:alice`, `key:#3f2a…`, `global`), to inspect
    /// or reset that client's count. `None` for text no key can have:
    /// empty, longer than 256 bytes, or holding anything
    /// but printable ASCII without braces.
    ///
    /// ```
    /// use slidegate::key::Key;
    ///
    /// assert_eq!(Key::parse("ip:203.0.113.9").unwrap().as_str(), "ip:203.0.113.9");
    /// assert_eq!(Key::parse("user:tenant-42"), Some(Key::new("tenant-42")));
    /// assert_eq!(Key::parse("ip:{slot}"), None);
    /// assert_eq!(Key::parse("jwt:al ice"), None);
    /// ```
    pub fn parse(text: &str) -> Option<Self> {
        let valid = !text.is_empty()
            && text.len() <= MAX_PARSED_LEN
            && text
                .bytes()
                .all(|b| b.is_ascii_graphic() && !matches!(b, b'{' | b'}'));
        valid.then(|| Self(SmolStr::new(text)))
    }
}

/// The longest text [`Key::parse`] takes: longer than any key the crate
/// makes.
pub(crate) const MAX_PARSED_LEN: usize = 256;

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

/// `material` as it is when it is short printable ASCII without `{`, `}`
/// or `#`; its hash otherwise.
pub(crate) fn sanitized(material: &[u8]) -> Cow<'_, str> {
    match std::str::from_utf8(material) {
        Ok(text) if is_safe_raw(text) => Cow::Borrowed(text),
        _ => Cow::Owned(hash_hex(material)),
    }
}

fn is_safe_raw(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= MAX_RAW_LEN
        && text
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'{' | b'}' | b'#'))
}

/// The first 128 bits of the SHA-256 of `material`: what secret material
/// is known by.
pub(crate) fn digest(material: &[u8]) -> [u8; 16] {
    let digest = Sha256::digest(material);
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    first
}

/// `#` and the hex of [`digest`].
fn hash_hex(material: &[u8]) -> String {
    hex_of(&digest(material))
}

pub(crate) fn hex_of(digest: &[u8; 16]) -> String {
    let mut out = String::with_capacity(33);
    out.push('#');
    for byte in digest {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

#[cfg(test)]
mod tests;
