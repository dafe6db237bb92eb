//! The limiter's answers as gRPC statuses, for services that speak gRPC
//! (see [`Rejection::to_grpc`](crate::rejection::Rejection::to_grpc)), and
//! how a gRPC call ended, for policies that count failures or successes
//! only.

use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::headers::number_value;

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// gRPC status codes the limiter answers with.
pub(crate) const PERMISSION_DENIED: u64 = 7;
pub(crate) const RESOURCE_EXHAUSTED: u64 = 8;
pub(crate) const INTERNAL: u64 = 13;
pub(crate) const UNAVAILABLE: u64 = 14;
pub(crate) const UNAUTHENTICATED: u64 = 16;

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

/// A gRPC status `code` with `message`, and the retry pushback if any, as
/// a "Trailers-Only" response (HTTP `200`, `content-type:
/// application/grpc`, `grpc-status` and `grpc-message` in the headers, no
/// body).
pub(crate) fn status_response(
    code: u64,
    message: &str,
    pushback: Option<HeaderValue>,
) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(GRPC_STATUS, number_value(code));
    if let Ok(message) = HeaderValue::from_str(&percent_encoded(message)) {
        headers.insert(GRPC_MESSAGE, message);
    }
    if let Some(pushback) = pushback {
        headers.insert(GRPC_RETRY_PUSHBACK_MS, pushback);
    }
    response
}

/// Whole milliseconds, rounded up, as gRPC's retry pushback.
pub(crate) fn pushback_ms(retry_after: Duration) -> HeaderValue {
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
}
