//! The limiter's answers as gRPC statuses, for services that speak gRPC
//! ([`Rejection::to_grpc`]), and how a gRPC call ended, for policies that
//! count failures or successes only.

use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::headers::number_value;
use crate::rejection::Rejection;

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// gRPC status codes the limiter answers with.
const RESOURCE_EXHAUSTED: u64 = 8;
const INTERNAL: u64 = 13;
const UNAVAILABLE: u64 = 14;
const UNAUTHENTICATED: u64 = 16;

/// Whether `content_type` is gRPC's: `application/grpc`, or a subtype such
/// as `application/grpc+proto` (gRPC-Web is not).
pub(crate) fn is_grpc_content_type(content_type: &HeaderValue) -> bool {
    matches!(after_grpc(content_type), Some([] | [b'+' | b';', ..]))
}

/// What follows `application/grpc` (in any case) in `content_type`, if it
/// starts so.
fn after_grpc(content_type: &HeaderValue) -> Option<&[u8]> {
    let bytes = content_type.as_bytes();
    let prefix = b"application/grpc";
    let head = bytes.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &bytes[prefix.len()..])
}

/// Whether a response of `status` with `headers` is a failure, if its
/// head tells: a status of 400 or above is; a gRPC response (gRPC-Web
/// too) fails with any `grpc-status` but `0`, which the head holds only
/// when the call ended at once (Trailers-Only): otherwise the trailers
/// tell (`None`; gRPC-Web's are in its body, so it stays counted).
pub(crate) fn response_failed(status: StatusCode, headers: &HeaderMap) -> Option<bool> {
    if status.as_u16() >= 400 {
        return Some(true);
    }
    match headers.get(CONTENT_TYPE) {
        Some(content_type) if is_grpc_or_grpc_web(content_type) => call_failed(headers),
        _ => Some(false),
    }
}

/// Whether `content_type` is gRPC's or gRPC-Web's
/// (`application/grpc-web`, `application/grpc-web-text+proto`, ...).
fn is_grpc_or_grpc_web(content_type: &HeaderValue) -> bool {
    is_grpc_content_type(content_type)
        || after_grpc(content_type)
            .and_then(|rest| rest.get(..4))
            .is_some_and(|web| web.eq_ignore_ascii_case(b"-web"))
}

/// Whether the `grpc-status` in `fields` (a head or trailers) is a
/// failure; `None` without one.
pub(crate) fn call_failed(fields: &HeaderMap) -> Option<bool> {
    fields.get(GRPC_STATUS).map(|status| status != "0")
}

impl Rejection<'_> {
    /// This rejection as a gRPC status, in a "Trailers-Only" response
    /// (HTTP `200`, `content-type: application/grpc`, `grpc-status` and
    /// `grpc-message` in the headers, no body):
    ///
    /// | rejection | status |
    /// |---|---|
    /// | over a limit | `RESOURCE_EXHAUSTED`, with `grpc-retry-pushback-ms` (the time until the call fits) |
    /// | a cost above the limit | `RESOURCE_EXHAUSTED`, with `grpc-retry-pushback-ms: -1` (never retry) |
    /// | credentials that do not verify, or none where they are needed | `UNAUTHENTICATED` |
    /// | no client identified otherwise | `INTERNAL` |
    /// | the store down, failing closed | `UNAVAILABLE`, with `grpc-retry-pushback-ms: 1000` |
    ///
    /// The layer answers a gRPC call (`content-type: application/grpc`,
    /// `application/grpc+proto`, ...) so by itself; a hook calls this to
    /// answer other requests as gRPC too. The layer adds the headers of its
    /// own answer the response does not set (`retry-after` and the
    /// rate-limit headers), which gRPC clients read as metadata.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let policies = Policies::single(Policy::new("checks", 5, Duration::from_secs(60))).unwrap();
    /// // Every answer as gRPC, whatever the request's content type.
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
    ///     .on_rejection(|rejection, _| Some(rejection.to_grpc()));
    /// ```
    pub fn to_grpc(&self) -> Response<Bytes> {
        let (code, message, pushback) = match self {
            Self::Limited(limited) => (
                RESOURCE_EXHAUSTED,
                format!(
                    "rate limit of {} reached for policy `{}`; retry in {} s",
                    limited.limit(),
                    limited.policy(),
                    limited.retry_after().as_secs()
                ),
                Some(pushback_ms(limited.exact_retry_after())),
            ),
            Self::CostAboveLimit(denied) => (
                RESOURCE_EXHAUSTED,
                format!(
                    "this call costs {} units under policy `{}`, which allows {}: it can never be admitted",
                    denied.cost(),
                    denied.policy(),
                    denied.limit()
                ),
                Some(HeaderValue::from_static("-1")),
            ),
            Self::InvalidCredentials(refused) => (
                UNAUTHENTICATED,
                format!("invalid credentials: {}", refused.reason()),
                None,
            ),
            Self::Unidentified {
                missing_credentials: true,
                ..
            } => (UNAUTHENTICATED, "credentials are required".to_owned(), None),
            Self::Unidentified { .. } => (
                INTERNAL,
                "the rate limiter could not identify the client".to_owned(),
                None,
            ),
            Self::DelayFull { retry_after } => (
                UNAVAILABLE,
                "the rate limiter holds as many waiting calls as it may".to_owned(),
                Some(pushback_ms(*retry_after)),
            ),
            // As the HTTP answer's `Retry-After: 1`: retries a second apart.
            Self::StoreUnavailable(_) => (
                UNAVAILABLE,
                "the rate limiter is unavailable".to_owned(),
                Some(HeaderValue::from_static("1000")),
            ),
        };
        let mut response = Response::new(Bytes::new());
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(GRPC_STATUS, number_value(code));
        if let Ok(message) = HeaderValue::from_str(&percent_encoded(&message)) {
            headers.insert(GRPC_MESSAGE, message);
        }
        if let Some(pushback) = pushback {
            headers.insert(GRPC_RETRY_PUSHBACK_MS, pushback);
        }
        response
    }
}

/// Whole milliseconds, rounded up, as gRPC's retry pushback.
fn pushback_ms(retry_after: Duration) -> HeaderValue {
    let millis = retry_after.as_nanos().div_ceil(1_000_000);
    number_value(u64::try_from(millis).unwrap_or(u64::MAX))
}

/// `grpc-message` encoding: printable ASCII but `%` as it is, every other
/// byte as `%XX`.
fn percent_encoded(message: &str) -> String {
    let mut encoded = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (b' '..=b'~').contains(&byte) && byte != b'%' {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_percent_encoded_as_grpc_wants() {
        assert_eq!(percent_encoded("100% é"), "100%25 %C3%A9");
        assert_eq!(pushback_ms(Duration::from_micros(1_500)), "2");
        assert_eq!(pushback_ms(Duration::from_secs(3)), "3000");
    }

    #[test]
    fn a_grpc_call_fails_by_its_status_wherever_it_is() {
        let head = |pairs: &[(&'static str, &'static str)]| {
            let mut headers = HeaderMap::new();
            for (name, value) in pairs {
                headers.insert(*name, HeaderValue::from_static(value));
            }
            headers
        };
        let grpc = ("content-type", "application/grpc");
        assert_eq!(response_failed(StatusCode::OK, &head(&[])), Some(false));
        assert_eq!(
            response_failed(StatusCode::NOT_FOUND, &head(&[grpc])),
            Some(true)
        );
        assert_eq!(
            response_failed(StatusCode::OK, &head(&[grpc, ("grpc-status", "5")])),
            Some(true)
        );
        assert_eq!(
            response_failed(StatusCode::OK, &head(&[grpc, ("grpc-status", "0")])),
            Some(false)
        );
        // The status comes in the trailers.
        assert_eq!(response_failed(StatusCode::OK, &head(&[grpc])), None);
        let web = ("content-type", "application/grpc-web+proto");
        assert_eq!(
            response_failed(StatusCode::OK, &head(&[web, ("grpc-status", "16")])),
            Some(true)
        );
        assert_eq!(response_failed(StatusCode::OK, &head(&[web])), None);
        assert_eq!(call_failed(&head(&[("grpc-status", "13")])), Some(true));
        assert_eq!(call_failed(&head(&[])), None);
    }

    #[test]
    fn a_store_down_spaces_retries_a_second_apart() {
        let error = crate::store::StoreError::CircuitOpen;
        let response = Rejection::StoreUnavailable(&error).to_grpc();
        let headers = response.headers();
        assert_eq!(headers[GRPC_STATUS], "14");
        assert_eq!(headers[GRPC_RETRY_PUSHBACK_MS], "1000");
    }
}
