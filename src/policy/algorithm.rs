//! [`Algorithm`]: how a policy counts, and when to pick each.

use super::Calendar;

/// The counting algorithm of a [`Policy`](crate::Policy).
///
/// | algorithm | state per client and policy | accuracy | pick it for |
/// |---|---|---|---|
/// | [`SlidingLog`](Algorithm::SlidingLog) (default) | one entry per admitted request | exact; `Retry-After` to the microsecond | most limits: exact, at one entry per request in the window |
/// | [`SlidingCounter`](Algorithm::SlidingCounter) | two counters (current and previous epoch-aligned window) | estimates the previous window as spread evenly; `Retry-After` and reset solved exactly from that estimate | very high limits and millions of clients: constant memory, at a small approximation |
/// | [`FixedWindow`](Algorithm::FixedWindow) | one counter | a client can spend up to twice the limit across a boundary | the cheapest count, where twice the limit across a boundary does no harm |
/// | [`TokenBucket`](Algorithm::TokenBucket) | one timestamp and debt (48 bytes on Redis) | exact for its model: a steady rate with a burst; `Retry-After` to the microsecond | a steady rate that lets a client spend a [burst](crate::Policy::with_burst) at once |
/// | [`Concurrency`](Algorithm::Concurrency) ([`Policy::concurrency`](crate::Policy::concurrency)) | one lease per request in flight | exact: at most N in flight | slow or long requests (exports, WebSockets): how many at once, not how many a minute |
/// | [`Calendar`](Algorithm::Calendar) ([`Policy::calendar`](crate::Policy::calendar)) | one count (16 bytes on Redis) | exact; starts again at each boundary of the period | quotas per day, week, month or year: "10,000 calls a month, from the 1st" |
///
/// ```rust
/// use slidegate::{Policy, policy::Algorithm};
/// use std::time::Duration;
///
/// let per_client = Policy::new("api", 10_000, Duration::from_secs(60)).with_algorithm(Algorithm::SlidingCounter);
/// ```
///
/// Every algorithm works on both stores with the same results, with
/// weighted costs and all-or-nothing batches (one script call even when a
/// request's policies use different algorithms). The counter's accuracy on
/// a seeded million-request trace, and the memory each algorithm takes,
/// are in the repository's `BENCHMARKS.md`.
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
    /// A token bucket (GCRA, one timestamp per client, one 48-byte key per
    /// client and policy on Redis): a steady rate of `limit` units per
    /// `window`, with a bucket of [burst](crate::Policy::with_burst) units
    /// (default: the limit) that a client may spend at once. Exact for its
    /// model; `burst × window in µs` must stay below 2^52 so the
    /// arithmetic is exact in Redis. Decisions report the burst as their
    /// limit.
    TokenBucket,
    /// At most `limit` requests of a client in flight at once (see
    /// [`Policy::concurrency`](crate::Policy::concurrency)): a request holds a lease from admission
    /// until its response body ends or is dropped, and a lease expires
    /// after the policy's window, its lease time.
    Concurrency,
    /// A count per calendar period (see [`Policy::calendar`](crate::Policy::calendar)): exact,
    /// one number per client, starting again at each boundary.
    Calendar(Calendar),
}
