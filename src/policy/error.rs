//! [`PolicyError`]: why a policy was refused, and the checks that refuse it.

use std::time::Duration;

use super::{Algorithm, Limits, MAX_BUCKET_PRODUCT, MAX_COUNTER_PRODUCT, MAX_LEASES, MAX_WINDOW};

/// A policy that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The name is empty, too long, or has characters other than ASCII
    /// letters, digits, `-` and `_`.
    #[error("policy name `{name}` must be 1-64 ASCII letters, digits, `-` or `_`")]
    InvalidName {
        /// The offending name.
        name: String,
    },
    /// The name is the one refused credentials are counted under (see
    /// [`CredentialFailures`](crate::layer::CredentialFailures)).
    #[error("policy name `{name}` is reserved for counting refused credentials")]
    ReservedName {
        /// The reserved name.
        name: String,
    },
    /// A policy counts otherwise than the policy of its name in another
    /// layer on the same store and namespace
    /// ([`PoliciesHandle::replace`](crate::PoliciesHandle::replace)): the
    /// two would share counts under two limits.
    #[error(
        "policy `{name}` counts as {theirs} in another layer on this store, and would count as \
         {ours} here: the two would share counts; give one layer a namespace \
         (RateLimitLayer::with_namespace, config `limiter.namespace`) or the policies distinct \
         names"
    )]
    SharedName {
        /// The name the two layers share.
        name: String,
        /// How the policy counts here.
        ours: String,
        /// How it counts in the other layer.
        theirs: String,
    },
    /// Two policies share a name, and so would share store keys.
    #[error("policy name `{name}` is used twice")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// A message rate that cannot be counted (see
    /// [`MessageRate`](crate::policy::MessageRate)).
    #[error("policy `{name}`: messages: {reason}")]
    InvalidMessages {
        /// The policy.
        name: String,
        /// What is wrong with the rate.
        reason: String,
    },
    /// A limit of zero admits nothing.
    #[error("policy `{name}`: limit must be at least 1")]
    ZeroLimit {
        /// The policy.
        name: String,
    },
    /// The window is shorter than a millisecond.
    #[error("policy `{name}`: window must be at least 1ms")]
    WindowTooShort {
        /// The policy.
        name: String,
    },
    /// The window is longer than 366 days.
    #[error("policy `{name}`: window must be at most 366 days")]
    WindowTooLong {
        /// The policy.
        name: String,
    },
    /// A request must cost at least one unit.
    #[error("policy `{name}`: cost must be at least 1")]
    ZeroCost {
        /// The policy.
        name: String,
    },
    /// A request costing more than the limit could never be admitted.
    #[error(
        "policy `{name}`: cost {cost} is above the limit {limit}, so no request could ever be admitted"
    )]
    CostAboveLimit {
        /// The policy.
        name: String,
        /// Its cost.
        cost: u32,
        /// Its limit.
        limit: u32,
    },
    /// A sliding-counter window is not a whole number of milliseconds.
    #[error("policy `{name}`: a sliding_counter window must be whole milliseconds")]
    CounterWindowNotWholeMillis {
        /// The policy.
        name: String,
    },
    /// A sliding counter's `limit × window in ms` is 2^51 or more, past
    /// which its arithmetic would not be exact in Redis.
    #[error(
        "policy `{name}`: limit × window (in ms) must be below 2^51 for sliding_counter; \
         use a shorter window, a lower limit, or sliding_log"
    )]
    CounterTooLarge {
        /// The policy.
        name: String,
    },
    /// A token bucket of zero units admits nothing.
    #[error("policy `{name}`: burst must be at least 1")]
    ZeroBurst {
        /// The policy.
        name: String,
    },
    /// A burst was set on a policy that is not a token bucket.
    #[error("policy `{name}`: burst applies to the token_bucket algorithm only")]
    BurstWithoutBucket {
        /// The policy.
        name: String,
    },
    /// A token bucket's `burst × window in µs` is 2^52 or more, past
    /// which its arithmetic would not be exact in Redis.
    #[error(
        "policy `{name}`: burst × window (in µs) must be below 2^52 for token_bucket; \
         state the same rate over a shorter window (a tenth of the limit per a tenth \
         of the window), or use a smaller burst"
    )]
    BucketTooLarge {
        /// The policy.
        name: String,
    },
    /// A block shorter than a millisecond or longer than 366 days.
    #[error("policy `{name}`: block must be between 1ms and 366 days")]
    InvalidBlock {
        /// The policy.
        name: String,
    },
    /// A delay longer than 60 s.
    #[error("policy `{name}`: delay must be at most 60s")]
    DelayTooLong {
        /// The policy.
        name: String,
    },
    /// A concurrency limit above 4,096 requests in flight per client. Each
    /// lease is a member of one Redis key per client, which Redis frees in
    /// its main thread when it expires: a key of more members would hold
    /// Redis for over a millisecond.
    #[error("policy `{name}`: a concurrency limit must be at most 4096 in flight")]
    TooManyLeases {
        /// The policy.
        name: String,
    },
    /// A concurrency limit with a delay or a block, which it does not take.
    #[error("policy `{name}`: a concurrency limit takes neither delay nor block")]
    ConcurrencyWithDelayOrBlock {
        /// The policy.
        name: String,
    },
    /// A policy settled after the response that limits concurrency, or
    /// counts some responses only.
    #[error(
        "policy `{name}`: a cost settled after the response needs a rate limit that counts every response"
    )]
    SettledWithoutRate {
        /// The policy.
        name: String,
    },
    /// A policy settled after the response lets a client hold no
    /// reservation at all (`max_unsettled` 0).
    #[error("policy `{name}`: max_unsettled must be at least 1")]
    ZeroMaxUnsettled {
        /// The policy.
        name: String,
    },
    /// A slice ([`Policy::with_slice`](crate::Policy::with_slice)) of
    /// fewer than 2 units, or of more than the policy's limit (its burst,
    /// for a token bucket).
    #[error("policy `{name}`: slice must be from 2 to the limit ({limit}), not {slice}")]
    InvalidSlice {
        /// The policy.
        name: String,
        /// The slice asked for.
        slice: u32,
        /// The most it may be.
        limit: u32,
    },
    /// A slice on a policy whose decisions cannot be answered from units
    /// taken ahead: a concurrency limit, a delay, a block, a calendar
    /// quota, or a cost settled after the response.
    #[error(
        "policy `{name}`: a slice does not combine with {other}; drop the slice or the {other}"
    )]
    SliceWith {
        /// The policy.
        name: String,
        /// What the slice does not combine with: `concurrency`, `delay`,
        /// `block`, `calendar` or `settled`.
        other: &'static str,
    },
    /// A calendar's offset from UTC is a day or more, or not whole
    /// minutes.
    #[error("policy `{name}`: utc_offset must be under 24 hours, in whole minutes")]
    InvalidUtcOffset {
        /// The policy.
        name: String,
    },
    /// A calendar quota with a delay: its requests wait for the next
    /// period, past any delay.
    #[error("policy `{name}`: a calendar quota takes no delay")]
    CalendarWithDelay {
        /// The policy.
        name: String,
    },
    /// A tier of a calendar quota with a window of its own: its periods
    /// are the calendar's.
    #[error("policy `{name}`: a calendar quota's tiers take no window")]
    CalendarWithWindow {
        /// The policy.
        name: String,
    },
    /// The route is not `"METHOD /pattern"` or `"/pattern"`.
    #[error("route `{route}` must be \"METHOD /pattern\" or \"/pattern\"")]
    InvalidRoute {
        /// The offending route text.
        route: String,
    },
    /// The route names a method HTTP does not define (a typo such as `GTE`
    /// would leave it never limited) and that the policies do not allow as
    /// an extension method.
    #[error(
        "route `{route}`: `{method}` is not a standard HTTP method, so no request would ever \
         match it; allow an extension method the service really routes explicitly \
         (`PoliciesBuilder::with_extension_method`, config `limiter.extension_methods`)"
    )]
    UnknownMethod {
        /// The offending route.
        route: String,
        /// The method it names.
        method: String,
    },
    /// The route's pattern is not one axum's router accepts beside the
    /// others (a bad `{param}`, or two patterns that conflict).
    #[error("route `{route}`: {reason}")]
    InvalidPattern {
        /// The offending route.
        route: String,
        /// What the router said.
        reason: String,
    },
}

impl PolicyError {
    /// The setting at fault: `name`, `limit`, `window`, `cost` or `route`
    /// (for a tier's override, the tier's setting of that name).
    ///
    /// ```
    /// use slidegate::{Policies, Policy};
    /// use std::time::Duration;
    ///
    /// let error = Policies::single(Policy::new("p", 5, Duration::from_secs(60)).with_cost(6)).unwrap_err();
    /// assert_eq!(error.field(), "cost");
    /// ```
    pub fn field(&self) -> &'static str {
        match self {
            Self::InvalidName { .. }
            | Self::ReservedName { .. }
            | Self::DuplicateName { .. }
            | Self::SharedName { .. } => "name",
            Self::ZeroLimit { .. } => "limit",
            Self::WindowTooShort { .. }
            | Self::WindowTooLong { .. }
            | Self::CounterWindowNotWholeMillis { .. }
            | Self::CounterTooLarge { .. } => "window",
            Self::ZeroCost { .. } | Self::CostAboveLimit { .. } => "cost",
            Self::ZeroBurst { .. }
            | Self::BurstWithoutBucket { .. }
            | Self::BucketTooLarge { .. } => "burst",
            Self::InvalidBlock { .. } => "block",
            Self::DelayTooLong { .. } => "delay",
            Self::ConcurrencyWithDelayOrBlock { .. } | Self::TooManyLeases { .. } => "concurrency",
            Self::InvalidUtcOffset { .. } => "utc_offset",
            Self::SettledWithoutRate { .. } => "settled",
            Self::ZeroMaxUnsettled { .. } => "max_unsettled",
            Self::InvalidSlice { .. } | Self::SliceWith { .. } => "slice",
            Self::InvalidMessages { .. } => "messages",
            Self::CalendarWithDelay { .. } | Self::CalendarWithWindow { .. } => "calendar",
            Self::InvalidRoute { .. }
            | Self::InvalidPattern { .. }
            | Self::UnknownMethod { .. } => "route",
        }
    }
}

pub(super) fn validate_limits(
    name: String,
    limits: Limits,
    algorithm: Algorithm,
) -> Result<(), PolicyError> {
    validate_counts(|| name.clone(), limits, algorithm)?;
    if limits.cost == 0 {
        return Err(PolicyError::ZeroCost { name });
    }
    if limits.cost > limits.burst {
        return Err(PolicyError::CostAboveLimit {
            name,
            cost: limits.cost,
            limit: limits.burst,
        });
    }
    Ok(())
}

/// What every limit a client can be given must pass, whatever it costs:
/// a limit, window and burst that both stores count exactly; `name` names
/// the limits in an error.
pub(super) fn validate_counts(
    name: impl Fn() -> String,
    limits: Limits,
    algorithm: Algorithm,
) -> Result<(), PolicyError> {
    if limits.limit == 0 {
        return Err(PolicyError::ZeroLimit { name: name() });
    }
    if limits.window < Duration::from_millis(1) {
        return Err(PolicyError::WindowTooShort { name: name() });
    }
    if limits.window > MAX_WINDOW {
        return Err(PolicyError::WindowTooLong { name: name() });
    }
    if limits.burst == 0 {
        return Err(PolicyError::ZeroBurst { name: name() });
    }
    if algorithm == Algorithm::Concurrency && limits.limit > MAX_LEASES {
        return Err(PolicyError::TooManyLeases { name: name() });
    }
    if algorithm == Algorithm::TokenBucket
        && u128::from(limits.burst) * limits.window.as_micros() >= MAX_BUCKET_PRODUCT
    {
        return Err(PolicyError::BucketTooLarge { name: name() });
    }
    if algorithm == Algorithm::SlidingCounter {
        let window_ms = limits.window.as_millis();
        if !limits.window.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(PolicyError::CounterWindowNotWholeMillis { name: name() });
        }
        if u128::from(limits.limit) * window_ms >= MAX_COUNTER_PRODUCT {
            return Err(PolicyError::CounterTooLarge { name: name() });
        }
    }
    Ok(())
}
