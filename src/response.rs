//! What the limiter writes: rate-limit headers, and the 429, 503 and 500
//! answers with `application/problem+json` bodies.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

use crate::{Decision, Policy};

/// `X-RateLimit-Limit`: units allowed per window.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: units left in the window.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`: when capacity next grows.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// Which rate-limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    #[default]
    XRateLimit,
    /// No rate-limit headers (a 429 still carries `Retry-After`).
    None,
}

/// How `X-RateLimit-Reset` expresses time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResetFormat {
    /// Seconds from now, rounded up.
    #[default]
    DeltaSeconds,
    /// A Unix timestamp in seconds, rounded up.
    UnixSeconds,
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_seconds(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

/// Writes the rate-limit headers for `decision`.
pub(crate) fn write_headers(
    headers: &mut HeaderMap,
    decision: &Decision,
    style: HeaderStyle,
    reset_format: ResetFormat,
) {
    if style == HeaderStyle::None {
        return;
    }
    let reset = match reset_format {
        ResetFormat::DeltaSeconds => ceil_seconds(decision.reset),
        ResetFormat::UnixSeconds => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            ceil_seconds(now + decision.reset)
        }
    };
    headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(decision.limit));
    headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(decision.remaining));
    headers.insert(X_RATELIMIT_RESET, HeaderValue::from(reset));
}

fn problem(status: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
    response
}

fn seconds_value(duration: Duration) -> serde_json::Value {
    if duration.subsec_nanos() == 0 {
        json!(duration.as_secs())
    } else {
        json!(duration.as_secs_f64())
    }
}

/// `429 Too Many Requests` for the policy that denied the request.
pub(crate) fn too_many_requests(
    policy: &Policy,
    decision: &Decision,
    style: HeaderStyle,
    reset_format: ResetFormat,
) -> Response<Full<Bytes>> {
    let retry_after = ceil_seconds(decision.retry_after.unwrap_or_default()).max(1);
    let window = humantime::format_duration(policy.window());
    let mut response = problem(
        StatusCode::TOO_MANY_REQUESTS,
        json!({
            "type": "about:blank",
            "title": "Too Many Requests",
            "status": 429,
            "detail": format!(
                "rate limit of {} per {window} reached for policy `{}`; retry in {retry_after} s",
                policy.limit(),
                policy.name(),
            ),
            "policy": policy.name(),
            "limit": policy.limit(),
            "window_seconds": seconds_value(policy.window()),
            "retry_after_seconds": retry_after,
        }),
    );
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, HeaderValue::from(retry_after));
    write_headers(headers, decision, style, reset_format);
    response
}

/// `503 Service Unavailable`: the store failed and the policy fails closed.
pub(crate) fn limiter_unavailable() -> Response<Full<Bytes>> {
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({
            "type": "about:blank",
            "title": "Rate Limiter Unavailable",
            "status": 503,
            "detail": "the rate limiter's store is unavailable, so this request could not be \
                       checked; the problem is on the server's side, not the client's",
        }),
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// `500 Internal Server Error`: no key extractor in the chain identified
/// the client.
pub(crate) fn client_unidentified() -> Response<Full<Bytes>> {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        json!({
            "type": "about:blank",
            "title": "Client Not Identified",
            "status": 500,
            "detail": "the rate limiter could not tell which client sent this request",
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_round_up() {
        assert_eq!(ceil_seconds(Duration::ZERO), 0);
        assert_eq!(ceil_seconds(Duration::from_micros(1)), 1);
        assert_eq!(ceil_seconds(Duration::from_secs(2)), 2);
        assert_eq!(ceil_seconds(Duration::from_millis(2001)), 3);
    }
}
