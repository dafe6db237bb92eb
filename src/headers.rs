//! The rate-limit headers: which are sent ([`HeaderStyle`]), how their
//! reset time is written ([`ResetFormat`]), and their names: `X-RateLimit-*`,
//! and the IETF `RateLimit` and `RateLimit-Policy` fields.
//!
//! By default an answer carries `X-RateLimit-Limit`, `X-RateLimit-Remaining`
//! and `X-RateLimit-Reset`, the seconds until capacity next grows (a Unix
//! timestamp with [`with_reset_format`]`(`[`ResetFormat::UnixSeconds`]`)`,
//! config `reset = "unix"`), and a denial `Retry-After` too; the table
//! below says which answers carry what.
//!
//! # What each answer carries
//!
//! The statuses and bodies of the limiter's own answers are in the
//! [`rejection`](crate::rejection) module.
//!
//! | case | headers |
//! |---|---|
//! | admitted (the handler's answer) | `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` |
//! | admitted under a policy settled after the response | the rate-limit headers counting the reservation (`cost`); the settled cost shows from the next request |
//! | over the limit, but fits within the policy's `delay`: held meanwhile (in the slot the store granted it), then passed to the handler once it fits | as admitted, as of when it passes |
//! | over the limit (`429`) | `Retry-After` (seconds, rounded up, at least 1) and the three `X-RateLimit-*` |
//! | over the limit beyond the policy's `delay`, or within it with `max_delayed = 0` (`429`) | as over the limit |
//! | over a concurrency limit (`429`); a WebSocket (or other upgrade) over one, while the client's others are open (`429` instead of `101`) | `Retry-After: 1` |
//! | over a calendar quota (`429`) | `Retry-After` and `X-RateLimit-Reset`: to the next period boundary |
//! | blocked after a denial (`block`; `429` whatever the count) | `Retry-After` (the time left of the block), `X-RateLimit-Remaining: 0` |
//! | denied after a settlement past the limit, an overdraft (`429`) | `Retry-After` until enough of the overdraft leaves the window, `X-RateLimit-Remaining: 0` (never negative) |
//! | credentials from an address past its limit of refused credentials (`429`) | `Retry-After` and the rate-limit headers of `credential_failures` |
//! | a per-request cost above the client's limit (`422`) | none: retrying cannot help |
//! | token present but invalid (`401`) | `WWW-Authenticate: Bearer error="invalid_token"` |
//! | unknown API key, with `unknown_api_key = "reject"` (`401`) | `WWW-Authenticate: ApiKey header="x-api-key"` |
//! | no credentials, and every key source needs them (`401`); no key source identifies the client otherwise (`500`) | none |
//! | fits within the `delay`, but the layer's places are all taken (`503`) | `Retry-After`: the wait it would have had |
//! | store down, policy fails closed (`503`) | `Retry-After: 1` |
//! | store down, policy fails open (the handler's answer) | none (a warning is traced) |
//! | store down, policy fails to a local limit (`fail = "local"`) | the rate-limit headers of the local share |
//! | exempt ([`RateLimitLayer::with_exemption`](crate::RateLimitLayer::with_exemption), config `exempt`, `exempt_api_keys`; the handler's answer) | none; nothing is counted |
//! | any of the above, for a gRPC call | the headers above, and `grpc-retry-pushback-ms` (`-1` for `422`, `1000` for `503`) |
//!
//! # Which policy they describe
//!
//! When several policies apply, the `X-RateLimit-*` headers of an admitted
//! request describe the one closest to denying: the one that leaves the
//! fewest requests of this request's cost (units left ÷ cost), and of
//! those the one that resets last, since a client that waits for an
//! earlier reset is still refused by the other. A completion that costs
//! 3,000 of 10,000 tokens an hour, beside 600 requests an hour, shows the
//! tokens (`X-RateLimit-Remaining: 7000` of `10000`: two more calls), not
//! the 599 requests. A `429` describes the policy that frees last.
//!
//! # IETF fields
//!
//! [`HeaderStyle::Ietf`] (set with
//! [`with_header_style`](crate::RateLimitLayer::with_header_style), config
//! `headers = "ietf"`) sends the fields of
//! draft-ietf-httpapi-ratelimit-headers-10 instead, one item per policy
//! that applied: `RateLimit-Policy: "search";q=5;w=60` (quota and window
//! seconds) and `RateLimit: "search";r=4;t=58` (remaining and seconds until
//! capacity grows). On a `429` no `t` is later than `Retry-After`.
//! [`HeaderStyle::Both`] sends both sets; [`HeaderStyle::None`] neither.
//!
//! [`with_reset_format`]: crate::RateLimitLayer::with_reset_format

use std::fmt::Write as _;
use std::sync::LazyLock;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::policy::terms::{ceil_seconds, policy_value, quota};
use crate::store::{Check, Decision};

/// `X-RateLimit-Limit`: units allowed per window.
pub(crate) const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: units left in the window.
pub(crate) const X_RATELIMIT_REMAINING: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`: when capacity next grows.
pub(crate) const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// `RateLimit-Policy`: the quota policies that applied (IETF httpapi draft).
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: what is left of each quota policy (IETF httpapi draft).
pub(crate) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Which rate-limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`,
    /// for the policy closest to denying (see [Which policy they
    /// describe](self#which-policy-they-describe); on a 429, the one that
    /// denied).
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

/// `RateLimit` for `checks` and their `decisions`:
/// `"name";r=remaining;t=seconds` each, `t` at most `retry_after`.
fn state_value(
    checks: &[Check],
    decisions: &[Decision],
    retry_after: Option<u64>,
) -> Option<HeaderValue> {
    let mut text = String::new();
    for (check, decision) in checks.iter().zip(decisions) {
        let separator = if text.is_empty() { "" } else { ", " };
        let t = ceil_seconds(decision.reset());
        let t = retry_after.map_or(t, |cap| t.min(cap));
        let remaining = decision.remaining();
        let _ = write!(
            text,
            "{separator}\"{}\";r={remaining};t={t}",
            check.policy()
        );
    }
    HeaderValue::try_from(text).ok()
}

/// How the rate-limit headers of an answer are written: which fields,
/// and how a reset is given.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HeaderFormat {
    pub(crate) style: HeaderStyle,
    pub(crate) reset: ResetFormat,
}

impl RateHeaders {
    /// The headers for a request whose checks got `decisions`: the
    /// `X-RateLimit-*` trio from the decision at `reported`, the IETF fields
    /// from all of them (`RateLimit-Policy` is `policy` when the plan has
    /// it ready). On a 429, `retry_after` caps every `t`, so that no `t`
    /// promises capacity later than `Retry-After` does.
    pub(crate) fn new(
        checks: &[Check],
        decisions: &[Decision],
        reported: usize,
        retry_after: Option<u64>,
        policy: Option<&HeaderValue>,
        format: HeaderFormat,
    ) -> Self {
        let mut fields = Self::default();
        if format.style.x_ratelimit() {
            let decision = &decisions[reported];
            let reset = match format.reset {
                ResetFormat::DeltaSeconds => ceil_seconds(decision.reset()),
                ResetFormat::UnixSeconds => {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default();
                    ceil_seconds(now + decision.reset())
                }
            };
            fields.x_ratelimit =
                Some([decision.limit().into(), decision.remaining().into(), reset]);
        }
        if format.style.ietf() {
            let policy = policy.cloned().or_else(|| {
                policy_value(checks.iter().map(|c| {
                    let quota = quota(c.algorithm(), c.limit(), c.window(), c.burst);
                    (&**c.policy(), quota)
                }))
            });
            let state = state_value(checks, decisions, retry_after);
            if let (Some(policy), Some(state)) = (policy, state) {
                fields.ietf = Some(Box::new([policy, state]));
            }
        }
        fields
    }

    /// The headers of an admitted request: the `X-RateLimit-*` trio from
    /// the decision at `reported`, the one [closest to
    /// denying](crate::store::closest_to_denying).
    pub(crate) fn admitted(
        checks: &[Check],
        decisions: &[Decision],
        reported: usize,
        policy: Option<&HeaderValue>,
        format: HeaderFormat,
    ) -> Self {
        Self::new(checks, decisions, reported, None, policy, format)
    }

    /// Whether no field is sent ([`HeaderStyle::None`]).
    pub(crate) fn is_empty(&self) -> bool {
        self.x_ratelimit.is_none() && self.ietf.is_none()
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
