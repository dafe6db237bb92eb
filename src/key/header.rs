//! Keys from a request header, such as an API key, with an optional
//! value → tier table.

use std::collections::HashMap;
use std::sync::Arc;

use http::HeaderName;
use http::request::Parts;

use super::{Extracted, Identity, Key, KeyExtractor};

/// Keys a request by one header's value, e.g. `x-api-key`.
///
/// The value is a secret by default and always hashed; call
/// [`Header::public`] for non-secret values (a tenant id, say), which are
/// kept readable when short and safe. A missing or empty header, or the
/// header sent more than once, yields no key, so the next extractor in the
/// chain decides.
///
/// ```
/// use slidegate::{Header, KeyExtractor};
///
/// let (parts, _) = http::Request::builder()
///     .header("x-api-key", "sk_live_abc")
///     .body(())
///     .unwrap()
///     .into_parts();
/// let key = Header::new(http::HeaderName::from_static("x-api-key")).extract(&parts).unwrap().unwrap().key;
/// assert!(key.as_str().starts_with("x-api-key:#"));
/// assert!(!key.as_str().contains("sk_live_abc"));
/// ```
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
    secret: bool,
    /// Tier by the hashed header value: the table never holds a raw API
    /// key after construction.
    tiers: Arc<HashMap<Key, Arc<str>>>,
}

impl Header {
    /// Keys by the header `name`, hashing its value.
    pub fn new(name: HeaderName) -> Self {
        Self {
            name,
            secret: true,
            tiers: Arc::default(),
        }
    }

    /// Treats the value as public: kept as it is when it is short printable
    /// ASCII without `{`, `}` or `#`, hashed otherwise.
    ///
    /// ```
    /// use slidegate::{Header, KeyExtractor};
    ///
    /// let (parts, _) = http::Request::builder()
    ///     .header("x-tenant", "acme")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// let key = Header::new(http::HeaderName::from_static("x-tenant")).public().extract(&parts).unwrap().unwrap().key;
    /// assert_eq!(key.as_str(), "x-tenant:acme");
    /// ```
    #[must_use]
    pub fn public(mut self) -> Self {
        self.secret = false;
        self
    }

    /// Gives clients a tier by header value (API key → tier). Values are
    /// hashed on the way in, like the keys themselves; unknown values get
    /// no tier, so policies' base limits.
    ///
    /// ```
    /// use slidegate::{Header, KeyExtractor};
    ///
    /// let api_keys = Header::new(http::HeaderName::from_static("x-api-key"))
    ///     .tiers([("key-of-a-pro", "pro"), ("key-of-a-free-user", "free")]);
    /// let (parts, _) = http::Request::builder()
    ///     .header("x-api-key", "key-of-a-pro")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// let identity = api_keys.extract(&parts).unwrap().unwrap();
    /// assert_eq!(identity.tier.as_deref(), Some("pro"));
    /// ```
    #[must_use]
    pub fn tiers<V, T>(mut self, table: impl IntoIterator<Item = (V, T)>) -> Self
    where
        V: AsRef<[u8]>,
        T: Into<Arc<str>>,
    {
        let mut tiers = (*self.tiers).clone();
        for (value, tier) in table {
            tiers.insert(Key::hashed(value), tier.into());
        }
        self.tiers = Arc::new(tiers);
        self
    }
}

impl KeyExtractor for Header {
    fn extract(&self, parts: &Parts) -> Extracted {
        let mut values = parts.headers.get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            tracing::debug!(header = %self.name, "header sent more than once; not used as a key");
            return Ok(None);
        }
        let bytes = value.as_bytes();
        if bytes.is_empty() {
            return Ok(None);
        }
        let hashed = Key::hashed(bytes);
        let tier = self.tiers.get(&hashed).cloned();
        let material = if self.secret { hashed } else { Key::new(bytes) };
        Ok(Some(Identity {
            key: Key::labelled(self.name.as_str(), material),
            tier,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn parts_with(values: &[HeaderValue]) -> Parts {
        let mut request = http::Request::new(());
        for value in values {
            request.headers_mut().append("x-api-key", value.clone());
        }
        request.into_parts().0
    }

    fn extract(values: &[HeaderValue]) -> Option<Identity> {
        Header::new(HeaderName::from_static("x-api-key"))
            .extract(&parts_with(values))
            .unwrap()
    }

    #[test]
    fn missing_empty_or_repeated_header_yields_nothing() {
        assert_eq!(extract(&[]), None);
        assert_eq!(extract(&[HeaderValue::from_static("")]), None);
        let twice = [HeaderValue::from_static("a"), HeaderValue::from_static("b")];
        assert_eq!(extract(&twice), None);
    }

    #[test]
    fn binary_and_huge_values_are_hashed_to_a_short_key() {
        let binary = HeaderValue::from_bytes(b"\xff\xfe{x}").unwrap();
        let huge = HeaderValue::from_str(&"k".repeat(16 * 1024)).unwrap();
        for value in [binary, huge] {
            let key = extract(&[value]).unwrap().key;
            assert_eq!(key.as_str().len(), "x-api-key:#".len() + 32);
            assert!(!key.as_str().contains('{'));
        }
    }

    #[test]
    fn distinct_secrets_get_distinct_keys() {
        let a = extract(&[HeaderValue::from_static("key-a")]).unwrap();
        let b = extract(&[HeaderValue::from_static("key-b")]).unwrap();
        assert_ne!(a.key, b.key);
    }

    #[test]
    fn tier_table_holds_no_raw_secret() {
        let header =
            Header::new(HeaderName::from_static("x-api-key")).tiers([("secret-pro", "pro")]);
        assert!(!format!("{header:?}").contains("secret-pro"));
        let tier = |h: &Header, v: &'static str| {
            h.extract(&parts_with(&[HeaderValue::from_static(v)]))
                .unwrap()
                .unwrap()
                .tier
        };
        assert_eq!(tier(&header, "secret-pro").as_deref(), Some("pro"));
        assert_eq!(tier(&header, "unknown"), None);
        assert_eq!(tier(&header.public(), "secret-pro").as_deref(), Some("pro"));
    }
}
