//! [`Terms`]: what a policy's check carries for a client of one tier,
//! worked out once when the policies are built; and the policy's
//! `RateLimit-Policy` entry, written from them.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use super::{Algorithm, Limits, Policy};
use crate::clock::duration_micros;

/// What a policy's check carries for a client of one tier, whoever the
/// client is.
///
/// Two terms are equal when a count kept under one is kept under the
/// other: everything but the tier's cost, which only prices a request.
#[derive(Debug, Clone)]
pub(crate) struct Terms {
    pub(crate) policy: Arc<str>,
    pub(crate) algorithm: Algorithm,
    /// The tier's limit, window, cost and burst.
    pub(crate) limits: Limits,
    pub(crate) block_micros: u64,
    pub(crate) delay_micros: u64,
    pub(crate) span_micros: u64,
    /// The policy's slice, 0 for none.
    pub(crate) slice: u32,
}

impl PartialEq for Terms {
    fn eq(&self, other: &Self) -> bool {
        let (ours, theirs) = (&self.limits, &other.limits);
        self.policy == other.policy
            && self.algorithm == other.algorithm
            && (ours.limit, ours.window, ours.burst) == (theirs.limit, theirs.window, theirs.burst)
            && (self.block_micros, self.delay_micros, self.span_micros)
                == (other.block_micros, other.delay_micros, other.span_micros)
            && self.slice == other.slice
    }
}

impl Eq for Terms {}

impl Terms {
    /// The terms of `policy` for clients of `tier`.
    pub(crate) fn of(policy: &Policy, tier: Option<&str>) -> Self {
        Self::with_limits(policy, policy.limits_for(tier))
    }

    /// The terms of `policy` at `limits`.
    pub(crate) fn with_limits(policy: &Policy, limits: Limits) -> Self {
        Self {
            policy: policy.shared_name().clone(),
            algorithm: policy.algorithm(),
            limits,
            block_micros: duration_micros(policy.block().unwrap_or_default()),
            delay_micros: duration_micros(policy.delay().unwrap_or_default()),
            span_micros: duration_micros(policy.longest_window().max(limits.window)),
            slice: policy.slice().unwrap_or(0),
        }
    }
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_seconds(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

/// A policy's quota as `RateLimit-Policy` states it: `q` units per `w`.
/// A sliding window's is its limit per window; a token bucket's, its
/// burst per the time it takes to refill from empty; a concurrency
/// limit's, the requests in flight, with no window.
pub(crate) fn quota(
    algorithm: Algorithm,
    limit: u32,
    window: Duration,
    burst: u32,
) -> (u32, Option<Duration>) {
    match algorithm {
        Algorithm::TokenBucket => {
            let micros =
                (u128::from(burst) * window.as_micros()).div_ceil(u128::from(limit.max(1)));
            let refill = Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX));
            (burst, Some(refill))
        }
        Algorithm::Concurrency => (limit, None),
        _ => (limit, Some(window)),
    }
}

/// `RateLimit-Policy` for `policies`, each a name and its [`quota`]:
/// `"name";q=limit;w=seconds`. Policy names are ASCII letters, digits, `-`
/// and `_`: valid in a structured-field string as they are.
pub(crate) fn policy_value<'a>(
    policies: impl IntoIterator<Item = (&'a str, (u32, Option<Duration>))>,
) -> Option<HeaderValue> {
    let mut text = String::new();
    for (name, (quota, window)) in policies {
        let separator = if text.is_empty() { "" } else { ", " };
        let _ = write!(text, "{separator}\"{name}\";q={quota}");
        if let Some(window) = window {
            let _ = write!(text, ";w={}", ceil_seconds(window));
        }
    }
    HeaderValue::try_from(text).ok()
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
