//! Policies: how much a client may spend, on which routes, and what happens
//! when the store cannot answer.
//!
//! A [`Policy`] is a limit per window with its algorithm, cost, fail mode
//! and per-tier overrides ([`TierLimits`]); [`Policies`] is the validated
//! set of a layer, each policy on a [route](PoliciesBuilder::with_route) or on every route; a
//! [`RequestCost`] computes a request's [`Cost`] from its head.
//!
//! # Algorithms
//!
//! A policy counts with one [`Algorithm`]: an exact sliding log (the
//! default), a sliding or fixed window counter for very high limits and
//! millions of clients, a token bucket for a steady rate with bursts, a
//! concurrency limit on requests in flight, or a quota per calendar day,
//! week, month or year. [`Algorithm`] compares them, with when to pick
//! each.
//!
//! # Beyond the window
//!
//! Each of these works on both stores, in the same all-or-nothing batch as
//! the other policies of a request (a request denied by one records nothing
//! in any), and each has its tests on a real Redis beside the memory store.
//!
//! * **A burst over a steady rate:** [`Algorithm::TokenBucket`], with a
//!   bucket of [`Policy::with_burst`] units.
//! * **At most N in flight:** [`Policy::concurrency`].
//! * **Wait a little instead of `429`:** [`Policy::with_delay`].
//! * **Block an abuser for a while:** [`Policy::with_block`].
//! * **Inspect and reset a client:** [`RateLimitLayer::peek`] tells where
//!   a client stands without recording anything, and
//!   [`RateLimitLayer::reset`] forgets what it has spent, its block
//!   included.
//! * **A limit per client:** a limit lookup
//!   ([`RateLimitLayer::with_limit_lookup`]: a closure, a [`Lookup`] of
//!   your own, or an [`Overrides`] table) gives a client its own limit in
//!   place of its tier's (see the [`limits`](crate::limits) module).
//! * **Costs known after the response, such as LLM token budgets:**
//!   [`Policy::with_settlement`], with the [`Usage`] a handler
//!   reports on, or [`Policy::with_usage_header`].
//! * **Quotas by the calendar:** [`Policy::calendar`] and [`Calendar`].
//! * **A count on another key than the client's** (everyone's, the
//!   client's address, its organisation): [`Policy::per`].
//! * **WebSockets and other upgraded connections:** a
//!   [`Policy::concurrency`] limit held by a [`ConnectionLease`], and the
//!   rate of the messages sent over them ([`Policy::with_messages`]).
//!
//! A policy may also count only the requests that failed, or succeeded
//! ([`Count`]), and run in shadow mode, counting and deciding without ever
//! denying ([`Policy::with_shadow`]).
//!
//! [`RateLimitLayer::peek`]: crate::RateLimitLayer::peek
//! [`RateLimitLayer::reset`]: crate::RateLimitLayer::reset
//! [`RateLimitLayer::with_limit_lookup`]: crate::RateLimitLayer::with_limit_lookup
//! [`Overrides`]: crate::limits::Overrides
//! [`Lookup`]: crate::lookup::Lookup
//! [`Usage`]: crate::Usage
//! [`ConnectionLease`]: crate::layer::ConnectionLease

mod algorithm;
mod calendar;
pub(crate) mod cost;
mod count;
mod error;
mod messages;
mod per;
pub(crate) mod plan;
mod route;
mod settlement;
mod slice;
mod table;
pub(crate) mod terms;
mod tiers;
mod waiting;

pub use algorithm::Algorithm;
pub use calendar::{Calendar, Period};
pub use cost::{Cost, RequestCost};
pub use count::Count;
pub use error::PolicyError;
use error::validate_limits;
pub use messages::{MessageRate, POLICY_VIOLATION};
pub(crate) use per::Per;
pub use per::PerMissing;
pub(crate) use route::Route;
pub(crate) use settlement::Settlement;
pub use table::{Policies, PoliciesBuilder};
pub(crate) use terms::Terms;
pub use tiers::{Limits, TierLimits};
pub(crate) use waiting::MAX_DELAY;

use std::sync::Arc;
use std::time::Duration;

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
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The name under which a layer counts refused credentials; no policy
/// may take it.
pub(crate) const CREDENTIAL_FAILURES: &str = "credential_failures";

/// The longest window a policy may have: 366 days (a humantime `1y` is
/// 365.25 days). Time arithmetic stays exact in Redis's Lua numbers well
/// past it; no [`Check`](crate::store::Check) can be built with a longer
/// one.
pub(crate) const MAX_WINDOW: Duration = Duration::from_secs(366 * 86_400);

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
    slice: Option<u32>,
    per: Option<Per>,
    messages: Option<MessageRate>,
}

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
            slice: None,
            per: None,
            messages: None,
        }
    }

    /// A policy named `name` allowing at most `in_flight` requests of a
    /// client at once ([`Algorithm::Concurrency`]), across every instance
    /// on one Redis. A request holds a lease from its admission until its
    /// response body has been sent to the end, or the response or body is
    /// dropped (the client went away, the handler panicked); every
    /// response body is a [`ResponseBody`](crate::layer::ResponseBody) for
    /// this. A lease expires after the lease time
    /// ([`with_lease`](Self::with_lease), 30 s unless
    /// set), so the leases of an instance that died are gone within it; set
    /// it above your slowest response, since a request that outlives its
    /// lease stops counting. Over the limit a request is answered `429`
    /// with `Retry-After: 1`. `in_flight` is at most 4,096 per client (see
    /// [`PolicyError::TooManyLeases`]): each lease is a member of one Redis
    /// key per client, which Redis must free at once.
    ///
    /// Denials of a concurrency limit are never cached (a lease can end at
    /// any moment), so each is a store call. Each check carries a lease id
    /// made before the store is asked, so a request whose check timed out,
    /// failed or was dropped in flight still releases its lease by that id
    /// (on Redis, a release that arrives before its take leaves a
    /// tombstone, and the take then takes nothing): a client is never
    /// locked out with nothing in flight.
    ///
    /// On a route that upgrades its connection (a WebSocket), the lease is
    /// held until the upgraded connection closes: see
    /// [`ConnectionLease`](crate::layer::ConnectionLease).
    ///
    /// ```toml
    /// [[policy]]
    /// name = "exports"
    /// route = "GET /api/export"
    /// concurrency = 2                      # in place of limit and window
    /// lease = "30s"
    /// ```
    ///
    /// ```rust
    /// use slidegate::Policy;
    /// use std::time::Duration;
    /// # use slidegate::policy::Algorithm;
    ///
    /// let exports = Policy::concurrency("exports", 2).with_lease(Duration::from_secs(120));
    /// # assert_eq!((exports.algorithm(), exports.limit()), (Algorithm::Concurrency, 2));
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
    /// The bucket is GCRA in one 48-byte key per client and policy, exact
    /// for its model: `Retry-After` is the moment the request's whole cost
    /// fits, to the microsecond, whatever the rate (three a second is
    /// 333,333⅓ µs a unit and stays exact). Headers report the burst as the
    /// limit, and `RateLimit-Policy` states the burst per the time to
    /// refill it (`"api";q=50;w=5` for 10 a second with a burst of 50).
    /// `burst × window in µs` must stay below 2^52.
    ///
    /// ```toml
    /// [[policy]]
    /// name = "api"
    /// limit = 10                           # 10 a second on average...
    /// window = "1s"
    /// algorithm = "token_bucket"
    /// burst = 50                           # ...and up to 50 at once
    /// ```
    ///
    /// ```rust
    /// use slidegate::{Policy, policy::Algorithm};
    /// use std::time::Duration;
    ///
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

    /// Puts the policy in shadow mode: it counts and decides as usual, and
    /// its rate-limit headers are sent, but it never denies a request. Its
    /// denials are traced (the `rate_limit` span, at debug level) and
    /// counted (the outcome `shadow_denied`, with the `metrics` feature).
    /// Try a new limit on real traffic first, then enforce it.
    ///
    /// Shadow policies are checked in a batch of their own, after the
    /// enforced ones admit the request: in one all-or-nothing batch a shadow
    /// denial would deny the request, and a denied request counts nowhere.
    /// A shadow policy never fails closed, and in shadow mode refused
    /// credentials are answered `401`, never `429`.
    ///
    /// The switch for every policy of a layer at once is
    /// [`RateLimitLayer::with_shadow`](crate::RateLimitLayer::with_shadow)
    /// (config `[limiter] shadow`).
    ///
    /// ```toml
    /// [limiter]
    /// shadow = false                      # true: every policy in shadow mode
    ///
    /// [[policy]]
    /// name = "search-v2"
    /// route = "GET /api/search"
    /// limit = 20
    /// window = "60s"
    /// shadow = true
    /// ```
    ///
    /// ```rust
    /// # use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
    /// # use std::time::Duration;
    /// let trial = Policy::new("search-v2", 20, Duration::from_secs(60)).with_shadow(true);
    /// # assert!(trial.is_shadow());
    /// # let policies = Policies::single(trial).unwrap();
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_shadow(false);
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
        self.validate_slice()?;
        if let Some(messages) = &self.messages {
            messages.validate(&self.name)?;
        }
        for (tier, _) in &self.tiers {
            let name = format!("{} (tier `{tier}`)", self.name);
            validate_limits(name, self.limits_for(Some(tier)), self.algorithm)?;
        }
        Ok(())
    }
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

#[cfg(test)]
mod tests;
