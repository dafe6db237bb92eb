//! Keys from a verified JSON Web Token: [`JwtClaim`].

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::HeaderValue;
use http::header::AUTHORIZATION;
use http::request::Parts;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};

use super::{Identity, Key, KeyRejection, sanitized};

mod builder;

pub use builder::JwtClaimBuilder;

/// Longest `Authorization` value looked at; longer ones are refused unread.
const MAX_TOKEN_LEN: usize = 8 * 1024;

/// Why a [`JwtClaim`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JwtError {
    /// A PEM file is not a public key of a supported type.
    #[error("not a PEM-encoded RSA, EC (P-256/P-384) or Ed25519 public key: {0}")]
    InvalidKey(String),
    /// The algorithm allow-list is empty.
    #[error("the algorithm allow-list is empty")]
    NoAlgorithms,
    /// An algorithm name is not one jsonwebtoken knows.
    #[error("unknown JWT algorithm `{0}`")]
    UnknownAlgorithm(String),
    /// An allowed algorithm has no key of its family to verify it with.
    #[error("algorithm {algorithm} is allowed but no {family} key was given")]
    NoKeyFor {
        /// The allowed algorithm's name.
        algorithm: String,
        /// The kind of key it needs.
        family: &'static str,
    },
    /// The key claim is empty.
    #[error("the key claim name is empty")]
    EmptyKeyClaim,
}

fn family_name(algorithm: Algorithm) -> &'static str {
    use jsonwebtoken::AlgorithmFamily::*;
    match algorithm.family() {
        Hmac => "HMAC secret",
        Rsa => "RSA public",
        Ec => "EC public",
        Ed => "Ed25519 public",
    }
}

/// Keys a request by a claim of its verified `Authorization: Bearer` JWT.
///
/// The token is verified with the key of its algorithm's family, against an
/// explicit algorithm allow-list (`none` is always refused); `exp` is
/// required, `exp` and `nbf` are checked with a small leeway (5 s by
/// default), and `iss` and `aud` when configured. The key is the `sub` claim
/// by default (a string or an integer), labelled `jwt:`; a tier claim, when
/// configured, gives the client's tier.
///
/// A request without a bearer token yields no key, so the next extractor in
/// the chain decides. A bearer token that does not verify is refused with a
/// [`KeyRejection`] (the layer answers `401` with `WWW-Authenticate: Bearer
/// error="invalid_token"`, and the chain stops there), whose reason is one
/// of `malformed`, `algorithm_not_allowed`, `unknown_key` (see [Rotating
/// keys](#rotating-keys)), `wrong_key_type`, `bad_signature`, `expired`,
/// `not_yet_valid`, `wrong_issuer`, `wrong_audience`, `missing_claim` and
/// `invalid_claim`.
///
/// ```
/// use slidegate::{JwtClaim, KeyExtractor};
///
/// let jwt = JwtClaim::builder()
///     .with_secret(b"change-me")
///     .with_algorithms(["HS256"])
///     .with_tier_claim("tier")
///     .build()?;
/// let (parts, _) = http::Request::new(()).into_parts();
/// // No token: the next extractor decides.
/// assert_eq!(jwt.extract(&parts), Ok(None));
///
/// let (parts, _) = http::Request::builder()
///     .header("authorization", "Bearer not.a.token")
///     .body(())?
///     .into_parts();
/// assert_eq!(jwt.extract(&parts).unwrap_err().reason(), "malformed");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Rotating keys
///
/// Several verification keys, each named by a `kid`
/// ([`with_secret_for_kid`](JwtClaimBuilder::with_secret_for_kid),
/// [`with_public_key_pem_for_kid`](JwtClaimBuilder::with_public_key_pem_for_kid)): a
/// token is verified by the key its header's `kid` names, so old and new
/// tokens are both accepted while keys rotate. A `kid` no key has falls back
/// to a key given without one, or else is `401` with reason `unknown_key`.
///
/// In the configuration file:
///
/// ```toml
/// [[jwt.keys]]
/// kid = "2026-10"
/// algorithm = "HS256"
/// secret = "the-old-secret"
///
/// [[jwt.keys]]
/// kid = "2026-11"
/// algorithm = "RS256"
/// public_key_pem = "keys/2026-11.pem"   # relative to the config file
/// ```
///
/// In code:
///
/// ```rust
/// use slidegate::JwtClaim;
///
/// let jwt = JwtClaim::builder()
///     .with_secret_for_kid("2026-10", "the-old-secret")
///     .with_secret_for_kid("2026-11", "the-new-secret")
///     .with_algorithms(["HS256"])
///     .build()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct JwtClaim {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    /// The verification keys, each with the `kid` it answers to, if any.
    keys: Vec<(Option<String>, DecodingKey)>,
    algorithms: Vec<Algorithm>,
    /// One validation per allowed algorithm, allowing that algorithm only.
    validations: Vec<Validation>,
    /// Registered claims a token must carry: `exp`, and `iss`/`aud` when
    /// those are checked.
    required: Vec<&'static str>,
    key_claim: String,
    tier_claim: Option<String>,
    /// Whether a verified token without the key claim is no key
    /// (`Ok(None)`) rather than refused: see [`JwtClaim::per_claim`].
    missing_claim_unkeyed: bool,
    /// The label of its keys: `jwt`, or `jwt.<claim>` for another claim
    /// than the client's (see [`JwtClaim::per_claim`]).
    label: String,
}

impl fmt::Debug for JwtClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JwtClaim")
            .field("algorithms", &self.inner.algorithms)
            .field("key_claim", &self.inner.key_claim)
            .field("tier_claim", &self.inner.tier_claim)
            .finish_non_exhaustive()
    }
}

impl JwtClaim {
    /// Starts a builder; give it at least one key and an allow-list.
    pub fn builder() -> JwtClaimBuilder {
        JwtClaimBuilder::default()
    }

    /// The same verification, keyed by the claim `claim` under a label of
    /// its own (`jwt.org:acme` for `org`, so that no claim's value names a
    /// subject's key) and naming no tier, for a policy counted per that claim
    /// ([`Policy::per`](crate::Policy::per)): an API's requests counted
    /// per organisation, say, across its users. A valid token without the
    /// claim is no key, so the policy's
    /// [`per_missing`](crate::Policy::with_per_missing) decides; an invalid
    /// token is refused as ever.
    ///
    /// ```
    /// use slidegate::{JwtClaim, PeerIp, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let jwt = JwtClaim::builder().with_secret("change-me").with_algorithms(["HS256"]).build()?;
    /// let hour = Duration::from_secs(3600);
    /// let policies = Policies::builder()
    ///     .with_every_route(Policy::new("per_user", 1_000, hour))
    ///     .with_every_route(Policy::new("per_org", 10_000, hour).per(jwt.per_claim("org")))
    ///     .build()?;
    /// let layer = RateLimitLayer::new(MemoryStore::new(), jwt, policies);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn per_claim(&self, claim: impl Into<String>) -> Self {
        let mut inner = (*self.inner).clone();
        inner.key_claim = claim.into();
        inner.tier_claim = None;
        inner.missing_claim_unkeyed = true;
        inner.label = format!("jwt.{}", sanitized(inner.key_claim.as_bytes()));
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Picks jsonwebtoken's crypto backend for the process, unless the
    /// application picked one first (its `CryptoProvider::install_default`
    /// wins): AWS-LC with the `jwt-aws-lc` feature, RustCrypto with
    /// `jwt-rust-crypto`; with neither, nothing. With both backends
    /// compiled in (an application that enables the other one itself),
    /// jsonwebtoken cannot choose and panics at its first signature, so
    /// building a `JwtClaim` calls this; call it yourself before signing
    /// tokens with jsonwebtoken ahead of that.
    ///
    /// ```
    /// slidegate::JwtClaim::install_crypto_provider();
    /// let key = jsonwebtoken::EncodingKey::from_secret(b"secret");
    /// let claims = serde_json::json!({ "sub": "alice", "exp": 4_000_000_000u64 });
    /// let token = jsonwebtoken::encode(&jsonwebtoken::Header::default(), &claims, &key).unwrap();
    /// assert_eq!(token.split('.').count(), 3);
    /// ```
    pub fn install_crypto_provider() {
        #[cfg(any(feature = "jwt-aws-lc", feature = "jwt-rust-crypto"))]
        {
            static INSTALLED: std::sync::Once = std::sync::Once::new();
            INSTALLED.call_once(|| {
                #[cfg(feature = "jwt-aws-lc")]
                let provider = &jsonwebtoken::crypto::aws_lc::DEFAULT_PROVIDER;
                #[cfg(not(feature = "jwt-aws-lc"))]
                let provider = &jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER;
                // An error means the application installed its own: it stays.
                let _ = provider.install_default();
            });
        }
    }

    /// The key that verifies a token of `algorithm` naming `kid`: the key
    /// of that `kid` when there is one. A token naming no `kid`, or a `kid`
    /// no key has, takes a key given without a `kid`, if there is one of
    /// its family; otherwise it is refused (`unknown_key`).
    fn key_for(
        &self,
        algorithm: Algorithm,
        kid: Option<&str>,
    ) -> Result<&DecodingKey, KeyRejection> {
        let of_family = |key: &&(Option<String>, DecodingKey)| key.1.family() == algorithm.family();
        let keys = || self.inner.keys.iter().filter(of_family);
        kid.and_then(|kid| keys().find(|(id, _)| id.as_deref() == Some(kid)))
            .or_else(|| keys().find(|(id, _)| id.is_none()))
            .map(|(_, key)| key)
            .ok_or_else(|| {
                KeyRejection::new(
                    "unknown_key",
                    "the token's key id (`kid`) names no key this server verifies with",
                )
            })
    }

    fn verify(&self, token: &str) -> Result<Map<String, Value>, KeyRejection> {
        let (algorithm, kid) = header_algorithm(token)?;
        let Some(position) = self.inner.algorithms.iter().position(|a| *a == algorithm) else {
            return Err(not_allowed());
        };
        let key = self.key_for(algorithm, kid.as_deref())?;
        let claims = jsonwebtoken::decode::<Map<String, Value>>(
            token,
            key,
            &self.inner.validations[position],
        )
        .map_err(|error| rejection(error.kind()))?
        .claims;
        // Presence and type are checked here rather than by jsonwebtoken,
        // which reports a claim of the wrong type as missing, and skips it
        // when it is not required.
        let missing = self
            .inner
            .required
            .iter()
            .find(|claim| matches!(claims.get(**claim), None | Some(Value::Null)));
        if let Some(claim) = missing {
            return Err(KeyRejection::new(
                "missing_claim",
                format!("the token has no `{claim}` claim"),
            ));
        }
        self.check_claim_types(&claims)?;
        Ok(claims)
    }

    /// Refuses registered claims of the wrong type among those checked:
    /// `exp` and `nbf` must be numbers, `iss` a string, `aud` a string or
    /// an array of strings.
    fn check_claim_types(&self, claims: &Map<String, Value>) -> Result<(), KeyRejection> {
        let wrong = |claim: &str, expected: &str| {
            Err(KeyRejection::new(
                "invalid_claim",
                format!("the token's `{claim}` claim must be {expected}"),
            ))
        };
        for time in ["exp", "nbf"] {
            if !matches!(claims.get(time), None | Some(Value::Number(_))) {
                return wrong(time, "a number");
            }
        }
        if self.inner.required.contains(&"iss")
            && !matches!(claims.get("iss"), Some(Value::String(_)))
        {
            return wrong("iss", "a string");
        }
        if self.inner.required.contains(&"aud") {
            let audience_ok = match claims.get("aud") {
                Some(Value::String(_)) => true,
                Some(Value::Array(items)) => items.iter().all(Value::is_string),
                _ => false,
            };
            if !audience_ok {
                return wrong("aud", "a string or an array of strings");
            }
        }
        Ok(())
    }

    fn identity(&self, claims: &Map<String, Value>) -> Result<Identity, KeyRejection> {
        let name = &self.inner.key_claim;
        let material = match claims.get(name) {
            None | Some(Value::Null) => {
                return Err(KeyRejection::new(
                    "missing_claim",
                    format!("the token has no `{name}` claim to identify the client"),
                ));
            }
            Some(Value::String(text)) if !text.is_empty() => text.clone(),
            Some(Value::Number(number)) if number.is_i64() || number.is_u64() => number.to_string(),
            Some(_) => {
                return Err(KeyRejection::new(
                    "invalid_claim",
                    format!("the token's `{name}` claim must be a non-empty string or an integer"),
                ));
            }
        };
        let tier = self.inner.tier_claim.as_ref().and_then(|tier_claim| {
            match claims.get(tier_claim) {
                Some(Value::String(tier)) if !tier.is_empty() => Some(Arc::from(tier.as_str())),
                None | Some(Value::Null) => None,
                Some(_) => {
                    tracing::debug!(claim = %tier_claim, "tier claim is not a string; base limits apply");
                    None
                }
            }
        });
        let mut identity = Identity::new(Key::labelled(
            &self.inner.label,
            &sanitized(material.as_bytes()),
        ));
        identity.tier = tier;
        Ok(identity)
    }
}

impl super::KeyExtractor for JwtClaim {
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        let verified = || {
            let Some(token) = bearer_token(parts)? else {
                return Ok(None);
            };
            let claims = self.verify(token)?;
            let unkeyed = |claim: Option<&Value>| claim.is_none_or(Value::is_null);
            if self.inner.missing_claim_unkeyed && unkeyed(claims.get(&self.inner.key_claim)) {
                return Ok(None);
            }
            self.identity(&claims).map(Some)
        };
        verified().map_err(|rejection| {
            rejection.with_challenge(HeaderValue::from_static("Bearer error=\"invalid_token\""))
        })
    }

    fn presents_credentials(&self, parts: &Parts) -> bool {
        parts
            .headers
            .get_all(AUTHORIZATION)
            .iter()
            .any(|value| is_bearer(value.as_bytes()))
    }

    fn needs_credentials(&self) -> bool {
        true
    }
}

/// Whether an `Authorization` value is of the `Bearer` scheme.
fn is_bearer(value: &[u8]) -> bool {
    value.len() > 7 && value[..7].eq_ignore_ascii_case(b"bearer ")
}

/// The bearer token of the request, if it has one.
fn bearer_token(parts: &Parts) -> Result<Option<&str>, KeyRejection> {
    let mut values = parts.headers.get_all(AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyRejection::new(
            "malformed",
            "more than one Authorization header",
        ));
    }
    let bytes = value.as_bytes();
    if !is_bearer(bytes) {
        // Another scheme (Basic, say): not ours to judge.
        return Ok(None);
    }
    if bytes.len() > MAX_TOKEN_LEN {
        return Err(KeyRejection::new(
            "malformed",
            format!("the bearer token is longer than {MAX_TOKEN_LEN} bytes"),
        ));
    }
    let token = std::str::from_utf8(&bytes[7..])
        .ok()
        .map(str::trim)
        .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| KeyRejection::new("malformed", "the bearer token is not a JWT"))?;
    Ok(Some(token))
}

/// The `alg` and `kid` of the token's header, read before any
/// verification so that `none` and unknown algorithms get their own
/// answer, and the key is the one the token names.
fn header_algorithm(token: &str) -> Result<(Algorithm, Option<String>), KeyRejection> {
    let malformed = |detail: &str| KeyRejection::new("malformed", detail.to_owned());
    let mut segments = token.split('.');
    let (Some(header), Some(_), Some(_), None) = (
        segments.next(),
        segments.next(),
        segments.next(),
        segments.next(),
    ) else {
        return Err(malformed("a JWT has three dot-separated segments"));
    };
    let header = URL_SAFE_NO_PAD
        .decode(header)
        .map_err(|_| malformed("the token header is not base64url"))?;
    let header: Map<String, Value> = serde_json::from_slice(&header)
        .map_err(|_| malformed("the token header is not a JSON object"))?;
    let Some(Value::String(name)) = header.get("alg") else {
        return Err(malformed("the token header has no `alg`"));
    };
    let algorithm = Algorithm::from_str(name).map_err(|_| not_allowed())?;
    let kid = match header.get("kid") {
        None | Some(Value::Null) => None,
        Some(Value::String(kid)) => Some(kid.clone()),
        Some(_) => return Err(malformed("the token header's `kid` is not a string")),
    };
    Ok((algorithm, kid))
}

/// The refusal of a token signed with an algorithm outside the allow-list.
/// It names neither the token's algorithm nor the allowed ones: a client
/// probing for a weak algorithm learns nothing.
fn not_allowed() -> KeyRejection {
    KeyRejection::new(
        "algorithm_not_allowed",
        "the token's algorithm is not allowed",
    )
}

fn rejection(kind: &ErrorKind) -> KeyRejection {
    let (reason, detail) = match kind {
        ErrorKind::InvalidSignature => ("bad_signature", "the token's signature does not verify"),
        ErrorKind::ExpiredSignature => ("expired", "the token has expired"),
        ErrorKind::ImmatureSignature => ("not_yet_valid", "the token is not valid yet (nbf)"),
        ErrorKind::InvalidIssuer => ("wrong_issuer", "the token's issuer is not accepted"),
        ErrorKind::InvalidAudience => ("wrong_audience", "the token's audience is not accepted"),
        ErrorKind::InvalidClaimFormat(claim) => {
            return KeyRejection::new(
                "invalid_claim",
                format!("the token's `{claim}` claim is not a valid time"),
            );
        }
        ErrorKind::InvalidAlgorithm
        | ErrorKind::InvalidAlgorithmName
        | ErrorKind::UnsupportedAlgorithm => (
            "algorithm_not_allowed",
            "the token's algorithm is not allowed",
        ),
        ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidEddsaKey
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidKeyFormat => (
            "wrong_key_type",
            "the token's algorithm does not fit the configured key",
        ),
        ErrorKind::Json(error) => {
            return KeyRejection::new(
                "malformed",
                format!("the token's claims could not be read: {error}"),
            );
        }
        _ => ("malformed", "the token could not be decoded"),
    };
    KeyRejection::new(reason, detail)
}

/// A PEM-encoded public key of a supported type (never a private key).
/// The algorithm named `name`; never `none`.
pub(crate) fn algorithm(name: &str) -> Result<Algorithm, JwtError> {
    Algorithm::from_str(name).map_err(|_| JwtError::UnknownAlgorithm(name.to_owned()))
}

pub(crate) fn public_key(pem: &[u8]) -> Result<DecodingKey, JwtError> {
    if pem.windows(11).any(|w| w == b"PRIVATE KEY") {
        return Err(JwtError::InvalidKey(
            "this is a private key: give the matching public key".to_owned(),
        ));
    }
    DecodingKey::from_rsa_pem(pem)
        .or_else(|_| DecodingKey::from_ec_pem(pem))
        .or_else(|_| DecodingKey::from_ed_pem(pem))
        .map_err(|error| JwtError::InvalidKey(error.to_string()))
}
