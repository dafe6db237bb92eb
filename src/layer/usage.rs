//! [`Usage`]: where a handler reports what a request cost, for policies
//! that settle their costs after the response, and the settlement that
//! runs once the response and the handler are done with it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderMap, HeaderName};
use smallvec::SmallVec;
use tokio::sync::{OwnedRwLockReadGuard, RwLock};

use crate::layer::background::{in_background_on, spawn_on};
use crate::layer::recorded::Recorded;
use crate::layer::unsettled::Place;
use crate::policy::cost::Checks;
use crate::policy::{Policies, Settlement};
use crate::store::{Check, CheckFuture, Store, StoreError};
use crate::throttle::SETTLE_FAILURES;

/// No value reported yet.
const UNSET: u64 = u64::MAX;

/// What a request cost, as its handler reports it, for the policies that
/// settle their costs after the response
/// ([`Policy::settled_after_response`](crate::Policy::settled_after_response)).
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
/// meanwhile. A stream that goes
/// away before its end is charged what it reported by then, so report as
/// you go ([`add`](Self::add)) rather than once at the end. Units charged
/// as they came are not given back if a later [`set`](Self::set) reports
/// less.
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
            settled.reserved.push(check, at);
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

/// Reservations of policies settled after the response, replaced by what
/// the request reported it cost: per reservation, the value of the header
/// or trailer its policy names, else the handle's. A reservation with
/// neither stands.
#[derive(Debug)]
struct Settled {
    reserved: Recorded,
    /// Per reservation, what was reported of it.
    reported: SmallVec<[Reported; 2]>,
    in_force: InForce,
    /// The runtime the request ran on, to settle on when the last handle
    /// is dropped on a thread of none.
    runtime: Option<tokio::runtime::Handle>,
    /// When the handle's reports were last charged as they came.
    charged_at: Option<std::time::Instant>,
    /// Held for reading by each charge on its way, and for writing by the
    /// settlement before it counts what the charges landed.
    charging: Arc<RwLock<()>>,
}

/// What was reported of one reservation.
#[derive(Debug)]
struct Reported {
    /// The header or trailer its policy reads.
    header: Option<HeaderName>,
    /// The instances its count is shared by: it counts this share of
    /// what is reported (1 but in local counts).
    share: u32,
    /// The integer last found in it.
    value: Option<u64>,
    /// Units charged alone past the reservation as the handle reported
    /// them, before the settlement (see `charge_past_reservations`): sent,
    /// and landed.
    sent: u64,
    charged: Arc<AtomicU64>,
    /// Its place among its client's unsettled reservations, held until
    /// it is settled.
    _place: Option<Place>,
}

/// How often a handle's reports are charged as they come, at most.
const CHARGE_EVERY: Duration = Duration::from_secs(1);

/// The policies in force, which a reload may replace while a request
/// runs, and the client's tier: a settlement is charged to its policy as
/// it counts when the settlement lands.
#[derive(Debug)]
pub(crate) struct InForce {
    pub(crate) policies: Arc<ArcSwap<Policies>>,
    pub(crate) tier: Option<Arc<str>>,
}

impl InForce {
    /// The check of `reserved`'s policy for its client as the policy
    /// counts now, when a reload has made it count by another algorithm,
    /// in other keys: the reservation's keys are no longer read, so the
    /// cost goes to these. `None` when it counts as it did, or has gone.
    fn recounted(&self, reserved: &Check) -> Option<Check> {
        let policies = self.policies.load();
        let policy = policies
            .iter()
            .find(|policy| policy.name() == &*reserved.policy)?;
        let mut now = Check::of_valid(policy, reserved.key.clone(), self.tier.as_deref());
        if now.algorithm == reserved.algorithm {
            return None;
        }
        now.namespace.clone_from(&reserved.namespace);
        Some(now)
    }
}

impl Settled {
    fn read(&mut self, headers: &HeaderMap) {
        for reported in &mut self.reported {
            let name = &reported.header;
            let Some(value) = name.as_ref().and_then(|name| headers.get(name)) else {
                continue;
            };
            match units_in(value.as_bytes()) {
                Some(units) => reported.value = Some(units),
                None => {
                    if let Some(held_back) = SETTLE_FAILURES.admit() {
                        tracing::warn!(
                            header = name.as_ref().map(HeaderName::as_str),
                            held_back,
                            "usage header holds no whole number; the handle's value, or else the reservation, stands"
                        );
                    }
                }
            }
        }
    }

    /// Charges alone, on each reservation its policy takes from the handle
    /// (no usage header), what `units` (the handle's value) is past the
    /// reservation and what was charged so far; at most once per
    /// `CHARGE_EVERY`. The settlement then counts the rest.
    fn charge_past_reservations(&mut self, units: u64) {
        let now = std::time::Instant::now();
        if self
            .charged_at
            .is_some_and(|at| now.duration_since(at) < CHARGE_EVERY)
        {
            return;
        }
        // Only the settlement takes the lock for writing, and after it
        // nothing is charged.
        let Ok(turn) = self.charging.clone().try_read_owned() else {
            return;
        };
        let store = self.reserved.store().clone();
        let mut charges = Recorded::new(&store);
        let mut costs = SmallVec::<[u64; 2]>::new();
        let mut charged = SmallVec::new();
        for (check, reported) in self.reserved.checks().iter().zip(&mut self.reported) {
            let units = units.div_ceil(u64::from(reported.share));
            let counted = u64::from(check.cost).saturating_add(reported.sent);
            // A policy reloaded as another algorithm since is charged in
            // whole by its settlement, where it counts now.
            if reported.header.is_none()
                && units > counted
                && self.in_force.recounted(check).is_none()
            {
                charges.push(check, Duration::ZERO);
                costs.push(units - counted);
                charged.push(reported.charged.clone());
                reported.sent += units - counted;
            }
        }
        if charges.is_empty() {
            return;
        }
        self.charged_at = Some(now);
        let turn = Turn::Charge {
            charged,
            _held: turn,
        };
        Sent::new(store, &charges, costs, turn).send(self.runtime.as_ref());
    }

    /// Settles at once the reservations whose usage header the
    /// response's head reported: they are charged when the head passes,
    /// whatever becomes of the body (a client that holds an HTTP/2 stream
    /// open, its flow-control window shut, holds no reservation).
    fn settle_reported(&mut self) {
        self.settle_where(|reported| reported, false);
    }

    /// Replaces each reservation that has a reported cost other than its
    /// own by it, `handle` the handle's last value.
    fn settle(&mut self, handle: Option<u64>) {
        self.settle_where(|reported| reported.or(handle), true);
    }

    /// Settles the reservations with a cost `cost_of` finds from their
    /// header's value, and forgets them; with `all`, the rest too (their
    /// reservations stand). A reservation whose policy a reload has made
    /// count by another algorithm since is given back where it was
    /// counted, and its cost (else the reservation's) charged as the
    /// policy counts now.
    fn settle_where(&mut self, cost_of: impl Fn(Option<u64>) -> Option<u64>, all: bool) {
        let store = self.reserved.store().clone();
        let mut settled = Recorded::new(&store);
        let mut moved = Recorded::new(&store);
        let mut waiting = Recorded::new(&store);
        let mut still_reported = SmallVec::new();
        let mut costs = SmallVec::<[u64; 2]>::new();
        let mut charged = SmallVec::new();
        let reserved = self.reserved.checks().iter().zip(self.reserved.times());
        for ((check, &at), reported) in reserved.zip(self.reported.drain(..)) {
            let cost = cost_of(reported.value).map(|cost| cost.div_ceil(u64::from(reported.share)));
            if cost.is_none() && !all {
                waiting.push(check, at);
                still_reported.push(reported);
            } else if let Some(now) = self.in_force.recounted(check) {
                moved.push(check, at);
                // No units to take back in the new keys: a charge alone.
                settled.push(&now, Duration::ZERO);
                costs.push(cost.unwrap_or(u64::from(check.cost)));
                charged.push(None);
            } else if let Some(cost) =
                cost.filter(|&cost| reported.sent > 0 || cost != u64::from(check.cost))
            {
                // The reservation is replaced by what the charges as the
                // handle reported did not land (a cost reported below
                // what was is not given back). A cost equal to the
                // reservation, with nothing charged: no call.
                settled.push(check, at);
                costs.push(cost);
                charged.push(Some(reported.charged));
            }
        }
        self.reserved = waiting;
        self.reported = still_reported;
        if !moved.is_empty() {
            let answer = store.refund(moved.checks(), moved.times());
            in_background_on(self.runtime.as_ref(), answer, report_settlement);
        }
        if settled.is_empty() {
            return;
        }
        let turn = Turn::Settle {
            lock: self.charging.clone(),
            charged,
        };
        Sent::new(store, &settled, costs, turn).send(self.runtime.as_ref());
    }
}

/// A settlement (or charges as a handle reports) sent to a store, kept
/// to send again while the store cannot be reached.
struct Sent {
    store: Arc<dyn Store>,
    checks: Checks,
    times: SmallVec<[Duration; 2]>,
    costs: SmallVec<[u64; 2]>,
    turn: Turn,
}

/// How a settlement waits for the charges of its request on their way,
/// so that each counts once: what one landed is taken from the
/// settlement's cost, and what one did not land stays in it (one that
/// timed out may have landed all the same, and then counts twice).
enum Turn {
    /// Charges as the handle reported: each cost, once it lands, is
    /// added to what its reservation was charged. They hold their
    /// request's lock for reading until answered.
    Charge {
        charged: SmallVec<[Arc<AtomicU64>; 2]>,
        _held: OwnedRwLockReadGuard<()>,
    },
    /// A settlement, sent once it holds the lock for writing: each cost
    /// less what charges landed on its reservation (none for one moved
    /// to the keys of another algorithm).
    Settle {
        lock: Arc<RwLock<()>>,
        charged: SmallVec<[Option<Arc<AtomicU64>>; 2]>,
    },
}

/// How many times a settlement is sent at most, and the wait before the
/// second: doubled each time, to at most `SETTLE_RETRY_MOST`. About a
/// minute in all.
const SETTLE_ATTEMPTS: u32 = 16;
const SETTLE_RETRY: Duration = Duration::from_millis(100);
const SETTLE_RETRY_MOST: Duration = Duration::from_secs(5);

impl Sent {
    fn new(
        store: Arc<dyn Store>,
        recorded: &Recorded,
        costs: SmallVec<[u64; 2]>,
        turn: Turn,
    ) -> Self {
        Self {
            store,
            checks: recorded.checks().iter().cloned().collect(),
            times: recorded.times().iter().copied().collect(),
            costs,
            turn,
        }
    }

    /// Sends the settlement: at once to a store in process; otherwise on
    /// the current runtime, or else `runtime`, sent again while the store
    /// cannot be reached (see [`until_answered`](Self::until_answered)),
    /// an open circuit breaker's answer at once included.
    fn send(mut self, runtime: Option<&tokio::runtime::Handle>) {
        if let Turn::Settle { lock, .. } = &self.turn {
            if lock.try_write().is_err() {
                let lock = lock.clone();
                let settled = async move {
                    drop(lock.write().await);
                    self.less_landed();
                    let first = self.store.settle(&self.checks, &self.times, &self.costs);
                    self.until_answered(first).await;
                };
                if let Err(no_runtime) = spawn_on(runtime, settled) {
                    report_settlement(Err(no_runtime));
                }
                return;
            }
            self.less_landed();
        }
        let answer = self.store.settle(&self.checks, &self.times, &self.costs);
        let first = match answer.into_ready() {
            Ok(Err(error)) if retried(&error) => CheckFuture::ready(Err(error)),
            Ok(outcome) => return self.done(outcome),
            Err(later) => later,
        };
        if let Err(no_runtime) = spawn_on(runtime, self.until_answered(first)) {
            report_settlement(Err(no_runtime));
        }
    }

    /// Takes from each cost of a settlement what the charges as the
    /// handle reported landed.
    fn less_landed(&mut self) {
        let Turn::Settle { charged, .. } = &self.turn else {
            return;
        };
        for (cost, charged) in self.costs.iter_mut().zip(charged) {
            if let Some(charged) = charged {
                *cost = cost.saturating_sub(charged.load(Ordering::Acquire));
            }
        }
    }

    /// Counts what landed, and warns of what did not.
    fn done(&self, outcome: Result<(), StoreError>) {
        if let (Ok(()), Turn::Charge { charged, .. }) = (&outcome, &self.turn) {
            for (charged, units) in charged.iter().zip(&self.costs) {
                charged.fetch_add(*units, Ordering::AcqRel);
            }
        }
        report_settlement(outcome);
    }

    /// Waits for `first`, the settlement's first answer, and sends it
    /// again while the store could not be reached (it failed, or its
    /// circuit breaker is open), until it is taken or about a minute has
    /// passed: a settlement lost to an outage would leave a client that
    /// reported more than its reservation charged the reservation alone.
    /// One that timed out is not sent again: it may well have landed, and
    /// sent twice it would be charged twice.
    async fn until_answered(self, first: CheckFuture<()>) {
        let mut outcome = first.await;
        let mut wait = SETTLE_RETRY;
        for _ in 1..SETTLE_ATTEMPTS {
            match &outcome {
                Err(error) if retried(error) => {}
                _ => break,
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(SETTLE_RETRY_MOST);
            outcome = self
                .store
                .settle(&self.checks, &self.times, &self.costs)
                .await;
        }
        self.done(outcome);
    }
}

/// Whether a settlement that failed with `error` is sent again: the store
/// could not be reached, or its breaker is open. One that timed out may
/// have landed, and is not.
fn retried(error: &StoreError) -> bool {
    matches!(error, StoreError::Backend(_) | StoreError::CircuitOpen)
}

/// The whole number `value` holds (ASCII digits, spaces around them):
/// past `u64::MAX`, that.
fn units_in(value: &[u8]) -> Option<u64> {
    let digits = value.trim_ascii();
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0_u64, |units, digit| {
        units
            .saturating_mul(10)
            .saturating_add(u64::from(digit - b'0'))
    }))
}

/// Warns of a settlement that failed: one that timed out may still land;
/// one that failed otherwise (after its retries) leaves the reservation
/// counted instead of the cost reported.
fn report_settlement(outcome: Result<(), StoreError>) {
    let Err(error) = outcome else {
        return;
    };
    let Some(held_back) = SETTLE_FAILURES.admit() else {
        return;
    };
    if matches!(error, StoreError::Timeout(_)) {
        tracing::warn!(%error, held_back, "rate-limit settlement timed out; it may still land (it is not sent again, which could count it twice)");
    } else {
        tracing::warn!(%error, held_back, "rate-limit settlement failed; the reservation stays counted instead of the cost reported");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_headers_hold_whole_numbers() {
        assert_eq!(units_in(b" 42 "), Some(42));
        assert_eq!(units_in(b"99999999999999999999999"), Some(u64::MAX));
        for bad in [&b""[..], b"-5", b"1e6", b"12.0", b"lots", b"\xff"] {
            assert_eq!(units_in(bad), None, "{bad:?}");
        }
    }
}
