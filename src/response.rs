//! What the limiter writes: rate-limit headers, and the 429, 401, 503 and
//! 500 answers with `application/problem+json` bodies.

use std::fmt::Write as _;
use std::sync::LazyLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use serde_json::json;

use crate::rejection::{self, CostAboveLimit, OnRejection, Rejection};
use crate::{Check, Decision, KeyRejection, Limited};

/// `X-RateLimit-Limit`: units allowed per window.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: units left in the window.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`: when capacity next grows.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// `RateLimit-Policy`: the quota policies that applied (IETF httpapi draft).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: what is left of each quota policy (IETF httpapi draft).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Which rate-limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`,
    /// for the policy closest to denying (on a 429, the one that denied).
    #[default]
    XRateLimit,
    /// `RateLimit-Policy` and `RateLimit` as in
    /// draft-ietf-httpapi-ratelimit-headers-10, one item per policy that
    /// applied: `"search";q=5;w=60` and `"search";r=4;t=58`.
    Ietf,
    /// Both of the above.
    Both,
    /// No rate-limit headers (a 429 still carries `Retry-After`).
    None,
}

impl HeaderStyle {
    fn x_ratelimit(self) -> bool {
        matches!(self, Self::XRateLimit | Self::Both)
    }

    fn ietf(self) -> bool {
        matches!(self, Self::Ietf | Self::Both)
    }
}

/// How `X-RateLimit-Reset` expresses time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
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

/// Rate-limit header fields computed once the store has decided, written
/// when the response is ready. Small, since it travels with the inner
/// service's future: the `X-RateLimit-*` trio as numbers, the IETF fields
/// (text) boxed.
#[derive(Debug, Default)]
pub(crate) struct RateHeaders {
    /// `X-RateLimit-Limit`, `-Remaining` and `-Reset`.
    x_ratelimit: Option<[u64; 3]>,
    /// `RateLimit-Policy` and `RateLimit`.
    ietf: Option<Box<[HeaderValue; 2]>>,
}

/// Header values of the integers most often sent (limits, remaining units
/// and seconds up to this), made once: cloning one costs no allocation.
const CACHED_NUMBERS: u64 = 4096;

/// The header value of `n`.
pub(crate) fn number_value(n: u64) -> HeaderValue {
    static NUMBERS: LazyLock<Vec<HeaderValue>> = LazyLock::new(|| {
        // One string holding every cached number, kept for the life of the
        // process, so that each value is a cheap `from_static`.
        let mut text = String::new();
        let mut ends = Vec::with_capacity(CACHED_NUMBERS as usize);
        for n in 0..CACHED_NUMBERS {
            let _ = write!(text, "{n}");
            ends.push(text.len());
        }
        let text: &'static str = Box::leak(text.into_boxed_str());
        let mut start = 0;
        ends.into_iter()
            .map(|end| {
                let value = HeaderValue::from_static(&text[start..end]);
                start = end;
                value
            })
            .collect()
    });
    match usize::try_from(n) {
        Ok(index) if n < CACHED_NUMBERS => NUMBERS[index].clone(),
        // Formatted on the stack and copied once (`From<u64>` allocates twice).
        _ => HeaderValue::from_str(itoa::Buffer::new().format(n))
            .expect("decimal digits are a valid header value"),
    }
}

impl RateHeaders {
    /// The headers for a request whose checks got `decisions`: the
    /// `X-RateLimit-*` trio from the decision at `reported`, the IETF fields
    /// from all of them. On a 429, `retry_after` caps every `t`, so that no
    /// `t` promises capacity later than `Retry-After` does.
    pub(crate) fn new(
        checks: &[Check],
        decisions: &[Decision],
        reported: usize,
        retry_after: Option<u64>,
        style: HeaderStyle,
        reset_format: ResetFormat,
    ) -> Self {
        let mut fields = Self::default();
        if style.x_ratelimit() {
            let decision = &decisions[reported];
            let reset = match reset_format {
                ResetFormat::DeltaSeconds => ceil_seconds(decision.reset),
                ResetFormat::UnixSeconds => {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default();
                    ceil_seconds(now + decision.reset)
                }
            };
            fields.x_ratelimit = Some([decision.limit.into(), decision.remaining.into(), reset]);
        }
        if style.ietf() {
            let mut policy = String::new();
            let mut state = String::new();
            for (check, decision) in checks.iter().zip(decisions) {
                let separator = if policy.is_empty() { "" } else { ", " };
                let t = ceil_seconds(decision.reset);
                let t = retry_after.map_or(t, |cap| t.min(cap));
                // Policy names are ASCII letters, digits, `-` and `_`: valid
                // in a structured-field string as they are.
                let _ = write!(
                    policy,
                    "{separator}\"{}\";q={};w={}",
                    check.policy,
                    check.limit,
                    ceil_seconds(check.window)
                );
                let _ = write!(
                    state,
                    "{separator}\"{}\";r={};t={t}",
                    check.policy, decision.remaining
                );
            }
            if let (Ok(policy), Ok(state)) =
                (HeaderValue::try_from(policy), HeaderValue::try_from(state))
            {
                fields.ietf = Some(Box::new([policy, state]));
            }
        }
        fields
    }

    /// Writes the fields into `headers`, replacing any of the same name.
    pub(crate) fn write(self, headers: &mut HeaderMap) {
        if let Some([limit, remaining, reset]) = self.x_ratelimit {
            headers.insert(X_RATELIMIT_LIMIT, number_value(limit));
            headers.insert(X_RATELIMIT_REMAINING, number_value(remaining));
            headers.insert(X_RATELIMIT_RESET, number_value(reset));
        }
        if let Some(ietf) = self.ietf {
            let [policy, state] = *ietf;
            headers.insert(RATELIMIT_POLICY, policy);
            headers.insert(RATELIMIT, state);
        }
    }
}

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

fn problem_body(status: StatusCode, body: String) -> Response<Bytes> {
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
        let (policy, limit) = (&check.policy, check.limit);
        let window = humantime::format_duration(check.window);
        Self {
            head: format!(
                "{{\"type\":\"about:blank\",\"title\":\"Too Many Requests\",\"status\":429,\
                 \"detail\":\"rate limit of {limit} per {window} reached for policy `{policy}`; \
                 retry in "
            ),
            middle: format!(
                " s\",\"policy\":\"{policy}\",\"limit\":{limit},\"window_seconds\":{},\
                 \"retry_after_seconds\":",
                seconds_value(check.window)
            ),
        }
    }

    fn render(&self, retry_after: &HeaderValue) -> String {
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
    ceil_seconds(decision.retry_after.unwrap_or_default()).max(1)
}

/// `429 Too Many Requests` for the check at `denied`, whose limits (the
/// client's tier's, if it has one) the body reports: from `template` (kept
/// with a cached denial) when there is one. A hook's answer replaces it,
/// and gets the limiter's `Retry-After` and rate-limit headers where it
/// does not set them itself, so they never disagree by accident.
pub(crate) fn too_many_requests(
    checks: &[Check],
    decisions: &[Decision],
    denied: usize,
    template: Option<&TooManyBody>,
    hook: Option<&OnRejection>,
    style: HeaderStyle,
    reset_format: ResetFormat,
) -> Response<Bytes> {
    let retry_after = retry_after_seconds(&decisions[denied]);
    let own = || {
        let retry_value = number_value(retry_after);
        let body = match template {
            Some(template) => template.render(&retry_value),
            None => TooManyBody::new(&checks[denied]).render(&retry_value),
        };
        let mut response = problem_body(StatusCode::TOO_MANY_REQUESTS, body);
        let headers = response.headers_mut();
        headers.insert(RETRY_AFTER, retry_value);
        RateHeaders::new(
            checks,
            decisions,
            denied,
            Some(retry_after),
            style,
            reset_format,
        )
        .write(headers);
        response
    };
    match hook {
        None => own(),
        Some(hook) => {
            let limited = Limited::new(&checks[denied], &decisions[denied], retry_after);
            rejection::answer(Some(hook), &Rejection::Limited(&limited), own)
        }
    }
}

/// `422 Unprocessable Content`: the request costs more under a policy than
/// the client may spend in a whole window, so it can never be admitted.
/// No `Retry-After`: waiting would not help.
pub(crate) fn cost_above_limit(denied: &CostAboveLimit) -> Response<Bytes> {
    let CostAboveLimit {
        policy,
        cost,
        limit,
        window,
    } = denied;
    let detail = format!(
        "this request costs {cost} units under policy `{policy}`, which allows {limit} per {}; \
         it can never be admitted, so retrying will not help",
        humantime::format_duration(*window)
    );
    problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Request Cost Above Limit",
        &detail,
        &[
            ("policy", json!(&**policy)),
            ("cost", json!(cost)),
            ("limit", json!(limit)),
            ("window_seconds", seconds_value(*window)),
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

    #[test]
    fn number_values_match_their_decimal_form_cached_or_not() {
        for n in [
            0,
            1,
            42,
            CACHED_NUMBERS - 1,
            CACHED_NUMBERS,
            1_000_000_000,
            u64::MAX,
        ] {
            assert_eq!(number_value(n), HeaderValue::from(n), "{n}");
        }
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(ceil_seconds(Duration::ZERO), 0);
        assert_eq!(ceil_seconds(Duration::from_micros(1)), 1);
        assert_eq!(ceil_seconds(Duration::from_secs(2)), 2);
        assert_eq!(ceil_seconds(Duration::from_millis(2001)), 3);
    }
}
