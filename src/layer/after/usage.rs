//! [`Usage`]: where a handler reports what a request cost, for policies
//! that settle their costs after the response, and the settlement that
//! runs once the response and the handler are done with it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use http::HeaderMap;
use smallvec::SmallVec;

use crate::layer::after::max_unsettled::Place;
use crate::layer::after::recorded::Recorded;
pub(crate) use crate::layer::after::reservations::InForce;
use crate::layer::after::reservations::{Reported, Settled};
use crate::policy::Settlement;
use crate::store::{Check, Store};

/// No value reported yet.
const UNSET: u64 = u64::MAX;

/// What a request cost, as its handler reports it, for the policies that
/// settle their costs after the response
/// ([`Policy::with_settlement`](crate::Policy::with_settlement)).
///
/// The layer puts one in the request's extensions when such a policy
/// admitted the request (a request the store failed open on has none, so
/// take it as an `Option`). The handler, or its response stream, reports
/// the cost on it, and the request is settled at the last value reported
/// once its response body has ended (or was dropped) and every clone of
/// the handle is gone: a task that goes on generating after the client
/// left (a thread of no runtime too) is charged what it reports until it
/// lets go. What is reported past the reservation is charged as it comes,
/// at most once a second, not only at the end, so a request that runs long
/// (a client that holds its body back) spends no more than it reports
/// meanwhile. A stream that goes away before its end is charged what it
/// reported by then, so report as you go ([`add`](Self::add)) rather than
/// once at the end; a request that reports nothing keeps its reservation.
/// Units charged as they came are not given back if a later
/// [`set`](Self::set) reports less. A response header the policy names
/// ([`Policy::with_usage_header`](crate::Policy::with_usage_header)) wins
/// over the handle. How an overdraft counts, and how to bound it, is on
/// [`Policy::with_settlement`](crate::Policy::with_settlement).
///
/// ```
/// use axum::{Extension, routing::post, Router};
/// use slidegate::Usage;
///
/// async fn complete(usage: Option<Extension<Usage>>) -> &'static str {
///     let tokens = 42; // what the model generated
///     if let Some(Extension(usage)) = usage {
///         usage.set(tokens);
///     }
///     "done"
/// }
///
/// let app: Router = Router::new().route("/complete", post(complete));
/// ```
///
/// A policy of 100,000 tokens a minute reserving 500 a completion, and a
/// handler whose stream reports its tokens as it sends them:
///
/// ```rust
/// use axum::{Extension, body::Body};
/// use slidegate::{Policy, Usage};
/// use std::time::Duration;
///
/// let tokens = Policy::new("tokens", 100_000, Duration::from_secs(60))
///     .with_cost(500)
///     .with_settlement(true);
///
/// // The handler: a stream that reports its tokens as it sends them.
/// async fn complete(usage: Option<Extension<Usage>>) -> Body {
///     use futures_util::StreamExt;
///
///     // Each chunk is reported as the body is polled for it, not before.
///     let chunks = futures_util::stream::iter(["Once ", "upon ", "a time"]).map(move |chunk| {
///         if let Some(Extension(usage)) = &usage {
///             usage.add(1);
///         }
///         Ok::<_, std::convert::Infallible>(chunk)
///     });
///     Body::from_stream(chunks)
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Usage(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    units: AtomicU64,
    /// The reservations to settle, for a handle the layer made.
    settled: Mutex<Option<Settled>>,
    /// The handle of an outer layer that settles too: reports go to both.
    outer: OnceLock<Usage>,
}

impl Usage {
    /// A handle with nothing reported, and nothing to settle: the layer
    /// makes the ones it puts in requests. One made here serves to try a
    /// handler with.
    pub fn new() -> Self {
        Self::with(None)
    }

    fn with(settled: Option<Settled>) -> Self {
        Self(Arc::new(Shared {
            units: AtomicU64::new(UNSET),
            settled: Mutex::new(settled),
            outer: OnceLock::new(),
        }))
    }

    /// Reports that the request cost `units` in all.
    pub fn set(&self, units: u64) {
        self.0.units.store(units.min(UNSET - 1), Ordering::Relaxed);
        self.charge_as_reported();
        if let Some(outer) = self.0.outer.get() {
            outer.set(units);
        }
    }

    /// Reports `units` more than reported so far (from none, 0): for a
    /// stream that counts as it goes.
    pub fn add(&self, units: u64) {
        let _ = self
            .0
            .units
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                let before = if now == UNSET { 0 } else { now };
                Some(before.saturating_add(units).min(UNSET - 1))
            });
        self.charge_as_reported();
        if let Some(outer) = self.0.outer.get() {
            outer.add(units);
        }
    }

    /// Charges what the handle reports past what its reservations have
    /// counted so far, at most once per `CHARGE_EVERY`: a request that
    /// runs long (a stream, a task that goes on generating while its
    /// client holds the body back) is charged as it reports, not only at
    /// its end.
    fn charge_as_reported(&self) {
        let Some(units) = self.get() else {
            return;
        };
        if let Some(settled) = self.settled().as_mut() {
            settled.charge_past_reservations(units);
        }
    }

    /// The cost reported so far, if any.
    ///
    /// ```
    /// let usage = slidegate::Usage::new();
    /// assert_eq!(usage.get(), None);
    /// usage.add(3);
    /// usage.add(4);
    /// assert_eq!(usage.get(), Some(7));
    /// usage.set(5);
    /// assert_eq!(usage.get(), Some(5));
    /// ```
    pub fn get(&self) -> Option<u64> {
        let units = self.0.units.load(Ordering::Relaxed);
        (units != UNSET).then_some(units)
    }

    /// A handle that settles reservations on `store` (see
    /// [`reserve`](Self::reserve)) under the policies `in_force` when each
    /// settlement lands.
    pub(crate) fn settling(store: &Arc<dyn Store>, in_force: InForce) -> Self {
        Self::with(Some(Settled {
            reserved: Recorded::new(store),
            reported: SmallVec::new(),
            in_force,
            runtime: tokio::runtime::Handle::try_current().ok(),
            charged_at: None,
            charging: Arc::default(),
        }))
    }

    /// Adds the reservation of `check`, recorded at `at`, to settle as
    /// `settlement` says; `place`, its place among its client's unsettled
    /// reservations, is given back once it is settled. A check of local
    /// counts shared by `share` instances counts that share of the cost
    /// reported (1 for the store's).
    pub(crate) fn reserve(
        &self,
        check: &Check,
        at: Duration,
        settlement: &Settlement,
        place: Option<Place>,
        share: u32,
    ) {
        if let Some(settled) = self.settled().as_mut() {
            // Its settlement names it by an id of its own.
            settled
                .reserved
                .push(&check.clone().with_settlement_id(), at);
            settled.reported.push(Reported {
                header: settlement.header.clone(),
                share: share.max(1),
                value: None,
                sent: 0,
                charged: Arc::default(),
                _place: place,
            });
        }
    }

    /// Sends what is reported here to `outer` too: an outer layer's
    /// handle, which the request's extensions held before this one.
    pub(crate) fn report_to(&self, outer: Usage) {
        let _ = self.0.outer.set(outer);
    }

    /// Reads the integers of the usage headers among `headers` (a
    /// response's head or its trailers).
    pub(crate) fn read(&self, headers: &HeaderMap) {
        if let Some(settled) = self.settled().as_mut() {
            settled.read(headers);
        }
    }

    /// Reads the usage headers of a response's head, and settles at once
    /// the reservations they report the cost of.
    pub(crate) fn read_head(&self, headers: &HeaderMap) {
        if let Some(settled) = self.settled().as_mut() {
            settled.read(headers);
            settled.settle_reported();
        }
    }

    /// Whether some reservation waits for a usage header.
    pub(crate) fn reads_headers(&self) -> bool {
        self.settled()
            .as_ref()
            .is_some_and(|settled| settled.reported.iter().any(|r| r.header.is_some()))
    }

    fn settled(&self) -> MutexGuard<'_, Option<Settled>> {
        // A panic while holding the lock leaves the values as they were.
        self.0
            .settled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for Usage {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let settled = self
            .settled
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut settled) = settled {
            let units = *self.units.get_mut();
            settled.settle((units != UNSET).then_some(units));
        }
    }
}
