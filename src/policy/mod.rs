//! Policies: how much a client may spend, on which routes, and what happens
//! when the store cannot answer.
//!
//! A [`Policy`] is a limit per window with its algorithm, cost, fail mode
//! and per-tier overrides ([`TierLimits`]); [`Policies`] is the validated
//! set of a layer, each policy on a [`Route`] or on every route; a
//! [`RequestCost`] computes a request's [`Cost`] from its head.

mod calendar;
pub(crate) mod cost;
pub(crate) mod plan;
mod route;
mod table;

pub use calendar::{Calendar, Period};
pub use cost::{Cost, RequestCost};
pub use route::Route;
pub use table::{Policies, PoliciesBuilder};

use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;

/// The counting algorithm of a [`Policy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// An exact log of admitted requests: one entry per request, each with its
    /// cost, pruned as it leaves the window.
    #[default]
    SlidingLog,
    /// Two epoch-aligned fixed-window counters, the previous weighted by its
    /// overlap with the sliding window: constant memory per client, for very
    /// high limits and millions of clients, at a small approximation.
    /// Windows are whole milliseconds, and `limit × window in ms` must stay
    /// below 2^51 so the arithmetic is exact.
    SlidingCounter,
    /// One epoch-aligned fixed-window counter: the cheapest, but a client
    /// can spend up to twice the limit across a window boundary.
    FixedWindow,
    /// A token bucket (GCRA, one timestamp per client): a steady rate of
    /// `limit` units per `window`, with a bucket of
    /// [burst](Policy::with_burst) units (default: the limit) that a
    /// client may spend at once. Exact for its model; `burst × window in
    /// µs` must stay below 2^52 so the arithmetic is exact in Redis.
    /// Decisions report the burst as their limit.
    TokenBucket,
    /// At most `limit` requests of a client in flight at once (see
    /// [`Policy::concurrency`]): a request holds a lease from admission
    /// until its response body ends or is dropped, and a lease expires
    /// after the policy's window, its lease time.
    Concurrency,
    /// A count per calendar period (see [`Policy::calendar`]): exact,
    /// one number per client, starting again at each boundary.
    Calendar(Calendar),
}

/// The largest `limit × window in ms` of a [`Algorithm::SlidingCounter`]
/// policy: products stay exact in Redis's Lua numbers (doubles).
const MAX_COUNTER_PRODUCT: u128 = 1 << 51;

/// The largest `burst × window in µs` of a [`Algorithm::TokenBucket`]
/// policy: a bucket's debt stays exact in Redis's Lua numbers.
const MAX_BUCKET_PRODUCT: u128 = 1 << 52;

/// The most leases a [`Algorithm::Concurrency`] policy may hold per
/// client: each is a member of the client's one sorted set in Redis, and
/// a larger set would hold Redis for over a millisecond as it frees it
/// (when it expires, whatever `lazyfree-lazy-expire` says).
const MAX_LEASES: u32 = 4096;

/// The lease time of a [`Policy::concurrency`] policy unless set.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The name under which a layer counts refused credentials; no policy
/// may take it.
pub(crate) const CREDENTIAL_FAILURES: &str = "credential_failures";

/// The longest window a policy may have: 366 days (a humantime `1y` is
/// 365.25 days). Time arithmetic stays exact in Redis's Lua numbers well
/// past it; no [`Check`](crate::store::Check) can be built with a longer
/// one.
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 86_400);

/// What a policy does when the store fails or times out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailMode {
    /// Let the request through and trace a warning.
    #[default]
    Open,
    /// Answer `503 Service Unavailable`: the limiter, not the client, is the
    /// problem.
    Closed,
    /// Enforce the policy in this process instead, on an in-memory store, at
    /// its limit divided by the number of instances
    /// ([`RateLimitLayer::with_local_share`](crate::RateLimitLayer::with_local_share)),
    /// until the store answers again.
    Local,
}

/// Which requests a policy counts, by their response.
///
/// Every request is counted when it is admitted, so a burst can never pass
/// the limit; once its response shows that it should not count, its units
/// are taken back ([`Store::refund`](crate::store::Store::refund)). A request
/// whose response never comes (the client went away) stays counted.
///
/// A gRPC call (`content-type: application/grpc`) fails by its
/// `grpc-status`, not its HTTP status (`200` either way): read from the
/// response head when the call ended at once, from the trailers otherwise;
/// a call whose body is not sent to its trailers stays counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Count {
    /// Every admitted request.
    #[default]
    All,
    /// Requests answered with a status of 400 or above (a gRPC status but
    /// `OK`), or failing in the service: failed logins, say.
    Failures,
    /// Requests answered with a status below 400 (gRPC calls ending `OK`).
    Successes,
}

impl Count {
    /// Whether a request whose response `failed` (or the service did)
    /// counts.
    pub(crate) fn counts(self, failed: bool) -> bool {
        match self {
            Self::All => true,
            Self::Failures => failed,
            Self::Successes => !failed,
        }
    }
}

/// Per-tier overrides of a [`Policy`]'s limit, window and cost; what is not
/// set keeps the policy's base value.
///
/// ```
/// use slidegate::policy::TierLimits;
/// use std::time::Duration;
///
/// let pro = TierLimits::new().with_limit(50).with_window(Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierLimits {
    limit: Option<u32>,
    window: Option<Duration>,
    cost: Option<u32>,
    burst: Option<u32>,
}

impl TierLimits {
    /// No overrides yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Overrides the limit.
    #[must_use]
    pub fn with_limit(mut self, limit: u32) -> Self {
        self.limit = Some(limit);
        self
    }

    /// Overrides the window.
    #[must_use]
    pub fn with_window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    /// Overrides the cost of one request.
    #[must_use]
    pub fn with_cost(mut self, cost: u32) -> Self {
        self.cost = Some(cost);
        self
    }

    /// Overrides the bucket size of a [`Algorithm::TokenBucket`] policy.
    #[must_use]
    pub fn with_burst(mut self, burst: u32) -> Self {
        self.burst = Some(burst);
        self
    }
}

/// The limit, window and cost in force for one request: a policy's base
/// values, or its overrides for the client's tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Units allowed per window.
    pub limit: u32,
    /// The sliding window.
    pub window: Duration,
    /// Units one request consumes.
    pub cost: u32,
    /// The units a client may spend at once: a token bucket's size, the
    /// limit for every other algorithm. No cost may exceed it.
    pub burst: u32,
}

/// One limit: at most `limit` units of cost per sliding `window`.
///
/// ```
/// use slidegate::{Policy, policy::FailMode};
/// use std::time::Duration;
///
/// let login = Policy::new("login", 5, Duration::from_secs(60))
///     .with_cost(1)
///     .with_fail_mode(FailMode::Closed);
/// assert_eq!(login.limit(), 5);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    name: Arc<str>,
    limit: u32,
    window: Duration,
    algorithm: Algorithm,
    cost: u32,
    fail_mode: Option<FailMode>,
    count: Count,
    shadow: bool,
    tiers: Vec<(Arc<str>, TierLimits)>,
    burst: Option<u32>,
    block: Option<Duration>,
    delay: Option<Duration>,
    settlement: Option<Settlement>,
}

/// How a policy settled after the response learns a request's real cost
/// (see [`Policy::settled_after_response`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settlement {
    /// The response header or trailer holding it, if the policy names one.
    pub(crate) header: Option<HeaderName>,
    /// The most reservations a client holds at once, unsettled.
    pub(crate) max_unsettled: u32,
}

impl Default for Settlement {
    fn default() -> Self {
        Self {
            header: None,
            max_unsettled: DEFAULT_MAX_UNSETTLED,
        }
    }
}

/// The most reservations of a policy settled after the response that a
/// client holds at once, unless set (see [`Policy::with_max_unsettled`]).
pub const DEFAULT_MAX_UNSETTLED: u32 = 8;

impl Policy {
    /// A policy named `name` allowing `limit` units per `window`, at a cost
    /// of one unit per request. The name is part of every store key, so it
    /// must be unique among the layer's policies and made of ASCII letters,
    /// digits, `-` and `_`.
    pub fn new(name: impl Into<Arc<str>>, limit: u32, window: Duration) -> Self {
        Self {
            name: name.into(),
            limit,
            window,
            algorithm: Algorithm::default(),
            cost: 1,
            fail_mode: None,
            count: Count::All,
            shadow: false,
            tiers: Vec::new(),
            burst: None,
            block: None,
            delay: None,
            settlement: None,
        }
    }

    /// A policy named `name` allowing at most `in_flight` requests of a
    /// client at once ([`Algorithm::Concurrency`]). A request holds a lease
    /// from its admission until its response body has been sent to the
    /// end, or the response or body is dropped (the client went away, the
    /// handler panicked). A lease expires after [`DEFAULT_LEASE`] (see
    /// [`with_lease`](Self::with_lease)), so the leases of an instance
    /// that died are gone within it. Over the limit a request is answered
    /// `429` with `Retry-After: 1`. `in_flight` is at most 4,096 per
    /// client (see [`PolicyError::TooManyLeases`]).
    ///
    /// ```
    /// use slidegate::{Policy, policy::Algorithm};
    ///
    /// let exports = Policy::concurrency("exports", 2);
    /// assert_eq!((exports.algorithm(), exports.limit()), (Algorithm::Concurrency, 2));
    /// ```
    pub fn concurrency(name: impl Into<Arc<str>>, in_flight: u32) -> Self {
        Self::new(name, in_flight, DEFAULT_LEASE).with_algorithm(Algorithm::Concurrency)
    }

    /// A policy named `name` allowing `limit` units per calendar period
    /// ([`Algorithm::Calendar`]): "10,000 calls a month, from the 1st".
    /// The count starts again at each boundary of `calendar`'s periods,
    /// and a denied request waits for the next one. Its window, as shown
    /// in `429` bodies, is the period's nominal length. A calendar quota
    /// takes no delay, and its tiers no window of their own.
    ///
    /// ```
    /// use slidegate::Policy;
    /// use slidegate::policy::{Algorithm, Calendar, Period};
    ///
    /// let monthly = Policy::calendar("monthly", 10_000, Calendar::new(Period::Month));
    /// assert_eq!(monthly.algorithm(), Algorithm::Calendar(Calendar::new(Period::Month)));
    /// ```
    pub fn calendar(name: impl Into<Arc<str>>, limit: u32, calendar: Calendar) -> Self {
        Self::new(name, limit, calendar.nominal_window())
            .with_algorithm(Algorithm::Calendar(calendar))
    }

    /// Sets how long a [`concurrency`](Self::concurrency) lease lasts at
    /// most (default 30 s): longer than your slowest response, since a
    /// request that outlives its lease no longer counts.
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// let exports = Policy::concurrency("exports", 2).with_lease(Duration::from_secs(120));
    /// assert_eq!(exports.window(), Duration::from_secs(120));
    /// ```
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.window = lease;
        self
    }

    /// Sets the bucket size of a [`Algorithm::TokenBucket`] policy: the
    /// units a client may spend at once, refilled at `limit` per `window`
    /// (default: the limit). Refused for other algorithms.
    ///
    /// ```
    /// use slidegate::{Policy, policy::Algorithm};
    /// use std::time::Duration;
    ///
    /// // 10 a second on average, up to 50 at once.
    /// let api = Policy::new("api", 10, Duration::from_secs(1))
    ///     .with_algorithm(Algorithm::TokenBucket)
    ///     .with_burst(50);
    /// assert_eq!(api.limits_for(None).burst, 50);
    /// ```
    #[must_use]
    pub fn with_burst(mut self, burst: u32) -> Self {
        self.burst = Some(burst);
        self
    }

    /// Blocks a client once this policy denies it: every request of the
    /// client under this policy is denied for `block` from that denial
    /// (`429` with `Retry-After` the time left), whatever its count. The
    /// block is held in the store, so every instance agrees, and the deny
    /// cache answers it locally.
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// // Five failed logins a minute; past that, ten minutes out.
    /// let login = Policy::new("login", 5, Duration::from_secs(60))
    ///     .with_block(Duration::from_secs(600));
    /// assert_eq!(login.block(), Some(Duration::from_secs(600)));
    /// ```
    #[must_use]
    pub fn with_block(mut self, block: Duration) -> Self {
        self.block = Some(block);
        self
    }

    /// Holds a request this policy would deny when it would fit within
    /// `delay`, and admits it then, instead of answering `429`: for
    /// clients that cannot retry. The request is counted when it is
    /// admitted, so no window ever holds more than the limit; a client
    /// that goes away while held frees its place, and the requests held
    /// at once per process are bounded.
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// let search = Policy::new("search", 5, Duration::from_secs(1))
    ///     .with_delay(Duration::from_millis(500));
    /// assert_eq!(search.delay(), Some(Duration::from_millis(500)));
    /// ```
    #[must_use]
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }

    /// Overrides the limit, window or cost for clients of `tier` (from a
    /// JWT claim or an API-key table). Clients of other tiers, or of none,
    /// get the base values.
    ///
    /// ```
    /// use slidegate::{Policy, policy::TierLimits};
    /// use std::time::Duration;
    ///
    /// let search = Policy::new("search", 5, Duration::from_secs(60))
    ///     .with_tier("pro", TierLimits::new().with_limit(50));
    /// assert_eq!(search.limits_for(Some("pro")).limit, 50);
    /// assert_eq!(search.limits_for(Some("gold")).limit, 5);
    /// assert_eq!(search.limits_for(None).limit, 5);
    /// ```
    #[must_use]
    pub fn with_tier(mut self, tier: impl Into<Arc<str>>, limits: TierLimits) -> Self {
        let tier = tier.into();
        self.tiers.retain(|(name, _)| *name != tier);
        self.tiers.push((tier, limits));
        self
    }

    /// Whether `other` counts as this policy does in a store: the same
    /// algorithm, limit, window, burst, block and tiers. Its cost, fail
    /// mode, shadowing, delay and which responses count may differ.
    pub(crate) fn counts_as(&self, other: &Self) -> bool {
        self.algorithm == other.algorithm
            && self.limit == other.limit
            && self.window == other.window
            && self.burst == other.burst
            && self.block == other.block
            && self.tiers == other.tiers
    }

    /// What the policy counts, in a few words: `10 per 1m (SlidingLog)`.
    pub(crate) fn describe(&self) -> String {
        match self.algorithm {
            Algorithm::Concurrency => format!("{} in flight (Concurrency)", self.limit),
            Algorithm::Calendar(calendar) => {
                format!("{} per {} (Calendar)", self.limit, calendar.period().name())
            }
            algorithm => format!(
                "{} per {} ({algorithm:?})",
                self.limit,
                humantime::format_duration(self.window)
            ),
        }
    }

    /// The limits in force for a client of `tier`.
    pub fn limits_for(&self, tier: Option<&str>) -> Limits {
        let overrides = tier
            .and_then(|tier| self.tiers.iter().find(|(name, _)| &**name == tier))
            .map(|(_, limits)| *limits)
            .unwrap_or_default();
        let limit = overrides.limit.unwrap_or(self.limit);
        let burst = match self.algorithm {
            Algorithm::TokenBucket => overrides.burst.or(self.burst).unwrap_or(limit),
            _ => limit,
        };
        Limits {
            limit,
            window: overrides.window.unwrap_or(self.window),
            cost: match self.algorithm {
                // A lease is one request in flight, whatever it costs.
                Algorithm::Concurrency => 1,
                _ => overrides.cost.unwrap_or(self.cost),
            },
            burst,
        }
    }

    /// Whether `limit` may be a client's own limit under this policy (an
    /// override, or a [limit lookup](crate::RateLimitLayer::with_limit_lookup)'s
    /// answer): the limits it makes with the policy and with each of its
    /// tiers pass the same validation as the policy's own, but for the
    /// cost (a cost above a client's own limit is refused per request).
    ///
    /// ```
    /// use slidegate::{Policy, policy::Algorithm};
    /// use std::time::Duration;
    ///
    /// let bucket = Policy::new("api", 10, Duration::from_secs(7200)).with_algorithm(Algorithm::TokenBucket);
    /// assert!(bucket.validate_own_limit(1_000).is_ok());
    /// // 2,562,047,789 × 7,200 s in µs is past 2^52.
    /// assert!(bucket.validate_own_limit(2_562_047_789).is_err());
    /// assert!(bucket.validate_own_limit(0).is_err());
    /// ```
    pub fn validate_own_limit(&self, limit: u32) -> Result<(), PolicyError> {
        let tiers = self.tiers.iter().map(|(tier, _)| Some(&**tier));
        for tier in std::iter::once(None).chain(tiers) {
            // Named only for an error: a kept answer is checked per request.
            let name = || match tier {
                Some(tier) => format!("{} (tier `{tier}`, a client's own limit)", self.name),
                None => format!("{} (a client's own limit)", self.name),
            };
            validate_counts(name, self.limits_with(tier, Some(limit)), self.algorithm)?;
        }
        Ok(())
    }

    /// The longest window the policy or any of its tiers counts under.
    pub(crate) fn longest_window(&self) -> Duration {
        self.tiers
            .iter()
            .filter_map(|(_, limits)| limits.window)
            .fold(self.window, Duration::max)
    }

    /// The limits in force for a client of `tier` whose own limit (from a
    /// [limit lookup](crate::RateLimitLayer::with_limit_lookup)) is `own`: it replaces
    /// the tier's limit, and a token bucket's burst too unless the policy
    /// or tier sets one.
    pub(crate) fn limits_with(&self, tier: Option<&str>, own: Option<u32>) -> Limits {
        let mut limits = self.limits_for(tier);
        if let Some(limit) = own {
            let tier_burst = tier
                .and_then(|tier| self.tiers.iter().find(|(name, _)| &**name == tier))
                .and_then(|(_, limits)| limits.burst);
            let own_burst = self.algorithm == Algorithm::TokenBucket
                && (tier_burst.is_some() || self.burst.is_some());
            if !own_burst {
                limits.burst = limit;
            }
            limits.limit = limit;
        }
        limits
    }

    /// Sets the counting algorithm. A [`Algorithm::Calendar`] sets the
    /// window to its period's nominal length, as [`calendar`](Self::calendar) does.
    ///
    /// ```
    /// use slidegate::{Policy, policy::Algorithm};
    /// use std::time::Duration;
    ///
    /// let policy = Policy::new("api", 100, Duration::from_secs(60)).with_algorithm(Algorithm::SlidingLog);
    /// assert_eq!(policy.algorithm(), Algorithm::SlidingLog);
    /// ```
    #[must_use]
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        if let Algorithm::Calendar(calendar) = algorithm {
            self.window = calendar.nominal_window();
        }
        self
    }

    /// Sets how many units one request consumes (default 1). A cost above
    /// the limit is refused when the policies are built.
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// let export = Policy::new("export", 100, Duration::from_secs(3600)).with_cost(10);
    /// assert_eq!(export.cost(), 10);
    /// ```
    #[must_use]
    pub fn with_cost(mut self, cost: u32) -> Self {
        self.cost = cost;
        self
    }

    /// Sets the fail mode; without it the layer's default applies.
    ///
    /// ```
    /// use slidegate::{Policy, policy::FailMode};
    /// use std::time::Duration;
    ///
    /// let policy = Policy::new("pay", 3, Duration::from_secs(60)).with_fail_mode(FailMode::Closed);
    /// assert_eq!(policy.fail_mode(), Some(FailMode::Closed));
    /// ```
    #[must_use]
    pub fn with_fail_mode(mut self, fail_mode: FailMode) -> Self {
        self.fail_mode = Some(fail_mode);
        self
    }

    /// Sets which requests count, by their response (default: all).
    ///
    /// ```
    /// use slidegate::{Policy, policy::Count};
    /// use std::time::Duration;
    ///
    /// // Three failed logins a minute; successful ones are not counted.
    /// let login = Policy::new("login", 3, Duration::from_secs(60)).with_count(Count::Failures);
    /// assert_eq!(login.count(), Count::Failures);
    /// ```
    #[must_use]
    pub fn with_count(mut self, count: Count) -> Self {
        self.count = count;
        self
    }

    /// Settles each request's cost after its response: the request
    /// reserves its [cost](Self::with_cost), an estimate, when it is
    /// admitted, and when its response ends (its body sent to the end,
    /// or dropped) the cost it reports replaces the reservation: the
    /// difference is given back, or charged past the limit, so a client
    /// that spent more than it reserved is denied until enough leaves the
    /// window. For LLM token budgets, say, where the tokens a response
    /// generated are known only once it is done.
    ///
    /// The handler reports the cost on the [`Usage`](crate::Usage) handle
    /// it finds in the request's extensions (a stream as it goes); what it
    /// reports past the reservation is charged as it comes (at most once a
    /// second), and the request is settled at the last value reported once
    /// its body has ended or was dropped and the handler has let go of the
    /// handle. A
    /// request that reports nothing keeps its reservation, so a client
    /// that goes away mid-stream is charged what was reported by then,
    /// else the reservation.
    ///
    /// An overdraft counts as the policy's algorithm counts units: a
    /// sliding log holds it until it leaves the window, a fixed window or
    /// a calendar quota until the window or period ends (a single charge
    /// counts at most the limit, which already denies every request that
    /// long), a sliding counter counts at most the limit of it in its
    /// current window, and a token bucket keeps the whole debt, repaid at
    /// the policy's rate. So per window a client can spend at most the
    /// limit plus what its requests admitted meanwhile spend past their
    /// reservations: reserve what a request may cost (from the request,
    /// as an LLM API's `max_tokens`, with a
    /// [`RequestCost`]: one asking for more
    /// than the limit is then refused before it runs), pair the policy
    /// with a [concurrency limit](Self::concurrency), or use a token
    /// bucket to carry debts over. A client holds at most
    /// [`max_unsettled`](Self::with_max_unsettled) reservations at once (8
    /// by default, per instance), so requests held open bring at most that
    /// many overdrafts a window: over HTTP/2 one connection carries many
    /// requests at once, their bodies held back as the client likes.
    ///
    /// A settled policy counts every response (it takes no [`Count`]) and
    /// limits a rate (no concurrency). It counts units, not requests: a
    /// response that reports 0 costs it nothing, so pair it with a policy
    /// that counts requests on the same route. While the store is down and the
    /// policy falls back to its local limit
    /// ([`FailMode::Local`]), requests are reserved and settled in the
    /// local counts, at this instance's share of the cost reported
    /// (admissions the store made are counted there at their
    /// reservations).
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// // 1,000 tokens a minute, reserving 100 a request.
    /// let tokens = Policy::new("tokens", 1_000, Duration::from_secs(60))
    ///     .with_cost(100)
    ///     .settled_after_response();
    /// assert!(tokens.is_settled_after_response());
    /// ```
    #[must_use]
    pub fn settled_after_response(mut self) -> Self {
        self.settlement.get_or_insert_with(Settlement::default);
        self
    }

    /// The most reservations of this policy one client holds at once, its
    /// requests admitted and not yet settled (default
    /// [`DEFAULT_MAX_UNSETTLED`], 8); a request past it is answered `429`
    /// with `Retry-After: 1`, its units given back. So a client that holds
    /// requests open (over HTTP/2, many streams on one connection, their
    /// bodies held back) spends in a window at most the limit plus that
    /// many overdrafts, even where no request says what it will cost. The
    /// count is kept in each process: with several instances, each holds
    /// its own. Implies [`settled_after_response`](Self::settled_after_response).
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// let tokens = Policy::new("tokens", 100_000, Duration::from_secs(60))
    ///     .with_cost(500)
    ///     .with_max_unsettled(4);
    /// assert!(tokens.is_settled_after_response());
    /// assert!(slidegate::Policies::single(tokens.with_max_unsettled(0)).is_err());
    /// ```
    pub fn with_max_unsettled(mut self, max: u32) -> Self {
        self.settlement
            .get_or_insert_with(Settlement::default)
            .max_unsettled = max;
        self
    }

    /// Settles each request's cost after its response (see
    /// [`settled_after_response`](Self::settled_after_response)) from the
    /// integer in the response header `header`, or in a trailer of that
    /// name: for a proxy of an upstream that reports its usage. The header
    /// must come from your service or its upstream: one that echoes a
    /// request's headers into its response would let clients name their
    /// own cost. The header wins over the [`Usage`](crate::Usage) handle. Its value is
    /// ASCII digits (a number past `u64::MAX` counts as that); any other
    /// is ignored (and traced), and the handle's value, or else the
    /// reservation, stands. A header in the response's head is charged as
    /// the head passes, whatever becomes of the body: a client that holds
    /// the body back (an HTTP/2 stream whose flow-control window it keeps
    /// shut) holds no reservation meanwhile. A trailer comes only at the
    /// body's end: a client that goes away before keeps the reservation.
    ///
    /// ```
    /// use slidegate::Policy;
    /// use http::HeaderName;
    /// use std::time::Duration;
    ///
    /// let tokens = Policy::new("tokens", 1_000, Duration::from_secs(60))
    ///     .with_cost(100)
    ///     .with_usage_header(HeaderName::from_static("x-usage-tokens"));
    /// assert_eq!(tokens.usage_header().map(|name| name.as_str()), Some("x-usage-tokens"));
    /// ```
    #[must_use]
    pub fn with_usage_header(mut self, header: HeaderName) -> Self {
        self.settlement
            .get_or_insert_with(Settlement::default)
            .header = Some(header);
        self
    }

    /// Whether the policy settles its requests' costs after their
    /// responses.
    pub fn is_settled_after_response(&self) -> bool {
        self.settlement.is_some()
    }

    /// The response header (or trailer) that reports a request's cost,
    /// if the policy names one.
    pub fn usage_header(&self) -> Option<&HeaderName> {
        self.settlement.as_ref()?.header.as_ref()
    }

    /// The most reservations one client holds at once, unsettled, for a
    /// policy settled after the response (see
    /// [`with_max_unsettled`](Self::with_max_unsettled)).
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// let tokens = Policy::new("tokens", 1_000, Duration::from_secs(60));
    /// assert_eq!(tokens.max_unsettled(), None);
    /// assert_eq!(tokens.settled_after_response().max_unsettled(), Some(8));
    /// ```
    pub fn max_unsettled(&self) -> Option<u32> {
        Some(self.settlement.as_ref()?.max_unsettled)
    }

    pub(crate) fn settlement(&self) -> Option<&Settlement> {
        self.settlement.as_ref()
    }

    /// Puts the policy in shadow mode: it counts and decides as usual, and
    /// its headers are sent, but it never denies a request. Its denials
    /// are traced (and counted, with the `metrics` feature), to try a new
    /// limit on real traffic before enforcing it.
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// let trial = Policy::new("search-v2", 20, Duration::from_secs(60)).with_shadow(true);
    /// assert!(trial.is_shadow());
    /// ```
    #[must_use]
    pub fn with_shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shared form of the name, cheap to clone into a store check.
    pub(crate) fn shared_name(&self) -> &Arc<str> {
        &self.name
    }

    /// Units allowed per window.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The sliding window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The counting algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Units consumed by one request.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// The fail mode set on this policy, if any.
    pub fn fail_mode(&self) -> Option<FailMode> {
        self.fail_mode
    }

    /// Which requests the policy counts.
    pub fn count(&self) -> Count {
        self.count
    }

    /// Whether the policy is in shadow mode.
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// How long a denial blocks the client, if it does.
    pub fn block(&self) -> Option<Duration> {
        self.block
    }

    /// How long a request may be held instead of denied, if it may.
    pub fn delay(&self) -> Option<Duration> {
        self.delay
    }

    pub(crate) fn validate(&self) -> Result<(), PolicyError> {
        if !is_valid_name(&self.name) {
            return Err(PolicyError::InvalidName {
                name: self.name.to_string(),
            });
        }
        let name = || self.name.to_string();
        let tier_burst = self.tiers.iter().any(|(_, tier)| tier.burst.is_some());
        if (self.burst.is_some() || tier_burst) && self.algorithm != Algorithm::TokenBucket {
            return Err(PolicyError::BurstWithoutBucket { name: name() });
        }
        if self
            .block
            .is_some_and(|block| block < Duration::from_millis(1) || block > MAX_WINDOW)
        {
            return Err(PolicyError::InvalidBlock { name: name() });
        }
        if self.delay.is_some_and(|delay| delay > MAX_DELAY) {
            return Err(PolicyError::DelayTooLong { name: name() });
        }
        if self.algorithm == Algorithm::Concurrency
            && (self.delay.is_some() || self.block.is_some())
        {
            return Err(PolicyError::ConcurrencyWithDelayOrBlock { name: name() });
        }
        if self.settlement.is_some()
            && (self.algorithm == Algorithm::Concurrency || self.count != Count::All)
        {
            return Err(PolicyError::SettledWithoutRate { name: name() });
        }
        if self
            .settlement
            .as_ref()
            .is_some_and(|settlement| settlement.max_unsettled == 0)
        {
            return Err(PolicyError::ZeroMaxUnsettled { name: name() });
        }
        if let Algorithm::Calendar(calendar) = self.algorithm {
            if !calendar.is_valid() {
                return Err(PolicyError::InvalidUtcOffset { name: name() });
            }
            if self.delay.is_some() {
                return Err(PolicyError::CalendarWithDelay { name: name() });
            }
            if let Some((tier, _)) = self.tiers.iter().find(|(_, tier)| tier.window.is_some()) {
                return Err(PolicyError::CalendarWithWindow {
                    name: format!("{} (tier `{tier}`)", self.name),
                });
            }
        }
        validate_limits(name(), self.limits_for(None), self.algorithm)?;
        for (tier, _) in &self.tiers {
            let name = format!("{} (tier `{tier}`)", self.name);
            validate_limits(name, self.limits_for(Some(tier)), self.algorithm)?;
        }
        Ok(())
    }
}

fn validate_limits(name: String, limits: Limits, algorithm: Algorithm) -> Result<(), PolicyError> {
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
fn validate_counts(
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

/// Whether `name` may name a policy (or a layer's namespace): 1 to 64
/// ASCII letters, digits, `-` and `_`.
pub(crate) fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}
/// The longest a policy may hold a request instead of denying it.
pub const MAX_DELAY: Duration = Duration::from_secs(60);

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
    /// Two policies share a name, and so would share store keys.
    #[error("policy name `{name}` is used twice")]
    DuplicateName {
        /// The repeated name.
        name: String,
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
    /// The window is longer than [`MAX_WINDOW`] (366 days).
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
    /// A block shorter than a millisecond or longer than [`MAX_WINDOW`].
    #[error("policy `{name}`: block must be between 1ms and 366 days")]
    InvalidBlock {
        /// The policy.
        name: String,
    },
    /// A delay longer than [`MAX_DELAY`].
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
         (`PoliciesBuilder::extension_method`, config `limiter.extension_methods`)"
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
            Self::InvalidName { .. } | Self::ReservedName { .. } | Self::DuplicateName { .. } => {
                "name"
            }
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
            Self::CalendarWithDelay { .. } | Self::CalendarWithWindow { .. } => "calendar",
            Self::InvalidRoute { .. }
            | Self::InvalidPattern { .. }
            | Self::UnknownMethod { .. } => "route",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy of `limit` a minute, for the policy modules' tests.
    pub(super) fn minute(name: &str, limit: u32) -> Policy {
        Policy::new(name, limit, Duration::from_secs(60))
    }

    #[test]
    fn cost_above_limit_is_refused() {
        let err = Policies::single(minute("p", 5).with_cost(6)).unwrap_err();
        assert_eq!(
            err,
            PolicyError::CostAboveLimit {
                name: "p".into(),
                cost: 6,
                limit: 5
            }
        );
        assert!(Policies::single(minute("p", 5).with_cost(5)).is_ok());
    }

    #[test]
    fn invalid_settings_are_refused() {
        assert!(matches!(
            Policies::single(minute("p", 0)),
            Err(PolicyError::ZeroLimit { .. })
        ));
        assert!(matches!(
            Policies::single(minute("p", 1).with_cost(0)),
            Err(PolicyError::ZeroCost { .. })
        ));
        assert!(matches!(
            Policies::single(Policy::new("p", 1, Duration::from_micros(10))),
            Err(PolicyError::WindowTooShort { .. })
        ));
        for too_long in [Duration::MAX, MAX_WINDOW + Duration::from_micros(1)] {
            assert!(matches!(
                Policies::single(Policy::new("p", 1, too_long)),
                Err(PolicyError::WindowTooLong { .. })
            ));
        }
        assert!(Policies::single(Policy::new("p", 1, MAX_WINDOW)).is_ok());
        for bad in ["", "a:b", "{x}", "a b", &"n".repeat(65)] {
            assert!(matches!(
                Policies::single(minute(bad, 1)),
                Err(PolicyError::InvalidName { .. })
            ));
        }
        let duplicate = Policies::builder()
            .route("/a", minute("p", 1))
            .default_policy(minute("p", 2))
            .build();
        assert!(matches!(duplicate, Err(PolicyError::DuplicateName { .. })));
        let bad_route = Policies::builder().route("GET", minute("p", 1)).build();
        assert!(matches!(bad_route, Err(PolicyError::InvalidRoute { .. })));
        assert!(matches!(
            Policies::single(minute("credential_failures", 1)),
            Err(PolicyError::ReservedName { .. })
        ));
        assert!(matches!(
            Policies::single(Policy::concurrency("c", 4097)),
            Err(PolicyError::TooManyLeases { .. })
        ));
        assert!(Policies::single(Policy::concurrency("c", 4096)).is_ok());
        let tier = Policy::concurrency("c", 2).with_tier("pro", TierLimits::new().with_limit(5000));
        assert!(matches!(
            Policies::single(tier),
            Err(PolicyError::TooManyLeases { .. })
        ));
    }

    #[test]
    fn tier_overrides_are_validated_too() {
        let bad_tier = minute("p", 10)
            .with_cost(2)
            .with_tier("free", TierLimits::new().with_limit(1));
        assert_eq!(
            Policies::single(bad_tier).unwrap_err(),
            PolicyError::CostAboveLimit {
                name: "p (tier `free`)".into(),
                cost: 2,
                limit: 1
            }
        );
        let replaced = minute("p", 10)
            .with_tier("pro", TierLimits::new().with_limit(1))
            .with_tier("pro", TierLimits::new().with_limit(20).with_cost(4));
        let pro = replaced.limits_for(Some("pro"));
        assert_eq!(
            (pro.limit, pro.cost, pro.window),
            (20, 4, Duration::from_secs(60))
        );
    }

    #[test]
    fn sliding_counter_limits_keep_its_arithmetic_exact() {
        let counter = |limit, window| {
            Policies::single(
                Policy::new("c", limit, window).with_algorithm(Algorithm::SlidingCounter),
            )
        };
        assert!(counter(1_000_000, Duration::from_secs(3600)).is_ok());
        assert!(matches!(
            counter(u32::MAX, Duration::from_secs(86_400 * 30)),
            Err(PolicyError::CounterTooLarge { .. })
        ));
        assert!(matches!(
            counter(10, Duration::from_micros(1500)),
            Err(PolicyError::CounterWindowNotWholeMillis { .. })
        ));
        // The log and the fixed window have no such bound.
        let log = Policy::new("l", u32::MAX, Duration::from_secs(86_400 * 30));
        assert!(Policies::single(log.clone()).is_ok());
        assert!(Policies::single(log.with_algorithm(Algorithm::FixedWindow)).is_ok());
    }
}
