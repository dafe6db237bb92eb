//! How long a denied client waits: a block after a denial
//! ([`Policy::with_block`]), or a delay instead of one
//! ([`Policy::with_delay`]).

use std::time::Duration;

use super::Policy;

/// The longest a policy may hold a request instead of denying it.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(60);

impl Policy {
    /// Blocks a client once this policy denies it by its own count: every
    /// request of the client under this policy is denied for `block` from
    /// that denial (`429` with `Retry-After` the time left), whatever its
    /// count, and requests during the block do not extend it. The block is
    /// held in the store, so every instance agrees, and answered from the
    /// [deny cache](crate::layer::DenyCache), even under
    /// [`Count::Failures`](super::Count::Failures): a refund never lifts a block. A reload that
    /// takes `block` off a policy lifts its blocks on both stores.
    ///
    /// A request denied by another policy of the same request is no denial
    /// of this one, and nor is a request this policy's own
    /// [delay](Self::with_delay) holds: with both, a request that fits
    /// within the delay is held, and only one beyond it starts the block.
    /// A layer that holds no request (`max_delayed = 0`) answers such a
    /// request `429` and keeps it counted, as if it had been held, so a
    /// client that keeps asking still reaches its block. One the layer has
    /// no room for because other requests fill its places is answered
    /// `503`, its units given back: that is not the client's doing.
    ///
    /// With [`Count::Failures`](super::Count::Failures), requests still in flight count until their
    /// responses show otherwise, so a client with more requests in flight
    /// than the limit (slow logins, say) is denied and blocked although
    /// none of them fails: keep such a policy's limit above the logins a
    /// client can have in flight at once.
    ///
    /// ```toml
    /// [[policy]]
    /// name = "login"
    /// route = "POST /api/login"
    /// limit = 5
    /// window = "60s"
    /// count = "failures"
    /// block = "10m"                        # five failed logins a minute, then ten minutes out
    /// ```
    ///
    /// ```rust
    /// use slidegate::{Policy, policy::Count};
    /// use std::time::Duration;
    ///
    /// let login = Policy::new("login", 5, Duration::from_secs(60))
    ///     .with_count(Count::Failures)
    ///     .with_block(Duration::from_secs(600));
    /// # assert_eq!(login.block(), Some(Duration::from_secs(600)));
    /// ```
    #[must_use]
    pub fn with_block(mut self, block: Duration) -> Self {
        self.block = Some(block);
        self
    }

    /// Holds a request this policy would deny when it would fit within
    /// `delay` (at most 60 s), and admits it then, instead
    /// of answering `429`: for clients that cannot retry.
    ///
    /// The store decides the request once, when it comes: it admits it at
    /// the time it fits (under every policy of the request, the latest of
    /// their times) and records its units at that time, so no request
    /// admitted meanwhile takes its place, and no window ever holds more
    /// than the limit (600 requests at once on 10 per 300 ms come through
    /// in waves of 10). The layer then waits until that time and calls the
    /// handler, without asking the store again: a store that fails
    /// meanwhile changes nothing. The request's rate-limit headers are
    /// those of when it passes.
    ///
    /// A client that goes away while held gives its units back, except
    /// under a token bucket: its held requests pass at times fixed when
    /// they were recorded, and units taken back from ahead of them would
    /// free a slot beside them, so while a bucket holds a request it gives
    /// nothing back (refunds of [`Count`](super::Count) policies included). A request
    /// under a [concurrency limit](Self::concurrency) is never held (its
    /// lease would be taken, and its time run, while it waits): it is
    /// answered `429`.
    ///
    /// A client holds at most what its own limit grants within `delay` (10
    /// a second with a delay of 500 ms: 5 requests of cost 1; the store
    /// holds none beyond the delay, and answers them `429` at once), so one
    /// client cannot take another's places. A sliding or fixed window
    /// counter holds a request until the end of the next window at most. A
    /// client whose window length changes while it has requests held (a
    /// tier with a window of its own, a reload) is denied until the last of
    /// them has passed, because the new window could not keep them counted
    /// until then.
    ///
    /// At most 10,000 requests
    /// ([`with_max_delayed`](crate::RateLimitLayer::with_max_delayed)), and
    /// 64 MiB of their heads
    /// ([`with_max_delayed_bytes`](crate::RateLimitLayer::with_max_delayed_bytes)),
    /// are held per layer by default; past that, a request the store would
    /// hold is answered `503`
    /// ([`Rejection::DelayFull`](crate::Rejection::DelayFull), `Retry-After`
    /// the wait it would have had) and its units are given back: other
    /// clients filling the layer never push a client toward its block. With
    /// `max_delayed = 0` no request is held: each is answered `429`, as
    /// without a delay (its units kept if a policy of its
    /// [blocks](Self::with_block), so a client that keeps asking reaches its
    /// block). [`RateLimitLayer::delayed`](crate::RateLimitLayer::delayed)
    /// says how many are held now.
    ///
    /// ```toml
    /// [[policy]]
    /// name = "search"
    /// limit = 5
    /// window = "1s"
    /// delay = "500ms"                      # at most 60 s
    /// ```
    ///
    /// ```rust
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// let search = Policy::new("search", 5, Duration::from_secs(1)).with_delay(Duration::from_millis(500));
    /// # assert_eq!(search.delay(), Some(Duration::from_millis(500)));
    /// ```
    #[must_use]
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }
}
