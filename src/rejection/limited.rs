//! [`Limited`]: what a rejection hook is told about a denial.

use std::time::Duration;

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderMap, Response, StatusCode};

use crate::headers::{HeaderFormat, RateHeaders, number_value};
use crate::key::Key;
use crate::response::problem::{TooManyBody, problem_body, retry_after_seconds};
use crate::store::{Check, Decision};

/// A denied request ([`Rejection::Limited`](crate::Rejection::Limited)):
/// the policy that denied it (the one the client waits for longest) and
/// when to retry. The limiter's own `429` is written from it too, with
/// the rate-limit headers of every policy of the request.
#[derive(Debug)]
pub struct Limited<'a> {
    pub(crate) checks: &'a [Check],
    pub(crate) decisions: &'a [Decision],
    /// The index of the check that denied.
    pub(crate) denied: usize,
    /// The `429` body, when one is kept ready (the deny cache's).
    pub(crate) body: Option<&'a TooManyBody>,
    check: &'a Check,
    decision: &'a Decision,
    pub(crate) retry_after_seconds: u64,
}

impl<'a> Limited<'a> {
    /// The request whose `checks` got `decisions`, denied by the one at
    /// `denied`.
    pub(crate) fn new(
        checks: &'a [Check],
        decisions: &'a [Decision],
        denied: usize,
        body: Option<&'a TooManyBody>,
    ) -> Self {
        let decision = &decisions[denied];
        Self {
            checks,
            decisions,
            denied,
            body,
            check: &checks[denied],
            decision,
            retry_after_seconds: retry_after_seconds(decision),
        }
    }

    /// The name of the policy that denied the request.
    pub fn policy(&self) -> &str {
        self.check.policy()
    }

    /// The client's key as the store sees it: API keys and other secret or
    /// unsafe client material appear hashed.
    pub fn key(&self) -> &Key {
        &self.check.key
    }

    /// The policy's limit for this client's tier, in units per window.
    pub fn limit(&self) -> u32 {
        self.check.limit()
    }

    /// The policy's window for this client's tier.
    pub fn window(&self) -> Duration {
        self.check.window()
    }

    /// Units the request would have cost.
    pub fn cost(&self) -> u32 {
        self.check.cost
    }

    /// Units left in the window now.
    pub fn remaining(&self) -> u32 {
        self.decision.remaining()
    }

    /// When to retry, in the whole seconds `Retry-After` carries.
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(self.retry_after_seconds)
    }

    /// When the request would fit, to the microsecond (the whole seconds
    /// of [`retry_after`](Self::retry_after) when the store gave no time).
    pub(crate) fn exact_retry_after(&self) -> Duration {
        self.decision
            .retry_after()
            .filter(|retry| !retry.is_zero())
            .unwrap_or_else(|| self.retry_after())
    }
}

/// `Retry-After` and the rate-limit headers of a `429` for `limited`,
/// into `headers`.
pub(crate) fn limited_headers(
    limited: &Limited<'_>,
    format: HeaderFormat,
    headers: &mut HeaderMap,
) {
    let retry_after = limited.retry_after_seconds;
    headers.insert(RETRY_AFTER, number_value(retry_after));
    RateHeaders::new(
        limited.checks,
        limited.decisions,
        limited.denied,
        Some(retry_after),
        None,
        format,
    )
    .write(headers);
}

/// `429 Too Many Requests` for `limited`, whose limits (the client's
/// tier's, if it has one) the body reports.
pub(crate) fn too_many_requests(limited: &Limited<'_>, format: HeaderFormat) -> Response<Bytes> {
    let retry_value = number_value(limited.retry_after_seconds);
    let body = match limited.body {
        Some(template) => template.render(&retry_value),
        None => TooManyBody::new(&limited.checks[limited.denied]).render(&retry_value),
    };
    let mut response = problem_body(StatusCode::TOO_MANY_REQUESTS, body);
    limited_headers(limited, format, response.headers_mut());
    response
}
