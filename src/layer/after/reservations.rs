//! What a request admitted under policies settled after the response
//! reserved, what was reported of each reservation (a header, a trailer or
//! the [`Usage`](crate::Usage) handle), and how it is settled.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderMap, HeaderName};
use smallvec::SmallVec;
use tokio::sync::RwLock;

use crate::layer::after::max_unsettled::Place;
use crate::layer::after::recorded::Recorded;
use crate::layer::after::sending::{Sent, Turn, report_settlement};
use crate::log_lines::SETTLE_FAILURES;
use crate::policy::Policies;
use crate::store::background::in_background_on;
use crate::store::{Check, Store};

/// Reservations of policies settled after the response, replaced by what
/// the request reported it cost: per reservation, the value of the header
/// or trailer its policy names, else the handle's. A reservation with
/// neither stands.
#[derive(Debug)]
pub(crate) struct Settled {
    pub(crate) reserved: Recorded,
    /// Per reservation, what was reported of it.
    pub(crate) reported: SmallVec<[Reported; 2]>,
    pub(crate) in_force: InForce,
    /// The runtime the request ran on, to settle on when the last handle
    /// is dropped on a thread of none.
    pub(crate) runtime: Option<tokio::runtime::Handle>,
    /// When the handle's reports were last charged as they came.
    pub(crate) charged_at: Option<std::time::Instant>,
    /// Held for reading by each charge on its way, and for writing by the
    /// settlement before it counts what the charges landed.
    pub(crate) charging: Arc<RwLock<()>>,
}

/// What was reported of one reservation.
#[derive(Debug)]
pub(crate) struct Reported {
    /// The header or trailer its policy reads.
    pub(crate) header: Option<HeaderName>,
    /// The instances its count is shared by: it counts this share of
    /// what is reported (1 but in local counts).
    pub(crate) share: u32,
    /// The integer last found in it.
    pub(crate) value: Option<u64>,
    /// Units charged alone past the reservation as the handle reported
    /// them, before the settlement (see `charge_past_reservations`): sent,
    /// and landed.
    pub(crate) sent: u64,
    pub(crate) charged: Arc<AtomicU64>,
    /// Its place among its client's unsettled reservations, held until
    /// it is settled.
    pub(crate) _place: Option<Place>,
}

/// How often a handle's reports are charged as they come, at most.
pub(crate) const CHARGE_EVERY: Duration = Duration::from_secs(1);

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
    pub(crate) fn recounted(&self, reserved: &Check) -> Option<Check> {
        let policies = self.policies.load();
        let policy = policies
            .iter()
            .find(|policy| policy.name() == &**reserved.policy())?;
        let mut now = Check::of_limits(
            policy,
            &reserved.key,
            policy.limits_for(self.tier.as_deref()),
        );
        if now.algorithm() == reserved.algorithm() {
            return None;
        }
        now.namespace.clone_from(&reserved.namespace);
        Some(now)
    }
}

impl Settled {
    pub(crate) fn read(&mut self, headers: &HeaderMap) {
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
    pub(crate) fn charge_past_reservations(&mut self, units: u64) {
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
    pub(crate) fn settle_reported(&mut self) {
        self.settle_where(|reported| reported, false);
    }

    /// Replaces each reservation that has a reported cost other than its
    /// own by it, `handle` the handle's last value.
    pub(crate) fn settle(&mut self, handle: Option<u64>) {
        self.settle_where(|reported| reported.or(handle), true);
    }

    /// Settles the reservations with a cost `cost_of` finds from their
    /// header's value, and forgets them; with `all`, the rest too (their
    /// reservations stand). A reservation whose policy a reload has made
    /// count by another algorithm since is given back where it was
    /// counted, and its cost (else the reservation's) charged as the
    /// policy counts now.
    pub(crate) fn settle_where(&mut self, cost_of: impl Fn(Option<u64>) -> Option<u64>, all: bool) {
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

/// The whole number `value` holds (ASCII digits, spaces around them):
/// past `u64::MAX`, that.
pub(crate) fn units_in(value: &[u8]) -> Option<u64> {
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
