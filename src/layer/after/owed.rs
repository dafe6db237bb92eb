//! [`Owed`]: what an admitted request owes the store once its response
//! says how the call went and its body ends. Units of policies that count
//! some responses only ([`Count`]) come back when the response should not
//! count; concurrency leases are released when the body ends (or is
//! dropped); reservations of policies settled after the response are
//! replaced then by what the request reported it cost. None is waited
//! for: a store across the network is told on a task of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, StatusCode};
use smallvec::SmallVec;

use crate::headers::{HeaderFormat, RateHeaders};
use crate::layer::after::connection::{ConnectionLease, Upgrade};
use crate::layer::after::max_unsettled::Place;
use crate::layer::after::recorded::{Recorded, report_refund, report_release};
use crate::layer::after::usage::{InForce, Usage};
use crate::policy::{Algorithm, Count, Policies, Settlement};
use crate::store::Checks;
use crate::store::closest_to_denying;
use crate::store::micros;
use crate::store::{Check, Decision, Decisions, Store};

/// What an admitted request owes the store: refunds that wait for the
/// response's status, and leases that wait for its body's end.
pub(crate) struct Owed(Box<Debts>);

struct Debts {
    /// Units given back if the response should not count them.
    refunds: Recorded,
    /// What each of `refunds` counts, and where it is among the request's
    /// checks (its place in the headers).
    counts: SmallVec<[(Count, usize); 2]>,
    /// Released when the body ends or is dropped, or held by the
    /// connection the response upgrades.
    leases: Recorded,
    /// The upgrade the request asks for, when it holds leases.
    upgrade: Option<Upgrade>,
    /// Reservations replaced by what the request cost, once the body
    /// ends or is dropped and the handler lets go of its handle.
    settled: Option<Usage>,
    /// The same units in the local counts (see
    /// [`LocalLimits`](crate::layer::remembered::local_fallback::LocalLimits)), given back with these.
    local: Option<Owed>,
    /// What the headers were written from; `None` when none are sent.
    headers: Option<HeaderSource>,
}

/// How each of a request's checks is settled, when some check's is after
/// the response, and where the settlement finds its policy as it is when
/// it lands.
pub(crate) struct Settlements<'a> {
    pub(crate) of: &'a [Option<Settlement>],
    pub(crate) policies: &'a Arc<ArcSwap<Policies>>,
    pub(crate) tier: Option<&'a str>,
    /// Each settled reservation's place among its client's unsettled ones,
    /// by check (empty when none is taken).
    pub(crate) places: Places,
    /// The instances the limits are shared by: local counts settle that
    /// share of the cost reported (1 for the store's).
    pub(crate) share: u32,
}

/// A request's places among its clients' unsettled reservations, by
/// check.
pub(crate) type Places = SmallVec<[Option<Place>; 2]>;

/// What a request's rate-limit headers are written from, to write them
/// again with refunded units.
pub(crate) struct HeaderSource {
    pub(crate) checks: Checks,
    pub(crate) decisions: Decisions,
    /// When the store decided: the resets count down from then.
    pub(crate) decided: Instant,
    pub(crate) ietf_policy: Option<HeaderValue>,
    pub(crate) format: HeaderFormat,
}

impl Owed {
    /// What an admitted request owes `store` for `checks` and their
    /// `decisions`: each lease, when `counts` says some checks count some
    /// responses only, their units, and when `settlements` says some are
    /// settled after the response, their reservations; with what `local`
    /// owes the local counts. `None` when it owes nothing. `headers` says
    /// what the headers are written from, when they are and units may
    /// come back.
    pub(crate) fn of(
        store: &Arc<dyn Store>,
        checks: &[Check],
        decisions: &[Decision],
        (counts, mut settlements): (Option<&[Count]>, Option<Settlements<'_>>),
        local: Option<Self>,
        headers: impl FnOnce() -> Option<HeaderSource>,
    ) -> Option<Self> {
        let mut debts: Option<Box<Debts>> = None;
        let new = || {
            Box::new(Debts {
                refunds: Recorded::new(store),
                counts: SmallVec::new(),
                leases: Recorded::new(store),
                upgrade: None,
                settled: None,
                local: None,
                headers: None,
            })
        };
        for (position, (check, decision)) in checks.iter().zip(decisions).enumerate() {
            let Some(at) = decision.recorded_at() else {
                continue;
            };
            let count = counts.map_or(Count::All, |counts| counts[position]);
            let settlement = settlements
                .as_mut()
                .and_then(|settlements| Some((settlements.of[position].as_ref()?, settlements)));
            if let Some((settlement, settlements)) = settlement {
                let place = settlements.places.get_mut(position).and_then(Option::take);
                debts
                    .get_or_insert_with(new)
                    .settled
                    .get_or_insert_with(|| {
                        let in_force = InForce {
                            policies: settlements.policies.clone(),
                            tier: settlements.tier.map(Arc::from),
                        };
                        Usage::settling(store, in_force)
                    })
                    .reserve(check, at, settlement, place, settlements.share);
            } else if check.algorithm() == Algorithm::Concurrency {
                // A lease goes back when the body ends, whatever it says.
                debts.get_or_insert_with(new).leases.push(check, at);
            } else if count != Count::All {
                let debts = debts.get_or_insert_with(new);
                debts.refunds.push_refund(check, decision, at);
                debts.counts.push((count, position));
            }
        }
        let mut debts = debts?;
        if !debts.refunds.is_empty() {
            // The local counts give their units back with the store's, and
            // keep them when the store keeps its own.
            debts.local = local;
            debts.headers = headers();
        }
        Some(Self(debts))
    }

    /// The leases of an upgrade request admitted without them, its store
    /// unreachable and its policies failing open: handed to the upgraded
    /// connection like any, and taken when a renewal reaches the store,
    /// within their limits, or else withdrawn (see
    /// [`ConnectionLease::withdrawn`](crate::layer::ConnectionLease::withdrawn)),
    /// so that sockets opened during an outage count once it ends. `None`
    /// unless the request asks for an upgrade and some check is a lease.
    pub(crate) fn untaken_leases(
        store: &Arc<dyn Store>,
        checks: &[Check],
        parts: &Parts,
    ) -> Option<Self> {
        let leases = || {
            checks
                .iter()
                .filter(|check| check.algorithm() == Algorithm::Concurrency)
        };
        leases().next()?;
        let upgrade = Upgrade::of(parts)?;
        let mut taken = Recorded::new(store);
        for check in leases() {
            // A lease id of its own: the failed check's id may have been
            // released (a tombstone), which a renewal would not take.
            let mut lease = check.clone();
            lease.id = crate::store::next_id();
            taken.push(&lease, Duration::ZERO);
        }
        Some(Self(Box::new(Debts {
            refunds: Recorded::new(store),
            counts: SmallVec::new(),
            leases: taken,
            upgrade: Some(upgrade),
            settled: None,
            local: None,
            headers: None,
        })))
    }

    /// The handle the request's handler reports its cost on, when a
    /// policy settles after the response.
    pub(crate) fn usage(&self) -> Option<&Usage> {
        self.0.settled.as_ref()
    }

    /// Marks the request as asking for the upgrade `parts` asks for, if
    /// any, when it holds leases: an upgraded connection holds them.
    pub(crate) fn for_upgrade(&mut self, parts: &Parts) {
        if !self.0.leases.is_empty() {
            self.0.upgrade = Upgrade::of(parts);
        }
    }

    /// The handle an upgraded connection holds its leases by, when the
    /// request asks for an upgrade and holds leases.
    pub(crate) fn connection_lease(&self) -> Option<&ConnectionLease> {
        self.0.upgrade.as_ref().map(Upgrade::lease)
    }

    /// Reads the response's head: a response that upgrades the connection
    /// hands the leases to it, and the reservations whose usage headers
    /// it holds are settled at once.
    pub(crate) fn on_head(&mut self, status: StatusCode, headers: &HeaderMap) {
        let debts = &mut *self.0;
        if let Some(upgrade) = debts.upgrade.take()
            && upgrade.upgrades(status)
        {
            let none = Recorded::new(debts.leases.store());
            upgrade.hold(std::mem::replace(&mut debts.leases, none));
        }
        if let Some(usage) = &self.0.settled {
            usage.read_head(headers);
        }
    }

    /// Reads the costs that usage headers report in the response's
    /// trailers.
    pub(crate) fn on_headers(&mut self, headers: &HeaderMap) {
        if let Some(usage) = &self.0.settled {
            usage.read(headers);
        }
    }

    /// Whether some reservation waits for a usage header, which trailers
    /// may bring.
    pub(crate) fn reads_headers(&self) -> bool {
        self.0.settled.as_ref().is_some_and(Usage::reads_headers)
    }

    /// Whether some units wait for the response's status (the local
    /// counts' are attached only beside the store's, and settled with
    /// them).
    pub(crate) fn awaits_status(&self) -> bool {
        !self.0.refunds.is_empty()
    }

    /// Gives back the units a response that `failed` (or succeeded) does
    /// not count, once: the headers that say so, if any came back. The
    /// leases stay until the body ends.
    pub(crate) fn on_status(&mut self, failed: bool) -> Option<RateHeaders> {
        let debts = &mut *self.0;
        if let Some(local) = &mut debts.local {
            let _ = local.on_status(failed);
        }
        let mut refunded = SmallVec::<[usize; 2]>::new();
        let mut back = Recorded::new(debts.refunds.store());
        for ((check, &at), &(count, position)) in debts
            .refunds
            .checks()
            .iter()
            .zip(debts.refunds.times())
            .zip(&debts.counts)
        {
            if !count.counts(failed) {
                back.push(check, at);
                refunded.push(position);
            }
        }
        // Settled: what is not given back now stays counted.
        debts.refunds.keep();
        debts.counts.clear();
        // A refund already known to have failed leaves the units counted,
        // and the headers as they were.
        if back.is_empty() || back.give_back(report_refund) {
            return None;
        }
        debts
            .headers
            .take()
            .map(|headers| headers.refunded(&refunded))
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        self.0.leases.give_back(report_release);
        // The settlement runs once the handler's handles are gone too.
        self.0.settled = None;
    }
}

impl HeaderSource {
    /// The headers, with the units of the checks at `refunded` given back,
    /// and every reset as of now.
    fn refunded(mut self, refunded: &[usize]) -> RateHeaders {
        let since = self.decided.elapsed();
        for decision in self.decisions.iter_mut() {
            decision.reset_us = micros(decision.reset().saturating_sub(since));
        }
        for &index in refunded {
            let decision = &mut self.decisions[index];
            let cost = self.checks[index].cost;
            decision.remaining = decision
                .remaining()
                .saturating_add(cost)
                .min(decision.limit());
            if decision.remaining() == decision.limit() {
                decision.reset_us = 0;
            }
        }
        let reported = closest_to_denying(&self.checks, &self.decisions);
        RateHeaders::admitted(
            &self.checks,
            &self.decisions,
            reported,
            self.ietf_policy.as_ref(),
            self.format,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::HeaderMap;

    use super::*;
    use crate::Policy;
    use crate::headers::{HeaderStyle, ResetFormat};
    use crate::key::Key;

    #[test]
    fn refunded_units_come_back_in_the_headers_of_their_own_check() {
        let minute = Duration::from_secs(60);
        let key = Key::new("client");
        let checks: Checks = [
            Check::new(&Policy::new("all", 10, minute), key.clone()).unwrap(),
            Check::new(&Policy::new("failures", 3, minute), key.clone()).unwrap(),
            Check::new(&Policy::new("hourly", 100, minute * 60), key).unwrap(),
        ]
        .into_iter()
        .collect();
        let decisions: Decisions = [
            Decision::new_admitted(10, 5, Duration::from_secs(30)),
            Decision::new_admitted(3, 1, Duration::from_secs(50)),
            Decision::new_admitted(100, 2, Duration::from_secs(3000)),
        ]
        .into();
        let source = |decisions: &Decisions| HeaderSource {
            checks: checks.clone(),
            decisions: decisions.clone(),
            decided: Instant::now(),
            ietf_policy: None,
            format: HeaderFormat {
                style: HeaderStyle::Both,
                reset: ResetFormat::DeltaSeconds,
            },
        };
        let written = |headers: RateHeaders| {
            let mut map = HeaderMap::new();
            headers.write(&mut map);
            let text = |name: &str| map[name].to_str().unwrap().to_owned();
            (
                text("x-ratelimit-remaining"),
                text("x-ratelimit-reset"),
                text("ratelimit"),
            )
        };

        // The second check's unit comes back: it no longer reports.
        let (remaining, reset, state) = written(source(&decisions).refunded(&[1]));
        assert_eq!((remaining.as_str(), reset.as_str()), ("2", "3000"));
        assert_eq!(
            state,
            "\"all\";r=5;t=30, \"failures\";r=2;t=50, \"hourly\";r=2;t=3000"
        );

        // Given back to a full count, nothing is counted: a reset of 0.
        let mut full = decisions.clone();
        full[1].remaining = 2;
        full[2].remaining = 50;
        let (remaining, reset, state) = written(source(&full).refunded(&[1]));
        assert_eq!((remaining.as_str(), reset.as_str()), ("3", "0"));
        assert!(state.contains("\"failures\";r=3;t=0"), "{state}");
    }
}
