//! The limiter's own answers, with `application/problem+json` bodies
//! (RFC 9457): 429, 422, 401, 503 and 500.

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use serde_json::json;

use crate::key::KeyRejection;
use crate::policy::Algorithm;
use crate::policy::terms::ceil_seconds;
use crate::store::{Check, Decision};

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// An `application/problem+json` answer (RFC 9457): `type`, `title`,
/// `status` and `detail`, then `extra`, in that order.
fn problem(
    status: StatusCode,
    title: &str,
    detail: &str,
    extra: &[(&str, serde_json::Value)],
) -> Response<Bytes> {
    let mut body = String::with_capacity(160 + detail.len());
    body.push_str("{\"type\":\"about:blank\"");
    let fields = [
        ("title", json!(title)),
        ("status", json!(status.as_u16())),
        ("detail", json!(detail)),
    ];
    for (name, value) in fields.iter().chain(extra) {
        // Names are ours and plain; values are escaped by serde_json.
        let _ = write!(body, ",\"{name}\":{value}");
    }
    body.push('}');
    problem_body(status, body)
}

pub(crate) fn problem_body(status: StatusCode, body: String) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    // Room for the content type, Retry-After and every rate-limit header.
    *response.headers_mut() = HeaderMap::with_capacity(8);
    response.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
    response
}

/// A 429 body for one policy's limits, but for its retry time: built once
/// per denial and filled in per response. Written directly rather than
/// through serde_json, since a flood of denied requests is the limiter's
/// hot path; every part is JSON-safe as it is (policy names are ASCII
/// letters, digits, `-` and `_`; humantime durations ASCII letters, digits
/// and spaces).
#[derive(Debug)]
pub(crate) struct TooManyBody {
    head: String,
    middle: String,
}

impl TooManyBody {
    pub(crate) fn new(check: &Check) -> Self {
        let (policy, limit) = (&check.policy(), check.limit());
        let (what, measure) = match check.algorithm() {
            // A lease's time is no window: the limit is on requests at once.
            Algorithm::Concurrency => (
                format!("concurrency limit of {limit} in flight"),
                String::new(),
            ),
            _ => (
                format!(
                    "rate limit of {limit} per {}",
                    humantime::format_duration(check.window())
                ),
                format!(",\"window_seconds\":{}", seconds_value(check.window())),
            ),
        };
        Self {
            head: format!(
                "{{\"type\":\"about:blank\",\"title\":\"Too Many Requests\",\"status\":429,\
                 \"detail\":\"{what} reached for policy `{policy}`; retry in "
            ),
            middle: format!(
                " s\",\"policy\":\"{policy}\",\"limit\":{limit}{measure},\"retry_after_seconds\":"
            ),
        }
    }

    pub(crate) fn render(&self, retry_after: &HeaderValue) -> String {
        let retry = retry_after.to_str().unwrap_or("0");
        let mut body =
            String::with_capacity(self.head.len() + self.middle.len() + 2 * retry.len() + 1);
        for part in [&*self.head, retry, &self.middle, retry, "}"] {
            body.push_str(part);
        }
        body
    }
}

fn seconds_value(duration: Duration) -> serde_json::Value {
    if duration.subsec_nanos() == 0 {
        json!(duration.as_secs())
    } else {
        json!(duration.as_secs_f64())
    }
}

/// `Retry-After` for a denied decision: whole seconds, rounded up, at
/// least one.
pub(crate) fn retry_after_seconds(decision: &Decision) -> u64 {
    ceil_seconds(decision.retry_after().unwrap_or_default()).max(1)
}

/// `422 Unprocessable Content`: the request costs more under a policy than
/// the client may spend in a whole window, so it can never be admitted.
/// No `Retry-After`: waiting would not help.
pub(crate) fn cost_above_limit(
    policy: &str,
    cost: u32,
    limit: u32,
    window: Duration,
) -> Response<Bytes> {
    let detail = format!(
        "this request costs {cost} units under policy `{policy}`, which allows {limit} per {}; \
         it can never be admitted, so retrying will not help",
        humantime::format_duration(window)
    );
    problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Request Cost Above Limit",
        &detail,
        &[
            ("policy", json!(policy)),
            ("cost", json!(cost)),
            ("limit", json!(limit)),
            ("window_seconds", seconds_value(window)),
        ],
    )
}

/// `401 Unauthorized`: the client presented credentials that do not verify.
pub(crate) fn invalid_credentials(rejection: &KeyRejection) -> Response<Bytes> {
    let mut response = problem(
        StatusCode::UNAUTHORIZED,
        "Invalid Credentials",
        rejection.detail(),
        &[("reason", json!(rejection.reason()))],
    );
    if let Some(challenge) = rejection.www_authenticate() {
        response
            .headers_mut()
            .insert(WWW_AUTHENTICATE, challenge.clone());
    }
    response
}

/// `503 Service Unavailable`: the store failed and the policy fails closed.
pub(crate) fn limiter_unavailable() -> Response<Bytes> {
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Rate Limiter Unavailable",
        "the rate limiter's store is unavailable, so this request could not be checked; the \
         problem is on the server's side, not the client's",
        &[],
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// `503 Service Unavailable`: the layer holds as many delayed requests as
/// it may, so this one, which would have waited `retry_after`, is not
/// held.
pub(crate) fn delay_full(retry_after: Duration) -> Response<Bytes> {
    let seconds = ceil_seconds(retry_after).max(1);
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Too Many Requests Held",
        "this request would wait for its rate limit, but the server holds as many waiting \
         requests as it may; nothing was counted against the client",
        &[("retry_after_seconds", json!(seconds))],
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(seconds));
    response
}

/// `401 Unauthorized`: the key extractors identify clients by credentials
/// only, and the request carried none.
pub(crate) fn missing_credentials() -> Response<Bytes> {
    problem(
        StatusCode::UNAUTHORIZED,
        "Credentials Required",
        "this endpoint is rate-limited per client, and the request carried no credentials that \
         identify one",
        &[("reason", json!("missing_credentials"))],
    )
}

/// `403 Forbidden`: the deny list named `list` names the client.
pub(crate) fn deny_listed(list: &'static str) -> Response<Bytes> {
    problem(
        StatusCode::FORBIDDEN,
        "Client Denied",
        "this client is refused by the service's deny list",
        &[("list", json!(list))],
    )
}

/// `500 Internal Server Error`: no key extractor in the chain identified
/// the client.
pub(crate) fn client_unidentified() -> Response<Bytes> {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "Client Not Identified",
        "the rate limiter could not tell which client sent this request",
        &[],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_bodies_keep_their_field_order_and_escape_text() {
        let response = problem(
            StatusCode::UNAUTHORIZED,
            "Invalid Credentials",
            "a \"quoted\" \\ detail\n",
            &[("reason", json!("expired"))],
        );
        let body = std::str::from_utf8(response.body()).unwrap();
        assert_eq!(
            body,
            r#"{"type":"about:blank","title":"Invalid Credentials","status":401,"detail":"a \"quoted\" \\ detail\n","reason":"expired"}"#
        );
        let parsed: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(parsed["detail"], "a \"quoted\" \\ detail\n");
    }
}
