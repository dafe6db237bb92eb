//! Keys from a request header: API keys, known in advance, or the value of
//! a header your own gateway sets.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use http::request::Parts;
use http::{HeaderName, HeaderValue};

use crate::lookup::Lookup;

use super::{
    ApiKeyLookup, ApiKeyStatus, Extracted, Identity, Key, KeyExtractor, KeyRejection, Otherwise,
    Unconfirmed, digest, hex_of, sanitized,
};

/// The label of API keys in store keys.
const API_KEY_LABEL: &str = "key";

/// The key of the API key whose [`digest`] is `digest`, in label form
/// (`key:#<hash>`): the key [`Header`] gives a known one.
pub(crate) fn api_key_of(digest: &[u8; 16]) -> Key {
    Key::labelled(API_KEY_LABEL, &hex_of(digest))
}

/// Who may write the header, and so what its value proves.
#[derive(Debug, Clone)]
enum Trust {
    /// The client writes it: only values in the table are identities,
    /// each keyed `key:<hash>` ([`api_key_of`]).
    KnownOnly { reject_unknown: bool },
    /// A gateway of yours writes it: every value is the client, keyed
    /// under `label`, `header:<name>`.
    AsIs { secret: bool, label: Arc<str> },
}

/// Keys a request by one header's value: an API key in the header you
/// name (such as `x-api-key`, the configuration file's
/// `api_key_header` by default), or, by an explicit opt-in, a header your
/// own gateway sets ([`Header::trusted`]).
///
/// **API keys are identities only when known:** a key in the table given
/// to [`keys`](Header::with_keys) or [`tiers`](Header::with_tiers) is the client,
/// as `key:<hash>`. Any other value is no identity, so the next extractor
/// in the chain decides (a client sending a fresh random key each time is
/// limited by its address, say), or, with
/// [`with_unknown_rejected`](Header::with_unknown_rejected), is refused with `401`.
/// Keys are hashed on the way in: neither the table nor any store key holds
/// a raw API key. A missing or empty header, or one sent more than once,
/// is no known key either.
///
/// ```
/// use slidegate::{Header, KeyExtractor};
///
/// let api_keys = Header::new(http::HeaderName::from_static("x-api-key")).with_keys(["sk_live_abc"]);
/// let with = |key: &str| {
///     let (parts, _) = http::Request::builder().header("x-api-key", key).body(()).unwrap().into_parts();
///     api_keys.extract(&parts).unwrap()
/// };
/// let known = with("sk_live_abc").unwrap().key;
/// assert!(known.as_str().starts_with("key:#"));
/// assert!(!known.as_str().contains("sk_live_abc"));
/// assert_eq!(with("made-up"), None, "unknown: the next extractor decides");
/// ```
#[derive(Clone)]
pub struct Header {
    name: HeaderName,
    trust: Trust,
    /// Known values by their digest, with their tiers: the table never
    /// holds a raw API key after construction.
    known: Arc<HashMap<[u8; 16], Option<Arc<str>>>>,
    /// Where keys outside the table are looked up, if anywhere.
    lookup: Option<Arc<ApiKeyLookup>>,
}

impl fmt::Debug for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Header")
            .field("name", &self.name)
            .field("trust", &self.trust)
            .field("known", &self.known.len())
            .field("lookup", &self.lookup.is_some())
            .finish()
    }
}

impl Header {
    /// Keys by the API key in the header `name`; only keys added with
    /// [`keys`](Header::with_keys) or [`tiers`](Header::with_tiers) identify a client.
    pub fn new(name: HeaderName) -> Self {
        Self {
            name,
            trust: Trust::KnownOnly {
                reject_unknown: false,
            },
            known: Arc::default(),
            lookup: None,
        }
    }

    /// Keys by whatever value the header `name` holds, hashed, as
    /// `header:<name>:<hash>`. **Only for a header your own gateway or
    /// proxy sets** (after authenticating the client) and strips from what
    /// clients send: any client that can write the header can pick its own
    /// bucket with every request.
    ///
    /// ```
    /// use slidegate::{Header, KeyExtractor};
    ///
    /// let (parts, _) = http::Request::builder()
    ///     .header("x-authenticated-user", "u-1234")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// let user = Header::trusted(http::HeaderName::from_static("x-authenticated-user"));
    /// let key = user.extract(&parts).unwrap().unwrap().key;
    /// assert!(key.as_str().starts_with("header:x-authenticated-user:#"));
    /// ```
    pub fn trusted(name: HeaderName) -> Self {
        Self {
            trust: Trust::AsIs {
                secret: true,
                label: Arc::from(format!("header:{name}")),
            },
            name,
            known: Arc::default(),
            lookup: None,
        }
    }

    /// For a [`trusted`](Header::trusted) header whose values are not
    /// secret (a tenant id, say): they are kept readable when short and
    /// safe, hashed otherwise. API keys are secrets and stay hashed: on a
    /// header made with [`Header::new`] this changes nothing.
    ///
    /// ```
    /// use slidegate::{Header, KeyExtractor};
    ///
    /// let (parts, _) = http::Request::builder()
    ///     .header("x-tenant", "acme")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// let tenant = Header::trusted(http::HeaderName::from_static("x-tenant")).with_public_values(true);
    /// assert_eq!(tenant.extract(&parts).unwrap().unwrap().key.as_str(), "header:x-tenant:acme");
    /// ```
    #[must_use]
    pub fn with_public_values(mut self, public: bool) -> Self {
        if let Trust::AsIs { secret, .. } = &mut self.trust {
            *secret = !public;
        }
        self
    }

    /// Refuses unknown API keys with `401` (reason `unknown_api_key`)
    /// instead of letting the next extractor decide.
    ///
    /// ```
    /// use slidegate::{Header, KeyExtractor};
    ///
    /// let api_keys = Header::new(http::HeaderName::from_static("x-api-key"))
    ///     .with_keys(["sk_live_abc"])
    ///     .with_unknown_rejected(true);
    /// let (parts, _) = http::Request::builder().header("x-api-key", "guess").body(()).unwrap().into_parts();
    /// assert_eq!(api_keys.extract(&parts).unwrap_err().reason(), "unknown_api_key");
    /// ```
    #[must_use]
    pub fn with_unknown_rejected(mut self, rejected: bool) -> Self {
        if let Trust::KnownOnly { reject_unknown } = &mut self.trust {
            *reject_unknown = rejected;
        }
        self
    }

    /// Adds known API keys without a tier (the policies' base limits).
    /// They are hashed on the way in.
    #[must_use]
    pub fn with_keys<V: AsRef<[u8]>>(self, keys: impl IntoIterator<Item = V>) -> Self {
        self.add(keys.into_iter().map(|key| (digest(key.as_ref()), None)))
    }

    /// Adds known API keys with their tiers (API key → tier). Keys are
    /// hashed on the way in. On a [`trusted`](Header::trusted) header,
    /// the table gives tiers to the values it names, and other values are
    /// keyed without one.
    ///
    /// ```
    /// use slidegate::{Header, KeyExtractor};
    ///
    /// let api_keys = Header::new(http::HeaderName::from_static("x-api-key"))
    ///     .with_tiers([("key-of-a-pro", "pro"), ("key-of-a-free-user", "free")]);
    /// let (parts, _) = http::Request::builder()
    ///     .header("x-api-key", "key-of-a-pro")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// let identity = api_keys.extract(&parts).unwrap().unwrap();
    /// assert_eq!(identity.tier.as_deref(), Some("pro"));
    /// ```
    #[must_use]
    pub fn with_tiers<V, T>(self, table: impl IntoIterator<Item = (V, T)>) -> Self
    where
        V: AsRef<[u8]>,
        T: Into<Arc<str>>,
    {
        self.add(
            table
                .into_iter()
                .map(|(key, tier)| (digest(key.as_ref()), Some(tier.into()))),
        )
    }

    /// Asks `lookup` about API keys that are not in the table (keys kept
    /// in a database, say), given the header's raw value: a key it says is
    /// [`Known`](crate::key::ApiKeyStatus::Known) is the client, with the
    /// tier it names; an unknown one is treated as any unknown key (the
    /// next extractor decides, or `401` with
    /// [`with_unknown_rejected`](Header::with_unknown_rejected)).
    ///
    /// The layer waits for it at most its
    /// [lookup timeout](crate::RateLimitLayer::with_lookup_timeout) (100 ms by
    /// default); a lookup that times out counts as
    /// [`Unknown`](crate::key::ApiKeyStatus::Unknown), so the next extractor
    /// decides and nothing is admitted unlimited. It runs for every request
    /// with a key outside the table: cache its answers, known and unknown
    /// alike, or a client sending random keys sends your database a query
    /// each. Any `Fn(&[u8]) -> impl Future<Output = ApiKeyStatus>` is a
    /// lookup (see [`Lookup`]):
    ///
    /// ```
    /// use std::sync::Arc;
    /// use slidegate::{Header, key::ApiKeyStatus};
    ///
    /// let api_keys = Header::new(http::HeaderName::from_static("x-api-key")).with_lookup(|key: &[u8]| {
    ///     // Pretend the keys live in a database.
    ///     let exists = key.starts_with(b"sk_live_");
    ///     async move {
    ///         if exists { ApiKeyStatus::Known(Some(Arc::from("pro"))) } else { ApiKeyStatus::Unknown }
    ///     }
    /// });
    /// ```
    #[must_use]
    pub fn with_lookup(
        mut self,
        lookup: impl for<'a> Lookup<&'a [u8], Answer = ApiKeyStatus>,
    ) -> Self {
        self.lookup = Some(Arc::new(lookup));
        self
    }

    fn add(mut self, entries: impl Iterator<Item = ([u8; 16], Option<Arc<str>>)>) -> Self {
        let mut known = (*self.known).clone();
        known.extend(entries);
        self.known = Arc::new(known);
        self
    }

    /// The header's one non-empty value, or why there is none to use.
    fn value<'a>(&self, parts: &'a Parts) -> Value<'a> {
        let mut values = parts.headers.get_all(&self.name).iter();
        match (values.next(), values.next()) {
            (None, _) => Value::Absent,
            (Some(value), None) if value.is_empty() => Value::Absent,
            (Some(value), None) => Value::One(value),
            (Some(_), Some(_)) => Value::Repeated,
        }
    }

    fn unknown(&self, detail: String) -> Extracted {
        match self.trust {
            Trust::KnownOnly {
                reject_unknown: true,
            } => Err(KeyRejection::new("unknown_api_key", detail).with_challenge(self.challenge())),
            _ => Ok(None),
        }
    }

    /// The refusal of a key neither the table nor the lookup knows.
    fn unknown_key(&self) -> KeyRejection {
        KeyRejection::new(
            "unknown_api_key",
            format!("the {} is not a known API key", self.name),
        )
        .with_challenge(self.challenge())
    }

    /// `WWW-Authenticate` for a refused API key: which header to send it in.
    fn challenge(&self) -> HeaderValue {
        HeaderValue::try_from(format!("ApiKey header=\"{}\"", self.name))
            .expect("a header name is a valid header value")
    }
}

/// What a request holds in the header.
enum Value<'a> {
    Absent,
    One(&'a HeaderValue),
    Repeated,
}

impl KeyExtractor for Header {
    fn extract(&self, parts: &Parts) -> Result<Option<Identity>, KeyRejection> {
        let value = match self.value(parts) {
            Value::Absent => return Ok(None),
            Value::Repeated => {
                tracing::debug!(header = %self.name, "header sent more than once; not used as a key");
                return self.unknown(format!("the {} header was sent more than once", self.name));
            }
            Value::One(value) => value.as_bytes(),
        };
        let digest = digest(value);
        let tier = self.known.get(&digest);
        match &self.trust {
            Trust::KnownOnly { reject_unknown } => {
                let mut identity = Identity::new(api_key_of(&digest));
                match (tier, &self.lookup) {
                    (Some(tier), _) => identity.tier = tier.clone(),
                    (None, Some(lookup)) => {
                        identity.unconfirmed = Some(Box::new(Unconfirmed {
                            lookup: Mutex::new(lookup.lookup(value)),
                            otherwise: Otherwise {
                                reject: reject_unknown.then(|| self.unknown_key()),
                                fallback: None,
                            },
                        }));
                    }
                    (None, None) => {
                        return self.unknown(format!("the {} is not a known API key", self.name));
                    }
                }
                Ok(Some(identity))
            }
            Trust::AsIs { secret, label } => {
                let material = if *secret {
                    hex_of(&digest).into()
                } else {
                    sanitized(value)
                };
                let mut identity = Identity::new(Key::labelled(label, &material));
                identity.tier = tier.cloned().flatten();
                Ok(Some(identity))
            }
        }
    }

    fn presents_credentials(&self, parts: &Parts) -> bool {
        matches!(self.trust, Trust::KnownOnly { .. }) && parts.headers.contains_key(&self.name)
    }

    fn needs_credentials(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts_with(values: &[HeaderValue]) -> Parts {
        let mut request = http::Request::new(());
        for value in values {
            request.headers_mut().append("x-api-key", value.clone());
        }
        request.into_parts().0
    }

    fn api_keys() -> Header {
        Header::new(HeaderName::from_static("x-api-key"))
            .with_keys(["key-a", "key-b"])
            .with_tiers([("secret-pro", "pro")])
    }

    fn extract(header: &Header, values: &[HeaderValue]) -> Extracted {
        header.extract(&parts_with(values))
    }

    #[test]
    fn missing_empty_or_repeated_header_yields_nothing() {
        let keys = api_keys();
        assert_eq!(extract(&keys, &[]), Ok(None));
        assert_eq!(extract(&keys, &[HeaderValue::from_static("")]), Ok(None));
        let twice = [
            HeaderValue::from_static("key-a"),
            HeaderValue::from_static("key-b"),
        ];
        assert_eq!(extract(&keys, &twice), Ok(None));
        assert_eq!(
            extract(&keys.with_unknown_rejected(true), &twice)
                .unwrap_err()
                .reason(),
            "unknown_api_key"
        );
    }

    #[test]
    fn only_known_keys_are_identities() {
        let keys = api_keys();
        let a = extract(&keys, &[HeaderValue::from_static("key-a")]).unwrap();
        let b = extract(&keys, &[HeaderValue::from_static("key-b")]).unwrap();
        assert_ne!(a.unwrap().key, b.unwrap().key);
        for unknown in [&b"key-c"[..], b"\xff\xfe{x}", &[b'k'; 16 * 1024]] {
            let value = HeaderValue::from_bytes(unknown).unwrap();
            assert_eq!(extract(&keys, std::slice::from_ref(&value)), Ok(None));
            let refused = extract(&keys.clone().with_unknown_rejected(true), &[value]).unwrap_err();
            assert_eq!(refused.reason(), "unknown_api_key");
            assert_eq!(
                refused.www_authenticate().unwrap(),
                "ApiKey header=\"x-api-key\""
            );
        }
    }

    #[test]
    fn trusted_values_are_hashed_to_a_short_labelled_key() {
        let trusted = Header::trusted(HeaderName::from_static("x-api-key"));
        let binary = HeaderValue::from_bytes(b"\xff\xfe{x}").unwrap();
        let huge = HeaderValue::from_str(&"k".repeat(16 * 1024)).unwrap();
        for value in [binary, huge] {
            let key = extract(&trusted, &[value]).unwrap().unwrap().key;
            assert_eq!(key.as_str().len(), "header:x-api-key:#".len() + 32);
            assert!(!key.as_str().contains('{'));
        }
    }

    #[test]
    fn the_table_holds_no_raw_secret() {
        let header = api_keys();
        assert!(!format!("{header:?}").contains("secret-pro"));
        let tier = |h: &Header, v: &'static str| {
            extract(h, &[HeaderValue::from_static(v)])
                .unwrap()
                .and_then(|identity| identity.tier)
        };
        assert_eq!(tier(&header, "secret-pro").as_deref(), Some("pro"));
        assert_eq!(tier(&header, "key-a"), None);
        let trusted = Header::trusted(HeaderName::from_static("x-api-key"))
            .with_tiers([("secret-pro", "pro")])
            .with_public_values(true);
        assert_eq!(tier(&trusted, "secret-pro").as_deref(), Some("pro"));
        assert_eq!(tier(&trusted, "anyone"), None);
    }

    #[test]
    fn public_leaves_api_keys_hashed() {
        let keys = api_keys().with_public_values(true);
        let key = extract(&keys, &[HeaderValue::from_static("key-a")])
            .unwrap()
            .unwrap()
            .key;
        assert!(!key.as_str().contains("key-a"), "{key}");
    }
}
