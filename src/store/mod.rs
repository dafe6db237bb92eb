//! Where counts live: the [`Store`] trait and its two implementations.
//!
//! * [`MemoryStore`]: embedded, sharded, for one process.
//! * `RedisStore` (feature `redis`): an atomic Lua script on a deadpool-redis
//!   pool, shared by every instance of a service.
//!
//! Both give the same decisions for the same sequence of requests.
//!
//! # Writing a store
//!
//! A third store (on Postgres, DynamoDB, ...) implements [`Store`]. Each
//! [`Check`] names whose count it is ([`Check::namespace`],
//! [`Check::policy`], [`Check::key`]) and how to count it; a store keeps
//! one state per (namespace, policy, key), started afresh when the
//! policy's algorithm changes (the Redis store keeps a key per
//! algorithm), and decides a request's checks all-or-nothing, atomically
//! against every other request on that state (the Redis store decides
//! each request inside one Lua call; a SQL store would take row locks in
//! a fixed order). Time is
//! the store's own, in microseconds; a store for tests reads it from a
//! [`Clock`](crate::clock::Clock). What each algorithm keeps, as
//! [`MemoryStore`] keeps it and the Lua files in `lua/` for Redis:
//!
//! | [`Algorithm`](crate::policy::Algorithm) | state | a request of cost `c` fits when | refund |
//! |---|---|---|---|
//! | `SlidingLog` | every admitted request's time and cost, kept for [`Check::span`] | the costs within the last [`Check::window`], plus `c`, are at most the limit | drops the one record at its `recorded_at` |
//! | `SlidingCounter` | this window's and the last window's counts, windows aligned to the epoch | the last count weighted by the share of its window still covered, plus this one, plus `c`, is at most the limit | from the window that holds `recorded_at`, if it still counts |
//! | `FixedWindow` | this window's count | the count plus `c` is at most the limit | from this window (or the next, for a held request) |
//! | `TokenBucket` | the debt and when it was last placed (GCRA) | the debt after refilling, plus `c`, fits the burst ([`Check::burst`]) | takes back the part of their debt not yet refilled |
//! | `Calendar` | the count and the end of its period | the count plus `c` is at most the limit | from the period, if it is still this one |
//! | `Concurrency` | the live leases, by [`Check::lease_id`], each expiring a window after it was taken | fewer than the limit are live | releases the lease (a store where a release may arrive before its take, as on Redis, leaves a tombstone for it) |
//!
//! Beyond counting: a request that does not fit now, but whose retry
//! time under every check is within that check's [`Check::delay`] and
//! which fits them all then, is admitted at that time (its units
//! recorded then); a denial by a check's own count beyond its delay
//! blocks the client for [`Check::block`]. [`Decision`] says what a request is
//! told; its fields are exact, not estimates. [`Store::peek`],
//! [`Store::refund`], [`Store::settle`], [`Store::renew`] and
//! [`Store::reset`] are optional: a store that answers
//! [`StoreError::Unsupported`] loses only the features that need them
//! (the conformance trace below asks for peeks and refunds).
//!
//! With the `test-util` feature, [`conformance::Conformance`] holds a
//! store to [`MemoryStore`]'s decisions over a seeded trace of every
//! algorithm, with delays, blocks, tiers, peeks and refunds, as the
//! crate's own tests hold the Redis store.

pub(crate) mod background;
mod breaker;
mod check;
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod conformance;
mod decision;
mod gauges;
mod memory;
#[cfg(feature = "redis")]
mod redis;
mod sliced;
mod soon;

pub use breaker::{BreakerSettings, BreakerState, CircuitBreaker};
pub use check::Check;
pub(crate) use check::{Checks, Scope};
pub use decision::{Decision, Decisions};
pub(crate) use decision::{UNSET, closest_to_denying, index_of_min, micros, optional_micros};
pub(crate) use memory::next_id;
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "redis")]
pub use redis::{PrefixError, RedisPool, RedisStore, RedisStoreBuilder};
pub(crate) use sliced::{Sliced, refund_of};
pub(crate) use soon::Soon;
pub use soon::StoreFuture;

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

/// What a [`Store`] decided for a request's checks: one [`Decision`] per check.
pub(crate) type CheckOutcome = Result<Decisions, StoreError>;

/// A store of rate-limit state.
///
/// `check` decides a request's checks atomically: every check admits the request,
/// and its cost is recorded in all of them, or none records anything. It
/// returns one [`Decision`] per check, in order. Implementations bound their
/// own latency (a hung backend must become an error, not a hung request).
/// A store that decides in process answers with [`StoreFuture::ready`]; one
/// that waits on the network, with [`StoreFuture::new`].
///
/// `peek` serves [`RateLimitLayer::peek`](crate::RateLimitLayer::peek)
/// (and the layer's local counts, which a [`MemoryStore`] keeps). `refund`
/// gives units back: those of policies that count only some responses
/// ([`Count`](crate::policy::Count)), of a held request whose client went
/// away, of a request a full layer could not hold or one refused for
/// holding its most unsettled reservations, and a concurrency lease when
/// its request ends. A store without them answers
/// [`StoreError::Unsupported`]: `peek` then fails, a policy that counts
/// some responses only counts every request, and a lease is held until
/// its lease time passes.
pub trait Store: Send + Sync + 'static {
    /// Decides and, when admitted, records the request. The checks are
    /// borrowed: a store whose answer comes later copies what it needs.
    fn check(&self, checks: &[Check]) -> StoreFuture;

    /// The checks' decisions as a `check` now would give them, recording
    /// nothing: `admitted` says whether every check fits, and a check that
    /// does not fit has its `retry_after`.
    fn peek(&self, checks: &[Check]) -> StoreFuture {
        let _ = checks;
        StoreFuture::ready(Err(StoreError::Unsupported("peek")))
    }

    /// Takes back what an admitted request recorded: for each check, the
    /// units of its cost recorded at the time beside it (its decision's
    /// [`recorded_at`](Decision::recorded_at)). A sliding log drops exactly
    /// that request's entry; a counter takes the units from the window
    /// that counted them. Units that have left the window are gone
    /// already, and nothing else is taken; nor is anything for units of
    /// a state since reset or lost (a sliding counter's, a fixed
    /// window's or a token bucket's made after the time named). Each
    /// check's refund stands on its own.
    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        let _ = (checks, recorded_at);
        StoreFuture::ready(Err(StoreError::Unsupported("refund")))
    }

    /// Replaces what each check's request reserved by what it cost in the
    /// end, known only after its response (a policy
    /// [settled after the response](crate::Policy::with_settlement)):
    /// the units of its cost recorded at the time beside it are taken
    /// back as [`refund`](Self::refund) takes them, and the units beside
    /// them in `costs` are counted now, past the limit if need be, so
    /// the client is denied until enough leaves the window. Counting is
    /// bounded: one record or number whatever the cost. A sliding log, a
    /// fixed window and a calendar count at most the limit (a record of
    /// the whole limit already denies every request until it leaves); a
    /// sliding counter at most the limit, and no more than twice the
    /// limit in its current window; a token bucket keeps the whole debt,
    /// up to 2^52 units × µs of window. A sliding log's reserved units
    /// that have left its window are not counted again: such a late
    /// settlement counts only what the request cost beyond them. A check with a settlement id
    /// ([`Check::with_settlement_id`], which the layer gives every
    /// reservation it settles) is settled once: the same settlement sent
    /// again within five minutes (a retry after a timeout) does nothing,
    /// whether or not a [reset](Self::reset) came between. Each check's
    /// settlement stands on its own. A time of zero names no units: the cost is charged alone
    /// (as the layer settles a policy a reload has made count by another
    /// algorithm since the request was admitted).
    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> StoreFuture<()> {
        let _ = (checks, recorded_at, costs);
        StoreFuture::ready(Err(StoreError::Unsupported("settle")))
    }

    /// Keeps each concurrency check's lease, named by its id, for another
    /// lease time from now: an upgraded connection's leases (see
    /// [`ConnectionLease`](crate::layer::ConnectionLease)) are renewed
    /// while it lives. A lease that is gone (it expired while the store
    /// could not be reached, or the store lost its state) is taken again
    /// only within the limit, as a new request's would be: the
    /// connection still lives, so it counts, but never past the limit.
    /// Answers, per check, whether its lease is held: `false` where it is
    /// gone and could not be taken again (the layer then tells the
    /// connection, see [`ConnectionLease::withdrawn`](crate::layer::ConnectionLease::withdrawn)).
    /// The layer sends a release only after the renewals it made are
    /// answered; a renewal that timed out on this side and runs after the
    /// release takes the lease again (within the limit), for a lease
    /// time. Checks of other algorithms are left as they are, and answer
    /// `true`.
    fn renew(&self, checks: &[Check]) -> StoreFuture<Vec<bool>> {
        let _ = checks;
        StoreFuture::ready(Err(StoreError::Unsupported("renew")))
    }

    /// Forgets everything each check's client has spent under the check's
    /// policy, its block included: its next request starts afresh. Only
    /// the check's policy, client and algorithm matter.
    fn reset(&self, checks: &[Check]) -> StoreFuture<()> {
        let _ = checks;
        StoreFuture::ready(Err(StoreError::Unsupported("reset")))
    }

    /// The entries of the table `table`, as `(field, value)` pairs in no
    /// particular order: what the layer's [changes at run
    /// time](crate::layer::Changes) are kept in (the deny list, clients'
    /// limits), so that every instance on the store reads them and they
    /// outlive the instances. A table no entry was ever set in is empty.
    /// On Redis a table is one hash, `<prefix>:<table>`.
    fn entries(&self, table: &str) -> StoreFuture<Vec<(String, String)>> {
        let _ = table;
        StoreFuture::ready(Err(StoreError::Unsupported("entries")))
    }

    /// Sets the entry `field` of the table `table` to `value`.
    fn set_entry(&self, table: &str, field: &str, value: &str) -> StoreFuture<()> {
        let _ = (table, field, value);
        StoreFuture::ready(Err(StoreError::Unsupported("set_entry")))
    }

    /// Removes the entry `field` of the table `table`, if it is there and,
    /// when `holding` is given, holds that value (an entry set again
    /// meanwhile stays).
    fn remove_entry(&self, table: &str, field: &str, holding: Option<&str>) -> StoreFuture<()> {
        let _ = (table, field, holding);
        StoreFuture::ready(Err(StoreError::Unsupported("remove_entry")))
    }

    /// Whether a check costs a network round trip, as with Redis; the
    /// layer then keeps a [`DenyCache`](crate::layer::DenyCache) by default.
    fn is_remote(&self) -> bool {
        false
    }

    /// A count that grows each time the store may have lost state it held
    /// for clients: it answers again after calls failed for a while, or it
    /// was restarted empty (a Redis found without the check library). The
    /// layer then renews upgraded connections' leases at once rather than
    /// at their next renewal (at most once a second), so that once the
    /// store answers again a client soon holds at most its limit: a lease
    /// the store lost is taken again within the limit, or its connection
    /// is [withdrawn](crate::layer::ConnectionLease::withdrawn). `None`
    /// (the default) for a store that never loses its state, or cannot
    /// tell; a store that wraps another answers the other's.
    fn recoveries(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// The state this store shares with its clones, when it can name it:
    /// layers on one state may not give one policy name in one namespace
    /// two meanings (see
    /// [`RateLimitLayer::with_namespace`](crate::RateLimitLayer::with_namespace)).
    /// Two stores count in one place when their `Arc`s point to one value.
    /// `None` (the default) for a store that does not say.
    ///
    /// ```
    /// use slidegate::store::{MemoryStore, Store};
    /// use std::sync::Arc;
    ///
    /// let store = MemoryStore::new();
    /// let (one, other) = (store.shared_state().unwrap(), store.clone().shared_state().unwrap());
    /// assert!(Arc::ptr_eq(&one, &other));
    /// assert!(!Arc::ptr_eq(&one, &MemoryStore::new().shared_state().unwrap()));
    /// ```
    fn shared_state(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        None
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn check(&self, checks: &[Check]) -> StoreFuture {
        (**self).check(checks)
    }

    fn peek(&self, checks: &[Check]) -> StoreFuture {
        (**self).peek(checks)
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        (**self).refund(checks, recorded_at)
    }

    fn settle(&self, checks: &[Check], recorded_at: &[Duration], costs: &[u64]) -> StoreFuture<()> {
        (**self).settle(checks, recorded_at, costs)
    }

    fn renew(&self, checks: &[Check]) -> StoreFuture<Vec<bool>> {
        (**self).renew(checks)
    }

    fn reset(&self, checks: &[Check]) -> StoreFuture<()> {
        (**self).reset(checks)
    }

    fn entries(&self, table: &str) -> StoreFuture<Vec<(String, String)>> {
        (**self).entries(table)
    }

    fn set_entry(&self, table: &str, field: &str, value: &str) -> StoreFuture<()> {
        (**self).set_entry(table, field, value)
    }

    fn remove_entry(&self, table: &str, field: &str, holding: Option<&str>) -> StoreFuture<()> {
        (**self).remove_entry(table, field, holding)
    }

    fn is_remote(&self) -> bool {
        (**self).is_remote()
    }

    fn shared_state(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        (**self).shared_state()
    }

    fn recoveries(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        (**self).recoveries()
    }
}

/// A refund whose times do not pair with its checks, one each.
pub(crate) fn unpaired_refund(checks: &[Check], recorded_at: &[Duration]) -> Option<StoreError> {
    (checks.len() != recorded_at.len()).then(|| {
        StoreError::Internal(format!(
            "{} refund times for {} checks",
            recorded_at.len(),
            checks.len()
        ))
    })
}

/// A settlement whose times and costs do not pair with its checks.
pub(crate) fn unpaired_settlement(
    checks: &[Check],
    recorded_at: &[Duration],
    costs: &[u64],
) -> Option<StoreError> {
    unpaired_refund(checks, recorded_at).or_else(|| {
        (checks.len() != costs.len()).then(|| {
            StoreError::Internal(format!(
                "{} settled costs for {} checks",
                costs.len(),
                checks.len()
            ))
        })
    })
}

/// Why a store could not decide. Cloned for each request that waited on
/// the one call that failed.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend did not answer in time.
    #[error("rate-limit store timed out after {0:?}")]
    Timeout(Duration),
    /// The backend failed (connection refused, reset, script error, ...):
    /// made with [`StoreError::backend`].
    #[error("rate-limit store failed: {0}")]
    Backend(#[source] Arc<dyn std::error::Error + Send + Sync>),
    /// The backend answered something this crate does not understand.
    #[error("rate-limit store answered unexpectedly: {0}")]
    Protocol(String),
    /// A fault on this side of the store: a call made where it cannot run
    /// (outside a Tokio runtime), a batched check that lost its answer, a
    /// refund whose times do not pair with its checks.
    #[error("rate-limit store call failed on this side: {0}")]
    Internal(String),
    /// A [`CircuitBreaker`] skipped the store after repeated failures.
    #[error("rate-limit store skipped: its circuit breaker is open")]
    CircuitOpen,
    /// The store does not do this (`peek`, `refund`, `settle`, `renew` or
    /// `reset`).
    #[error("the rate-limit store cannot {0}")]
    Unsupported(&'static str),
    /// The store is out of memory and does not track this client yet (a
    /// Redis at `maxmemory` with nothing to evict): the layer limits the
    /// request in the process, at each policy's local share, whatever its
    /// fail mode but closed (a policy failing closed answers `503`). The
    /// store still answers, and still decides the clients it
    /// tracks, so a circuit breaker does not count this as a failure.
    #[error("rate-limit store is full and does not track this client: {0}")]
    Full(String),
}

impl StoreError {
    /// A backend failure of `source`: an error, or a message.
    ///
    /// ```
    /// use slidegate::store::StoreError;
    ///
    /// let error = StoreError::backend("connection reset");
    /// assert_eq!(error.to_string(), "rate-limit store failed: connection reset");
    /// ```
    pub fn backend(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Backend(Arc::from(source.into()))
    }
}
