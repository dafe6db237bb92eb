//! What a request's checks do beyond counting, for plans that need it:
//! shadow policies, which decide without denying; policies that count
//! some responses only, whose units are refunded; and policies that fall
//! back to a local limit while the store is down.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderValue;
use smallvec::SmallVec;

use crate::layer::Options;
use crate::layer::background::in_background;
use crate::layer::body::released_unless_decided;
use crate::layer::local_fallback::LocalChecks;
use crate::policy::cost::Checks;
use crate::policy::plan::Plan;
use crate::policy::{Algorithm, Count, FailMode};
use crate::response::headers::{HeaderStyle, RateHeaders, ResetFormat, closest_to_denying};
use crate::store::{Check, CheckFuture, Decision, Decisions, Store};
use crate::throttle::REFUND_FAILURES;

/// The roles of one request's checks, in the order they are sent:
/// enforced checks first, shadow checks after.
#[derive(Debug)]
pub(crate) struct Roles {
    /// The index of the first shadow check.
    pub(crate) shadow_from: usize,
    /// What each check counts.
    counts: SmallVec<[Count; 2]>,
    /// The enforced checks that fall back to a local limit, at their share
    /// of it; `None` when no check does.
    local: Option<LocalChecks>,
}

impl Roles {
    /// The roles of `checks`, built from `plan`, which it puts in order;
    /// `None` when every check only counts (the common case).
    #[inline]
    pub(crate) fn assign(plan: &Plan, checks: &mut Checks, options: Options) -> Option<Box<Self>> {
        if !options.shadow && !plan.has_roles(options.fail_mode) {
            return None;
        }
        Some(Self::build(plan, checks, options))
    }

    fn build(plan: &Plan, checks: &mut Checks, options: Options) -> Box<Self> {
        let shadow = |check: &Check| {
            options.shadow
                || plan
                    .policy_of(check)
                    .is_some_and(|policy| policy.is_shadow())
        };
        // Stable: enforced checks keep their order, and so do shadow ones.
        checks.sort_by_key(shadow);
        let shadow_from = checks.iter().position(shadow).unwrap_or(checks.len());
        let policies = || checks.iter().map(|check| plan.policy_of(check));
        let counts: SmallVec<[Count; 2]> = policies()
            .map(|policy| policy.map_or(Count::All, |policy| policy.count()))
            .collect();
        let fail_modes: SmallVec<[FailMode; 2]> = policies()
            .map(|policy| {
                policy
                    .and_then(|policy| policy.fail_mode())
                    .unwrap_or(options.fail_mode)
            })
            .collect();
        let local = LocalChecks::of(
            &checks[..shadow_from],
            &fail_modes,
            &counts,
            options.local_share,
        );
        Box::new(Self {
            shadow_from,
            counts,
            local: (!local.is_empty()).then_some(local),
        })
    }

    /// Whether the checks are ordered otherwise than the plan's policies.
    pub(crate) fn reordered(&self, checks: usize) -> bool {
        self.shadow_from > 0 && self.shadow_from < checks
    }

    /// The enforced checks that fall back to a local limit, at their
    /// share of it (see [`LocalChecks::of`]), if any does.
    pub(crate) fn local(&self) -> Option<&LocalChecks> {
        self.local.as_ref()
    }

    /// What each check counts.
    pub(crate) fn counts(&self) -> &[Count] {
        &self.counts
    }
}

/// Sends `checks` to `store`, enforced ones first: the shadow checks (from
/// `shadow_from`) are sent once the enforced ones admit the request, as a
/// batch of their own. In one batch with the enforced checks a shadow
/// denial would deny the request, and a denied request counts nowhere.
/// The answer holds the enforced checks' decisions alone when they deny,
/// or when the shadow batch fails.
///
/// The leases of concurrency checks the answer leaves undecided (a call
/// that failed, a request dropped meanwhile) are released by their ids.
#[inline]
pub(crate) fn check(store: &Arc<dyn Store>, checks: &[Check], shadow_from: usize) -> CheckFuture {
    let answer = if shadow_from == 0 || shadow_from >= checks.len() {
        store.check(checks)
    } else {
        check_apart(store, checks, shadow_from)
    };
    released_unless_decided(store, checks, answer)
}

fn check_apart(store: &Arc<dyn Store>, checks: &[Check], shadow_from: usize) -> CheckFuture {
    let (enforced, shadow) = checks.split_at(shadow_from);
    let decided = match store.check(enforced).into_ready() {
        Ok(Ok(decisions)) => decisions,
        Ok(Err(error)) => return CheckFuture::ready(Err(error)),
        Err(later) => {
            let store = store.clone();
            let shadow: Checks = shadow.iter().cloned().collect();
            return CheckFuture::new(async move {
                let decisions = later.await?;
                Ok(with_shadow(&*store, decisions, &shadow).await)
            });
        }
    };
    if !decided.iter().all(|decision| decision.admitted) {
        return CheckFuture::ready(Ok(decided));
    }
    match store.check(shadow).into_ready() {
        Ok(outcome) => CheckFuture::ready(Ok(join(decided, outcome))),
        Err(later) => CheckFuture::new(async move { Ok(join(decided, later.await)) }),
    }
}

/// The enforced checks' decisions, and the shadow checks' after them if
/// the enforced ones admit the request.
async fn with_shadow(store: &dyn Store, decided: Decisions, shadow: &[Check]) -> Decisions {
    if !decided.iter().all(|decision| decision.admitted) {
        return decided;
    }
    join(decided, store.check(shadow).await)
}

fn join(mut decided: Decisions, shadow: Result<Decisions, crate::store::StoreError>) -> Decisions {
    match shadow {
        Ok(shadow) => decided.extend(shadow),
        Err(error) => tracing::debug!(%error, "shadow policies undecided"),
    }
    decided
}

/// The units to take back once the response shows that they should not
/// have counted, and the rate-limit headers to write instead when they
/// are.
pub(crate) struct Refund {
    store: Arc<dyn Store>,
    checks: Checks,
    recorded_at: SmallVec<[Duration; 2]>,
    counts: SmallVec<[Count; 2]>,
    /// Where each of `checks` is among the request's checks.
    positions: SmallVec<[usize; 2]>,
    /// The same units in the local counts, taken back with these.
    local: Option<Box<Refund>>,
    /// What the headers were written from; `None` when none are sent.
    headers: Option<HeaderSource>,
}

/// What a request's rate-limit headers are written from.
pub(crate) struct HeaderSource {
    pub(crate) checks: Checks,
    pub(crate) decisions: Decisions,
    /// When the store decided: the resets count down from then.
    pub(crate) decided: Instant,
    pub(crate) ietf_policy: Option<HeaderValue>,
    pub(crate) style: HeaderStyle,
    pub(crate) reset_format: ResetFormat,
}

impl HeaderSource {
    /// The headers, with the units of the checks at `refunded` given back,
    /// and every reset as of now.
    fn refunded(mut self, refunded: &[usize]) -> RateHeaders {
        let since = self.decided.elapsed();
        for decision in self.decisions.iter_mut() {
            decision.reset = decision.reset.saturating_sub(since);
        }
        for &index in refunded {
            let decision = &mut self.decisions[index];
            let cost = self.checks[index].cost;
            decision.remaining = decision.remaining.saturating_add(cost).min(decision.limit);
            if decision.remaining == decision.limit {
                decision.reset = Duration::ZERO;
            }
        }
        RateHeaders::new(
            &self.checks,
            &self.decisions,
            closest_to_denying(&self.decisions),
            None,
            self.ietf_policy.as_ref(),
            self.style,
            self.reset_format,
        )
    }
}

impl Refund {
    /// What `store` recorded for an admitted request that some of its
    /// checks count conditionally; `None` if every check counts it anyway.
    /// `headers` is what its headers are written from, when they are.
    pub(crate) fn of(
        store: &Arc<dyn Store>,
        checks: &[Check],
        decisions: &[Decision],
        counts: &[Count],
        headers: impl FnOnce() -> Option<HeaderSource>,
    ) -> Option<Box<Self>> {
        let mut refund = Self {
            store: store.clone(),
            checks: Checks::new(),
            recorded_at: SmallVec::new(),
            counts: SmallVec::new(),
            positions: SmallVec::new(),
            local: None,
            headers: None,
        };
        for (position, ((check, decision), &count)) in
            checks.iter().zip(decisions).zip(counts).enumerate()
        {
            // A lease goes back when the response ends, whatever it says.
            let leased = check.algorithm == Algorithm::Concurrency;
            if let (Some(at), false, false) = (decision.recorded_at, count == Count::All, leased) {
                refund.checks.push(check.clone());
                refund.recorded_at.push(at);
                refund.counts.push(count);
                refund.positions.push(position);
            }
        }
        if refund.checks.is_empty() {
            return None;
        }
        refund.headers = headers();
        Some(Box::new(refund))
    }

    /// This refund, taking back `local`'s units with its own.
    pub(crate) fn with_local(mut self: Box<Self>, local: Option<Box<Self>>) -> Box<Self> {
        self.local = local;
        self
    }

    /// Takes back the units of the checks that a response that `failed`
    /// (or succeeded) does not count, and gives the headers that say so, if
    /// any were taken back. A store that answers later does so on a task of
    /// its own: the response does not wait.
    pub(crate) fn settle(self, failed: bool) -> Option<RateHeaders> {
        if let Some(local) = self.local {
            let _ = local.settle(failed);
        }
        let mut checks = Checks::new();
        let mut recorded_at = SmallVec::<[Duration; 2]>::new();
        let mut refunded = SmallVec::<[usize; 2]>::new();
        for (((check, at), count), position) in self
            .checks
            .into_iter()
            .zip(self.recorded_at)
            .zip(self.counts)
            .zip(self.positions)
        {
            if !count.counts(failed) {
                checks.push(check);
                recorded_at.push(at);
                refunded.push(position);
            }
        }
        if checks.is_empty() {
            return None;
        }
        // A refund already known to have failed leaves the units counted,
        // and the headers as they were.
        if in_background(self.store.refund(&checks, &recorded_at), report) {
            return None;
        }
        self.headers.map(|headers| headers.refunded(&refunded))
    }
}

/// Warns of a refund that failed: its units stay counted until they leave
/// the window, so the client is held to the limit a little longer.
fn report(outcome: Result<(), crate::store::StoreError>) {
    if let Err(error) = outcome
        && let Some(held_back) = REFUND_FAILURES.admit()
    {
        tracing::warn!(%error, held_back, "rate-limit refund failed; the units stay counted");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::HeaderMap;

    use super::*;
    use crate::Policy;
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
            Decision::admitted(10, 5, Duration::from_secs(30)),
            Decision::admitted(3, 1, Duration::from_secs(50)),
            Decision::admitted(100, 2, Duration::from_secs(3000)),
        ]
        .into();
        let source = |decisions: &Decisions| HeaderSource {
            checks: checks.clone(),
            decisions: decisions.clone(),
            decided: Instant::now(),
            ietf_policy: None,
            style: HeaderStyle::Both,
            reset_format: ResetFormat::DeltaSeconds,
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
