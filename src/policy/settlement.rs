//! Policies settled after the response: a request reserves its cost
//! when admitted, and its response's real cost replaces the reservation.

use http::HeaderName;

use super::Policy;

/// How a policy settled after the response learns a request's real cost
/// (see [`Policy::with_settlement`]).
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
pub(crate) const DEFAULT_MAX_UNSETTLED: u32 = 8;

impl Policy {
    /// Settles each request's cost after its response (config
    /// `settled = true`): for LLM token budgets, say, where the tokens a
    /// response generated are known only once it is done. The request
    /// reserves its [cost](Self::with_cost), an estimate, when it is
    /// admitted, and when its response ends (its body sent to the end,
    /// or dropped) the cost it reports replaces the reservation: the
    /// difference is given back, or charged even past the limit, so a
    /// client that spent more than it reserved is denied until enough
    /// leaves the window, with an exact `Retry-After`.
    ///
    /// The handler reports the cost on the [`Usage`](crate::Usage) handle
    /// it finds in the request's extensions (a stream as it goes, with
    /// [`Usage::add`](crate::Usage::add)), or the response carries it in a
    /// header or trailer the policy names
    /// ([`with_usage_header`](Self::with_usage_header), for a proxy of an
    /// upstream that reports usage); a header wins over the handle. What
    /// the handle reports past the reservation is charged as it comes (at
    /// most once a second), and a cost in a response header as the head
    /// passes, not only when the body ends. The request is settled at the
    /// last value reported once its body has ended or was dropped and the
    /// handler has let go of the handle. A request that reports nothing
    /// keeps its reservation, so a client that goes away mid-stream is
    /// charged what was reported by then, else the reservation.
    ///
    /// An overdraft is one record or number whatever its size, and counts
    /// as the policy's algorithm counts units: a sliding log holds it until
    /// it leaves the window (`Retry-After` says when, to the second), a
    /// fixed window or a calendar quota until the window or period ends (a
    /// single charge counts at most the limit, which already denies every
    /// request that long), a sliding counter counts at most the limit of it
    /// in its current window, and a token bucket keeps the whole debt,
    /// repaid at the policy's rate. `X-RateLimit-Remaining` is 0 while a
    /// client owes, never negative.
    ///
    /// So per window a client can spend at most the limit plus what its
    /// requests admitted meanwhile spend past their reservations: reserve
    /// what a request may cost (from the request, as an LLM API's
    /// `max_tokens`, with a [`RequestCost`](super::RequestCost) given to
    /// [`RateLimitLayer::with_request_cost`](crate::RateLimitLayer::with_request_cost):
    /// one asking for more than the limit is then refused, `422`, before it
    /// runs), pair the policy with a [concurrency limit](Self::concurrency),
    /// or use a token bucket to carry debts over. A client holds at most
    /// [`max_unsettled`](Self::with_max_unsettled) reservations at once (8
    /// by default, per instance), so requests held open bring at most that
    /// many overdrafts a window: over HTTP/2 one connection carries many
    /// requests at once, their bodies held back as the client likes.
    ///
    /// A settled policy counts every response (it takes no
    /// [`Count`](super::Count)) and limits a rate (it is no concurrency
    /// limit). It counts units, not requests: a response that reports 0
    /// costs it nothing, so pair it with a policy that counts requests on
    /// the same route (the example server's `completions`, 60 a minute), as
    /// a concurrency limit on upgraded connections pairs with a rate of
    /// opens (its `socket_opens`). While the store is down and the policy
    /// falls back to its local limit
    /// ([`FailMode::Local`](super::FailMode::Local)), requests are reserved
    /// and settled in the local counts, at this instance's share of the
    /// cost reported (admissions the store made are counted there at their
    /// reservations).
    ///
    /// ```toml
    /// [[policy]]
    /// name = "tokens"
    /// route = "POST /api/complete"
    /// limit = 100000                       # tokens a minute
    /// window = "60s"
    /// cost = 500                           # reserved when a completion starts...
    /// usage_header = "x-usage-tokens"      # ...replaced by what its response reports (or settled = true for the handle alone)
    /// ```
    ///
    /// ```
    /// use slidegate::Policy;
    /// use std::time::Duration;
    ///
    /// // 1,000 tokens a minute, reserving 100 a request.
    /// let tokens = Policy::new("tokens", 1_000, Duration::from_secs(60))
    ///     .with_cost(100)
    ///     .with_settlement(true);
    /// assert!(tokens.is_settled_after_response());
    /// ```
    ///
    /// [`Usage`](crate::Usage) shows a handler that reports as it streams.
    ///
    /// `false` turns settling off: the policy counts each request at its
    /// cost, and the settlement's usage header and
    /// [`max_unsettled`](Self::with_max_unsettled) go with it (a later
    /// [`with_usage_header`](Self::with_usage_header) or `with_max_unsettled`
    /// turns it on again, as each does).
    #[must_use]
    pub fn with_settlement(mut self, settled: bool) -> Self {
        if !settled {
            self.settlement = None;
        } else if self.settlement.is_none() {
            self.settlement = Some(Settlement::default());
        }
        self
    }

    /// The most reservations of this policy one client holds at once, its
    /// requests admitted and not yet settled (default
    /// 8); a request past it is answered `429`
    /// with `Retry-After: 1`, its units given back. So a client that holds
    /// requests open (over HTTP/2, many streams on one connection, their
    /// bodies held back) spends in a window at most the limit plus that
    /// many overdrafts, even where no request says what it will cost. The
    /// count is kept in each process: with several instances, each holds
    /// its own. Implies [`with_settlement(true)`](Self::with_settlement).
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
    #[must_use]
    pub fn with_max_unsettled(mut self, max: u32) -> Self {
        self.settlement
            .get_or_insert_with(Settlement::default)
            .max_unsettled = max;
        self
    }

    /// Settles each request's cost after its response (see
    /// [`with_settlement`](Self::with_settlement)) from the
    /// integer in the response header `header`, or in a trailer of that
    /// name (config `usage_header`): for a proxy of an upstream that
    /// reports its usage. The header must come from your service or its
    /// upstream: one that echoes a request's headers into its response
    /// would let clients name their own cost. The header wins over the
    /// [`Usage`](crate::Usage) handle. Its value is ASCII digits (a number
    /// past `u64::MAX` counts as that); any other is ignored (and traced),
    /// and the handle's value, or else the reservation, stands. A header in
    /// the response's head is charged as the head passes, whatever becomes
    /// of the body: a client that holds the body back (an HTTP/2 stream
    /// whose flow-control window it keeps shut) holds no reservation
    /// meanwhile. A trailer comes only at the body's end: a client that
    /// goes away before keeps the reservation.
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
    /// assert_eq!(tokens.with_settlement(true).max_unsettled(), Some(8));
    /// ```
    pub fn max_unsettled(&self) -> Option<u32> {
        Some(self.settlement.as_ref()?.max_unsettled)
    }

    pub(crate) fn settlement(&self) -> Option<&Settlement> {
        self.settlement.as_ref()
    }
}
