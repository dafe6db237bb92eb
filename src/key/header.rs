//! Keys from a request header, such as an API key.

use http::HeaderName;
use http::request::Parts;

use super::{Identity, Key, KeyExtractor};

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
/// let key = Header::new(http::HeaderName::from_static("x-api-key")).extract(&parts).unwrap().key;
/// assert!(key.as_str().starts_with("x-api-key:#"));
/// assert!(!key.as_str().contains("sk_live_abc"));
/// ```
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
    secret: bool,
}

impl Header {
    /// Keys by the header `name`, hashing its value.
    pub fn new(name: HeaderName) -> Self {
        Self { name, secret: true }
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
    /// let key = Header::new(http::HeaderName::from_static("x-tenant")).public().extract(&parts).unwrap().key;
    /// assert_eq!(key.as_str(), "x-tenant:acme");
    /// ```
    #[must_use]
    pub fn public(mut self) -> Self {
        self.secret = false;
        self
    }
}

impl KeyExtractor for Header {
    fn extract(&self, parts: &Parts) -> Option<Identity> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let value = values.next()?;
        if values.next().is_some() {
            tracing::debug!(header = %self.name, "header sent more than once; not used as a key");
            return None;
        }
        let bytes = value.as_bytes();
        if bytes.is_empty() {
            return None;
        }
        let material = if self.secret {
            Key::hashed(bytes)
        } else {
            Key::new(bytes)
        };
        Some(Key::labelled(self.name.as_str(), material).into())
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
        Header::new(HeaderName::from_static("x-api-key")).extract(&parts_with(values))
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
}
